"""BERT and T5 at TP=2 (with and without sequence parallelism) against TP=1, over several optimizer steps.

On 2 gloo ranks, Megatron-Core's training path (the model, DDP, the no-pipelining schedule with
finalize_model_grads, get_megatron_optimizer with Adam and clipping) runs with the losses of
pretrain_bert.py / pretrain_t5.py (`megatron.training.tasks`). The reference is the same model at TP=1
trained with plain `torch.optim.AdamW` and `clip_grad_norm_` on the same microbatches, its loss written
from Megatron's definitions: per microbatch, BERT = masked-LM token mean + sentence-order mean, T5 =
token mean over `loss_mask`; averaged over the microbatches. Every step the loss, the un-sharded
gradients and the gradient norm must match, and after the last step the un-sharded weights (shards are
merged by parameter name with Megatron-Core's TP layouts, not through the code's metadata).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import get_t5_decoder_with_local_block_spec, get_t5_encoder_with_local_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.tasks import bert as bert_task
from megatron.training.tasks import gpt as gpt_task
from tests.unit_tests.dist_utils import run_distributed

ENC_SEQ, DEC_SEQ, MICRO_BATCH, GLOBAL_BATCH, VOCAB, STEPS = 16, 8, 2, 4, 128, 3
LR, WEIGHT_DECAY, CLIP = 3e-3, 0.01, 0.5
TOLERANCE = 2e-5

_ROWS_SPLIT = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "linear_q.weight",
               "linear_q.bias", "linear_kv.weight", "linear_kv.bias", "word_embeddings.weight",
               "output_layer.weight", "output_layer.bias")
_COLUMNS_SPLIT = ("linear_proj.weight", "linear_fc2.weight")


def _config(tensor_parallel_size: int, sequence_parallel: bool, num_layers: int = 2) -> TransformerConfig:
    return TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tensor_parallel_size,
        sequence_parallel=sequence_parallel, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )


def _build(name: str, tensor_parallel_size: int, sequence_parallel: bool = False):
    torch.manual_seed(13)
    if name == "bert":
        return BertModel(_config(tensor_parallel_size, sequence_parallel), 2, bert_layer_local_spec, VOCAB, ENC_SEQ,
                         share_embeddings_and_output_weights=True)
    decoder_config = _config(tensor_parallel_size, sequence_parallel, num_layers=2)
    encoder_config = copy.deepcopy(decoder_config)
    encoder_config.num_layers = 1
    return T5Model(decoder_config, encoder_config, get_t5_encoder_with_local_block_spec(1),
                   get_t5_decoder_with_local_block_spec(2), VOCAB, ENC_SEQ, share_embeddings_and_output_weights=True)


def _microbatches(name: str) -> list[dict]:
    """STEPS x (GLOBAL_BATCH / MICRO_BATCH) microbatches with the keys of the BERT / T5 datasets."""
    generator = torch.Generator().manual_seed(21)
    batches = []
    for _ in range(STEPS * GLOBAL_BATCH // MICRO_BATCH):
        ids = torch.randint(1, VOCAB, (MICRO_BATCH, ENC_SEQ), generator=generator)
        padding = torch.ones(MICRO_BATCH, ENC_SEQ, dtype=torch.long)
        padding[1, 11:] = 0
        if name == "bert":
            loss_mask = (torch.rand(MICRO_BATCH, ENC_SEQ, generator=generator) < 0.3).long() * padding
            loss_mask[:, 1] = 1
            labels = torch.where(loss_mask.bool(), torch.randint(0, VOCAB, ids.shape, generator=generator), -1)
            types = (torch.arange(ENC_SEQ) >= 6).long().expand(MICRO_BATCH, ENC_SEQ)
            batches.append(dict(text=ids, types=types, labels=labels, loss_mask=loss_mask, padding_mask=padding,
                                is_random=torch.randint(0, 2, (MICRO_BATCH,), generator=generator)))
        else:
            loss_mask = torch.ones(MICRO_BATCH, DEC_SEQ, dtype=torch.long)
            loss_mask[0, 5:] = 0
            batches.append(dict(text_enc=ids, enc_mask=padding, loss_mask=loss_mask,
                                text_dec=torch.randint(1, VOCAB, (MICRO_BATCH, DEC_SEQ), generator=generator),
                                labels=torch.randint(0, VOCAB, (MICRO_BATCH, DEC_SEQ), generator=generator)))
    return batches


def _encoder_padding_keys(batch) -> torch.Tensor:
    return (batch["enc_mask"] == 0)[:, None, None, :]


def _reference_loss(name: str, model, batch) -> torch.Tensor:
    """Megatron's loss of one microbatch, from its definition (see the module docstring)."""
    if name == "bert":
        losses, sop_logits = model(batch["text"], batch["padding_mask"], batch["types"], lm_labels=batch["labels"])
        mask = batch["loss_mask"].float()
        return (losses * mask).sum() / mask.sum() + F.cross_entropy(sop_logits, batch["is_random"])
    padding_keys = _encoder_padding_keys(batch)
    losses = model(batch["text_enc"], batch["text_dec"], padding_keys, None, padding_keys, lm_labels=batch["labels"])
    mask = batch["loss_mask"].float()
    return (losses * mask).sum() / mask.sum()


