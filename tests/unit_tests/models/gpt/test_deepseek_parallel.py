"""A DeepSeek-V3-shaped GPTModel (multi-latent attention with YaRN, a dense first layer, MoE layers with
group-limited sigmoid routing, expert bias, scaling factor and a shared expert) on 2 gloo ranks equals the
same model in one process: TP=2, TP=2 with sequence parallelism, EP=2 (x DP=2), the experts' own tensor
parallelism (ETP=2 under DP=2; EP=2 with ETP=1 under TP=2 + SP), PP=2, each also with a
multi-token-prediction depth (its loss logged as "mtp_1 loss"; under PP the last stage's copy of the word
embedding gets the first stage's gradient too), and CP=2.

One spawn runs every layout in turn. Each rank builds its part of the model, loads the reference's weights
(its TP slice, its experts, its pipeline stage's layers), and runs one training step through Megatron-Core's
path (DDP, the schedule of `get_forward_backward_func` with 2 microbatches, 1 per DP rank with DP=2, the GPT task's CP
batch split and loss function, finalize_model_grads). The reference is the whole model in the same process
at TP = EP = PP = CP = 1: the token-mean loss of the global batch and its gradients.

Tolerance (fp32): loss and every gradient within 2e-6 of the reference, relative to the largest entry of the
tensor when that exceeds 1 (measured below 5e-7).
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.core.transformer.moe.moe_utils import set_aux_loss_scale
from megatron.core.transformer.multi_token_prediction import mtp_losses_for_logging
from megatron.core.transformer.pipeline_layer_split import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.training.tasks import gpt as gpt_task
from tests.unit_tests.dist_utils import run_distributed

SEQ, MICRO_BATCH, GLOBAL_BATCH, VOCAB = 16, 2, 4, 64
TOLERANCE = 2e-6
MODEL = dict(
    num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, gated_linear_unit=True,
    activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False, qk_layernorm=True,
    q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rotary_scaling_factor=4.0,
    mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=8,
    num_moe_experts=4, moe_layer_freq=[0, 1, 1, 1], moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
    moe_router_topk=2, moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, pipeline_dtype=torch.float32,
)
LAYOUTS = {
    "TP=2": dict(tensor_model_parallel_size=2),
    "TP=2 + SP": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "EP=2 x DP=2": dict(expert_model_parallel_size=2),
    "ETP=2 x DP=2": dict(expert_tensor_parallel_size=2),
    "TP=2 + SP, EP=2 x ETP=1": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                                    expert_tensor_parallel_size=1),
    "TP=2 + SP, MTP": dict(tensor_model_parallel_size=2, sequence_parallel=True, mtp_num_layers=1),
    "EP=2 x DP=2, MTP": dict(expert_model_parallel_size=2, mtp_num_layers=1),
    "PP=2": dict(pipeline_model_parallel_size=2),
    "PP=2, MTP": dict(pipeline_model_parallel_size=2, mtp_num_layers=1),
    "CP=2": dict(context_parallel_size=2),
}
_MODEL_FIELDS = ("sequence_parallel", "mtp_num_layers")  # the layouts' TransformerConfig-only fields


def _global_batch():
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(GLOBAL_BATCH, SEQ),
                position_ids=torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ))


def _model(layout: dict, pre_process: bool = True, post_process: bool = True) -> GPTModel:
    config = MLATransformerConfig(**MODEL, **layout)
    return GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False), VOCAB, SEQ,
                    position_embedding_type="rope", pre_process=pre_process, post_process=post_process)


def _reference(mtp_num_layers: int | None) -> tuple[dict, dict, dict]:
    """(state dict, {"loss", "mtp_1 loss"}, grads by name) of the whole model in this process."""
    parallel_state.initialize_model_parallel()
    torch.manual_seed(7)
    model = _model(dict(mtp_num_layers=mtp_num_layers))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.1 * torch.rand(4))
    batch = _global_batch()
    set_aux_loss_scale(model.config, num_microbatches=1)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    losses.mean().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    logged = {"loss": losses.mean().item()}
    if mtp_num_layers:
        logged.update({name: value.item() for name, value in mtp_losses_for_logging(mtp_num_layers, 1.0).items()})
    parallel_state.destroy_model_parallel()
    return state, logged, grads


def _reference_name(name: str, model: GPTModel) -> str:
    """The whole model's name of a local parameter: global layer number, global expert number."""
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers."):].split(".", 1)
        name = f"decoder.layers.{int(local) + get_transformer_layer_offset(model.config)}.{rest}"
    if ".local_experts." in name:
        head, tail = name.split(".local_experts.")
        local, rest = tail.split(".", 1)
        first = parallel_state.get_expert_model_parallel_rank() * (MODEL["num_moe_experts"]
                                                                  // parallel_state.get_expert_model_parallel_world_size())
        name = f"{head}.local_experts.{first + int(local)}.{rest}"
    return name


def _local_piece(full: torch.Tensor, param) -> torch.Tensor:
    """This rank's piece of a full tensor, from the parameter's tensor-parallel attributes (each of `stride`
    blocks of the split dimension split over the ranks)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    expert = not getattr(param, "allreduce", True)
    rank = (parallel_state.get_expert_tensor_parallel_rank() if expert
            else parallel_state.get_tensor_model_parallel_rank())
    size = (parallel_state.get_expert_tensor_parallel_world_size() if expert
            else parallel_state.get_tensor_model_parallel_world_size())
    blocks = full.chunk(param.partition_stride, dim=param.partition_dim)
    return torch.cat([block.chunk(size, dim=param.partition_dim)[rank] for block in blocks], dim=param.partition_dim)


def _forward_step(data_iterator, model):
    batch = get_batch_on_this_cp_rank(dict(next(data_iterator)))
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return losses, partial(gpt_task.loss_func, batch["loss_mask"])


def _scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def _layout_errors(layout: dict, reference) -> dict:
    """{what: worst error against the reference} of one training step in `layout`."""
    state, reference_losses, reference_grads = reference
    parallel_state.initialize_model_parallel(**{key: value for key, value in layout.items()
                                                if key not in _MODEL_FIELDS})
    model_parallel_cuda_manual_seed(123)
    module = _model(layout, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if not name.endswith("_extra_state"):
                tensor.copy_(_local_piece(state[_reference_name(name, module)], dict(module.named_parameters()).get(name)))
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    module.config.finalize_model_grads_func = finalize_model_grads
    module.config.no_sync_func = model.no_sync
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batch = _global_batch()
    microbatches = [{key: value[start:start + MICRO_BATCH] for key, value in batch.items()}
                    for start in range(dp_rank * MICRO_BATCH, GLOBAL_BATCH, MICRO_BATCH * dp_size)]
    model.zero_grad_buffer()
    set_aux_loss_scale(module.config, len(microbatches))
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(microbatches), model=model,
        num_microbatches=len(microbatches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
    )
    errors = {}
    if parallel_state.is_pipeline_last_stage():
        loss_and_tokens = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
        dist.all_reduce(loss_and_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        errors["loss"] = abs((loss_and_tokens[0] / loss_and_tokens[1]).item() - reference_losses["loss"])
    if module.config.mtp_num_layers:  # collective over the pipeline and data-parallel ranks
        logged = mtp_losses_for_logging(1, 1.0 / len(microbatches))["mtp_1 loss"].item()
        errors["mtp_1 loss"] = abs(logged - reference_losses["mtp_1 loss"])
    for name, param in module.named_parameters():
        expected = _local_piece(reference_grads[_reference_name(name, module)], param)
        errors[name] = _scaled_error(param.main_grad, expected)
    parallel_state.destroy_model_parallel()
    return errors


def _all_layouts(rank, world_size):
    references = {mtp: _reference(mtp) for mtp in (None, 1)}
    return {name: _layout_errors(layout, references[layout.get("mtp_num_layers")]) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def errors_by_layout():
    return run_distributed(_all_layouts, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process(errors_by_layout, layout):
    for rank_errors in errors_by_layout:
        worst = rank_errors[layout]
        assert max(worst.values()) <= TOLERANCE, sorted(worst.items(), key=lambda item: -item[1])[:3]
    assert any("loss" in rank_errors[layout] for rank_errors in errors_by_layout)
    if "MTP" in layout:
        assert all("mtp_1 loss" in rank_errors[layout] for rank_errors in errors_by_layout)
