"""GPT pretraining pieces for `pretrain_gpt.py`: model provider, batch, loss, forward step, datasets.

Kept importable (and unit-tested) instead of living in the entry script, which only wires them to `pretrain()`.
The callbacks take the run's arguments first and keep Megatron's signatures once bound (run_callbacks.py).
"""

from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.batch_broadcast import GPT_BATCH_KEYS, get_batch_on_this_tp_rank
from megatron.training.console import print_rank_0
from megatron.training.datasets.blend import get_blend_and_blend_per_split
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.global_vars import get_args, get_timers, get_tokenizer
from megatron.training.run_callbacks import RunCallback


@RunCallback
def model_provider(args, pre_process: bool = True, post_process: bool = True,
                   vp_stage: int | None = None) -> GPTModel:
    """The GPT of the command line's shape (Megatron-Core's `GPTModel` with the local layer spec, which is
    also what --transformer-impl transformer_engine builds: validation says so in one line)."""
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    spec_args = dict(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm,
                     multi_latent_attention=args.multi_latent_attention)
    if args.experimental_attention_variant is not None:  # per layer: Gated DeltaNet or softmax attention
        layer_spec = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage)
    elif args.num_experts is not None:  # per-layer specs: MoE or dense as --moe-layer-freq says
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=args.normalization, vp_stage=vp_stage,
        )
    else:
        layer_spec = get_gpt_layer_local_spec(**spec_args, normalization=args.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )


def samples_carry_attention_mask(args) -> bool:
    """Whether the dataset builds an attention mask and the batches use it: only a reset one
    (--reset-attention-mask), and only when the data loader makes masks (not --no-create-attention-mask-in-
    dataloader). Megatron-LM builds the plain causal [1, s, s] mask by default and its attention kernels then
    ignore it; building it is all its cost: 1 GiB per sample at seq 32768, copied by the DataLoader workers,
    collated and pinned, which stalled a CP=2 step at seq 32768 by ~100 ms on the host. The batches the model
    sees are the same either way."""
    return args.reset_attention_mask and args.create_attention_mask_in_dataloader


def get_batch(data_iterator, with_attention_mask: bool):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of the next microbatch, on the device; the
    attention mask only `with_attention_mask` (`samples_carry_attention_mask`), None otherwise.

    TP rank 0 reads it and broadcasts it to the other ranks of its tensor-parallel group, which hold no
    data iterator. Stages that neither embed nor compute the loss need no data (pipeline parallelism; with
    virtual stages only the first chunk of the first rank and the last chunk of the last rank read it).
    """
    if not (
        parallel_state.is_pipeline_first_stage(ignore_virtual=False)
        or parallel_state.is_pipeline_last_stage(ignore_virtual=False)
    ):
        return None, None, None, None, None
    keys = GPT_BATCH_KEYS
    if not with_attention_mask:
        # The mask is then the plain causal one, which attention applies by itself (and SDPA can then use
        # its flash kernels, which take no explicit mask): it is neither sent nor used.
        keys = tuple(key for key in GPT_BATCH_KEYS if key != "attention_mask")
    # With context parallelism each CP rank keeps its two chunks of the sequence.
    tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)  # None: one process alone
    batch = get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(data_iterator, keys, tp_group=tp_group))
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, args=None):
    """Per-token losses [b, s] -> (Σ loss·mask, Σ mask, {"lm loss": [Σ loss·mask, Σ mask]}).

    With context parallelism (CP = c) each rank holds 1/c of every sequence. As in Megatron's
    pretrain_gpt, the token count is then summed over the CP group and the loss sum multiplied by c: the
    schedule divides by that count and DDP averages the gradients over DP x CP, which gives the gradient of
    the token mean over the whole sequences (exact also when the CP ranks hold different numbers of loss
    tokens). The report keeps this rank's own sums; training sums reports over DP x CP.

    While the re-run engine validates results (--rerun-mode validate_results), this rank's loss sum is
    validated as in Megatron's pretrain_gpt (`validate_loss`) by the checks the run's `args` ask for (the
    forward step binds them; `validate_loss` says what a caller without them gets).
    """
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    validate_loss(loss_sum, args)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size > 1:
        num_tokens = num_tokens.detach().clone()
        dist.all_reduce(num_tokens, group=parallel_state.get_context_parallel_group())
        loss_sum = loss_sum * cp_size
    return loss_sum, num_tokens, {"lm loss": report}


# A loss this many times the largest of a rank's first 100 losses is a spike (Megatron's pretrain_gpt).
SPIKY_LOSS_FACTOR = 10


def validate_loss(loss: torch.Tensor, args=None) -> None:
    """This rank's microbatch loss through the re-run engine, when it validates results: NaN and Inf (with
    --check-for-nan-in-loss-and-grad; fatal, the forward pass being deterministic: no tolerance), spikes
    (with --check-for-spiky-loss; not fatal).

    A compatibility entry point: a loss function bound without `args` (Megatron-LM's `partial(loss_func,
    loss_mask)` in a user's own forward step) reads the run's `get_args()`, which exists whenever the engine
    validates (only the Trainer starts it so)."""
    engine = get_rerun_state_machine()
    if engine.get_mode() != RerunMode.VALIDATE_RESULTS:
        return
    args = args if args is not None else get_args()
    if args.check_for_nan_in_loss_and_grad:
        engine.validate_result(loss, torch.isnan, "found NaN in local forward loss calculation", fatal=True)
        engine.validate_result(loss, torch.isinf, "found Inf in local forward loss calculation", fatal=True)
    if args.check_for_spiky_loss:
        engine.validate_result(loss, partial(engine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                             context="loss"), "Spiky loss", fatal=False)


@RunCallback
def forward_step(args, data_iterator, model):
    """Megatron's GPT forward step: the model returns per-token losses when given labels."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, samples_carry_attention_mask(args)
    )
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, args=args)


def is_dataset_built_on_rank() -> bool:
    """Data is read on TP rank 0 of the first and last pipeline stages (Megatron's rule)."""
    return (
        parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    ) and parallel_state.get_tensor_model_parallel_rank() == 0


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    """The GPT dataset config of the arguments (with --fim-data, the fill-in-the-middle one); an attention
    mask only where the batches use it (`samples_carry_attention_mask`)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    fim = {}
    if args.fim_data:
        tokens = {"prefix": args.fim_prefix_token, "middle": args.fim_middle_token, "suffix": args.fim_suffix_token,
                  "pad": args.fim_pad_token, "eod": args.fim_eod_token}
        fim = {"fim_rate": args.fim_rate, "fim_spm_rate": args.fim_spm_rate, "fim_extra_tokens": tokens,
               "fim_split_sample": args.fim_split_sample, "fim_fragment_rate": args.fim_fragment_rate,
               "fim_no_prefix": args.fim_no_prefix}
    return (GPTFIMDatasetConfig if args.fim_data else GPTDatasetConfig)(
        **fim,
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=samples_carry_attention_mask(args),
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


@RunCallback
def train_valid_test_datasets_provider(args, train_val_test_num_samples):
    """GPT (or mock) datasets for the three splits, built only where `is_dataset_built_on_rank`."""
    config = core_gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTFIMDataset if args.fim_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, is_dataset_built_on_rank, config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


train_valid_test_datasets_provider.is_distributed = True