def _reference_run(name: str) -> list[dict]:
    model = _build(name, 1)
    decayed = [param for param in model.parameters() if param.dim() > 1]
    others = [param for param in model.parameters() if param.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [dict(params=decayed, weight_decay=WEIGHT_DECAY), dict(params=others, weight_decay=0.0)], lr=LR,
    )
    steps = [dict(weights={key: value.clone() for key, value in model.state_dict().items()})]
    per_step = GLOBAL_BATCH // MICRO_BATCH
    batches = _microbatches(name)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum(_reference_loss(name, model, batch) for batch in batches[step * per_step : (step + 1) * per_step])
        loss = loss / per_step
        loss.backward()
        grads = {key: param.grad.clone() for key, param in model.named_parameters()}
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
        optimizer.step()
        steps.append(dict(loss=loss.item(), grads=grads, grad_norm=grad_norm,
                          weights={key: value.clone() for key, value in model.state_dict().items()}))
    return steps


def _unsharded(name: str, tensor: torch.Tensor, group) -> torch.Tensor:
    split_dim = 0 if name.endswith(_ROWS_SPLIT) else 1 if name.endswith(_COLUMNS_SPLIT) else None
    if split_dim is None:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return torch.cat(shards, dim=split_dim)


def _scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def _bert_forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=batch["types"], lm_labels=batch["labels"])
    return output, lambda output_tensor: bert_task.loss_func(batch["loss_mask"], batch["is_random"], output_tensor)


def _t5_forward_step(data_iterator, model):
    batch = next(data_iterator)
    padding_keys = _encoder_padding_keys(batch)
    output = model(batch["text_enc"], batch["text_dec"], padding_keys, None, padding_keys, lm_labels=batch["labels"])
    return output, lambda output_tensor: gpt_task.loss_func(batch["loss_mask"], output_tensor)


def _tensor_parallel_run(name: str, sequence_parallel: bool, reference: list[dict]) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(123)
    group = parallel_state.get_tensor_model_parallel_group()
    module = _build(name, 2, sequence_parallel)
    worst = {"initial weights": max(
        (_unsharded(key, value, group) - reference[0]["weights"][key]).abs().max().item()
        for key, value in module.state_dict().items()
    )}
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    module.config.finalize_model_grads_func = finalize_model_grads
    module.config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP), [model])
    OptimizerParamScheduler(  # sets each group's weight decay (none on biases and norms); constant LR
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=1, lr_decay_style="constant",
        start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY, wd_incr_steps=1, wd_incr_style="constant",
    )
    data = iter(_microbatches(name))
    forward_step = _bert_forward_step if name == "bert" else _t5_forward_step
    for step in range(1, STEPS + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[model],
            num_microbatches=GLOBAL_BATCH // MICRO_BATCH, seq_length=ENC_SEQ, micro_batch_size=MICRO_BATCH,
        )
        expected = reference[step]
        # The reports are [sum, count] pairs; Megatron's loss averages the per-microbatch means.
        means = [sum(pair[0] / pair[1] for pair in report.values()) for report in reports]
        worst[f"loss {step}"] = abs(sum(means).item() / len(means) - expected["loss"])
        worst[f"grads {step}"] = max(
            _scaled_error(_unsharded(key, param.main_grad, group), expected["grads"][key])
            for key, param in module.named_parameters()
        )
        _, grad_norm, _ = optimizer.step()
        worst[f"grad norm {step}"] = abs(grad_norm - expected["grad_norm"]) / expected["grad_norm"]
    worst["final weights"] = max(
        _scaled_error(_unsharded(key, value, group), reference[-1]["weights"][key])
        for key, value in module.state_dict().items()
    )
    parallel_state.destroy_model_parallel()
    return worst


LAYOUTS = [("bert", False), ("bert", True), ("t5", False), ("t5", True)]


def _all_layouts(rank, world_size):
    references = {name: _reference_run(name) for name in ("bert", "t5")}
    return {layout: _tensor_parallel_run(*layout, references[layout[0]]) for layout in LAYOUTS}


def test_bert_and_t5_tensor_parallel_training_matches_tp1_over_several_steps():
    """TP=2 with and without SP: same losses, un-sharded grads, grad norms and final weights as TP=1, and
    bitwise the same initial weights (use_cpu_initialization)."""
    for per_rank in run_distributed(_all_layouts, 2):
        for layout, worst in per_rank.items():
            assert worst.pop("initial weights") == 0.0, layout
            bad = {key: value for key, value in worst.items() if value > TOLERANCE}
            assert not bad, f"{layout}: {bad}"
