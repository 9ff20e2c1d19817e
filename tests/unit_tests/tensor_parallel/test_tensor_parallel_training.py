"""Several optimizer steps at TP=2 and TP=4 (with and without sequence parallelism) against TP=1.

On 4 gloo ranks, Megatron-Core's training path (GPTModel, DDP, the no-pipelining schedule with
finalize_model_grads, get_megatron_optimizer with Adam and gradient clipping) trains a GPT-2-like and a
Llama-like model (GQA with 2 key/value groups, so fewer groups than TP=4 ranks; SwiGLU, RoPE, RMSNorm,
untied embeddings), and a Qwen3-Next-like one (a Gated DeltaNet layer, then softmax attention with the
output gate and q/k norms; MoE layers with a gated shared expert). The reference is the same model at TP=1 trained with plain `torch.optim.AdamW` and
`clip_grad_norm_` on the same global batch. Every step the loss, the un-sharded gradients and the
gradient norm must match, and after the last step the un-sharded weights. The shards are merged with
Megatron-Core's TP layouts (by parameter name, not through the code's own metadata).

Tolerances in fp32: losses, gradients and gradient norms within 2e-5 (absolute, or relative to the
tensor's largest entry when that exceeds 1; measured <= 1e-6). Weights after the Adam steps within 1e-4
(measured ~4e-5): Adam moves an entry whose gradient is near zero by up to the learning rate (3e-3)
whatever the gradient's size, so the 1e-7 relative differences of the TP reductions show more there.
With `use_cpu_initialization` the initial weights are bitwise equal at every TP size.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.reference_training import adamw_reference_steps

SEQ, MICRO_BATCH, GLOBAL_BATCH, VOCAB, STEPS = 16, 2, 4, 128, 3
LR, WEIGHT_DECAY, CLIP = 3e-3, 0.01, 0.5
TOLERANCE, WEIGHT_TOLERANCE = 2e-5, 1e-4

MODELS = {
    "gpt2": dict(
        config=dict(num_layers=2, hidden_size=64, num_attention_heads=4),
        model=dict(share_embeddings_and_output_weights=True),
    ),
    "llama": dict(
        config=dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        ),
        model=dict(position_embedding_type="rope", share_embeddings_and_output_weights=False),
    ),
}
# Models built with their own layer specs (kept out of MODELS, which other tests build with the local spec).
_QWEN3_NEXT = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
    normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
    qk_layernorm=True, layernorm_zero_centered_gamma=True, attention_output_gate=True,
    experimental_attention_variant="gdn", linear_attention_freq=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=4, linear_num_value_heads=8, num_moe_experts=4, moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
)
SPEC_MODELS = {
    "qwen3-next": dict(config=_QWEN3_NEXT, model=dict(position_embedding_type="rope",
                                                      share_embeddings_and_output_weights=False),
                       spec=lambda config: get_transformer_block_with_experimental_attention_variant_spec(config)),
}
# Column-parallel: rows split (dim 0); row-parallel weights: columns split (dim 1); everything else
# (norms, row-parallel biases, position embeddings, routers, the shared-expert gate) is replicated.
_ROWS_SPLIT = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
               "word_embeddings.weight", "output_layer.weight", "A_log", "dt_bias")
_COLUMNS_SPLIT = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")
# Gated DeltaNet's fused rows: blocks (q, k, v, z, beta, alpha) each split over TP (Megatron-Core's layout).
_QK, _V, _NV = 4 * 8, 8 * 8, 8
_BLOCKS_SPLIT = {"in_proj.weight": (_QK, _QK, _V, _V, _NV, _NV), "conv1d.weight": (_QK, _QK, _V)}


def _build(name: str, tensor_parallel_size: int, sequence_parallel: bool = False, overlap: bool = False) -> GPTModel:
    torch.manual_seed(11)
    model = {**MODELS, **SPEC_MODELS}[name]
    config = TransformerConfig(
        **model["config"], tensor_model_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel,
        tp_comm_overlap=overlap, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    spec = model["spec"](config) if "spec" in model else get_gpt_layer_local_spec()
    return GPTModel(config, spec, VOCAB, SEQ, **model["model"])


def _global_batches():
    """STEPS global batches of GLOBAL_BATCH sequences: (tokens, labels), each [GLOBAL_BATCH, SEQ]."""
    generator = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(STEPS):
        sequences = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        batches.append((sequences[:, :-1], sequences[:, 1:]))
    return batches


POSITIONS = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)


def _reference_loss(model, batch) -> torch.Tensor:
    tokens, labels = batch
    return model(tokens, POSITIONS[:1].expand(GLOBAL_BATCH, SEQ), None, labels=labels).mean()


def _reference_run(name: str) -> list[dict]:
    """TP=1, plain AdamW (no decay on biases and 1-D params, as Megatron) and clip_grad_norm_."""
    return adamw_reference_steps(_build(name, 1), _global_batches(), _reference_loss, LR, WEIGHT_DECAY, CLIP)


def _unsharded(name: str, tensor: torch.Tensor, group, world_size: int, glu: bool) -> torch.Tensor:
    """The full tensor from the TP shards of parameter `name`: QKV rows, fc1 rows
    and vocabulary rows concatenate (QKV shards hold whole query groups, or slices of one group, in order);
    a SwiGLU fc1 shard is [gate_i; up_i], so gates and ups concatenate separately; Gated DeltaNet's fused
    shards hold their part of each block."""
    blocks = next((sizes for suffix, sizes in _BLOCKS_SPLIT.items() if name.endswith(suffix)), None)
    split_dim = 0 if name.endswith(_ROWS_SPLIT) or blocks else 1 if name.endswith(_COLUMNS_SPLIT) else None
    if split_dim is None or world_size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    if glu and "linear_fc1" in name:
        blocks = (tensor.size(0) * world_size // 2,) * 2
    if blocks:
        pieces = zip(*(shard.split([size // world_size for size in blocks]) for shard in shards))
        return torch.cat([torch.cat(block) for block in pieces], dim=0)
    return torch.cat(shards, dim=split_dim)


def _scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    losses = model(tokens, POSITIONS, None, labels=labels)

    def loss_func(output_tensor):
        loss_sum = output_tensor.float().sum()
        num_tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    return losses, loss_func


def _tensor_parallel_run(name, tensor_parallel_size, sequence_parallel, overlap, reference) -> dict:
    """Worst errors against `reference` over the steps, for one layout of the 4 ranks."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    model_parallel_cuda_manual_seed(123)
    group, tp = parallel_state.get_tensor_model_parallel_group(), tensor_parallel_size
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    module = _build(name, tp, sequence_parallel, overlap)
    glu = module.config.gated_linear_unit
    worst = {"initial weights": max(
        (_unsharded(key, value, group, tp, glu) - reference[0]["weights"][key]).abs().max().item()
        for key, value in module.state_dict().items()
    )}
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    module.config.finalize_model_grads_func = finalize_model_grads
    module.config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP), [model])
    OptimizerParamScheduler(  # constant LR and weight decay
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=1, lr_decay_style="constant",
        start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY, wd_incr_steps=1, wd_incr_style="constant",
    )

    # This DP rank's sequences of each global batch, in microbatches of MICRO_BATCH.
    per_rank = GLOBAL_BATCH // dp_size
    microbatches = [
        (tokens[start : start + MICRO_BATCH], labels[start : start + MICRO_BATCH])
        for tokens, labels in _global_batches()
        for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, MICRO_BATCH)
    ]
    data = iter(microbatches)
    for step in range(1, STEPS + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=data, model=[model],
            num_microbatches=per_rank // MICRO_BATCH, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        loss_and_tokens = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
        dist.all_reduce(loss_and_tokens, group=parallel_state.get_data_parallel_group())
        expected = reference[step]
        worst[f"loss {step}"] = abs((loss_and_tokens[0] / loss_and_tokens[1]).item() - expected["loss"])
        worst[f"grads {step}"] = max(
            _scaled_error(_unsharded(key, param.main_grad, group, tp, glu), expected["grads"][key])
            for key, param in module.named_parameters()
        )
        _, grad_norm, _ = optimizer.step()
        worst[f"grad norm {step}"] = abs(grad_norm - expected["grad_norm"]) / expected["grad_norm"]
    worst["final weights"] = max(
        _scaled_error(_unsharded(key, value, group, tp, glu), reference[-1]["weights"][key])
        for key, value in module.state_dict().items()
    )
    parallel_state.destroy_model_parallel()
    return worst


# (model, TP, sequence parallelism, --tp-comm-overlap: its chunked implementation on CPU)
LAYOUTS = [("gpt2", 2, True, False), ("gpt2", 2, True, True), ("gpt2", 4, False, False), ("llama", 2, False, False),
           ("llama", 4, False, False), ("llama", 4, True, False), ("qwen3-next", 2, True, False)]


def _sequence_parallel_dropout(sequence_parallel: bool) -> list[torch.Tensor]:
    """Every rank's residual-stream dropout masks of one TransformerLayer at TP=2: with all weights 0 and all
    biases 1, each sub-layer adds dropout(1) to a zero input, so the output is the sum of the two masks."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel, hidden_dropout=0.5, attention_dropout=0.0, use_cpu_initialization=True,
    )
    layer = build_module(get_gpt_layer_local_spec(), config=config)
    with torch.no_grad():
        for param in layer.parameters():
            param.fill_(0.0 if param.dim() > 1 else 1.0)
    local_sequence = SEQ // 2 if sequence_parallel else SEQ
    output, _ = layer(torch.zeros(local_sequence, MICRO_BATCH, 64), None)
    outputs = [torch.empty_like(output) for _ in range(2)]
    dist.all_gather(outputs, output.detach(), group=parallel_state.get_tensor_model_parallel_group())
    parallel_state.destroy_model_parallel()
    return outputs


def _recompute_difference() -> float:
    """Largest difference in loss and grads between full recompute and none, at TP=2 with SP and dropout:
    the recomputed forward must draw the same per-rank dropout masks."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tokens, labels = _global_batches()[0]
    outcomes = []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        model_parallel_cuda_manual_seed(321)
        torch.manual_seed(11)
        config = TransformerConfig(
            **MODELS["gpt2"]["config"], tensor_model_parallel_size=2, sequence_parallel=True,
            use_cpu_initialization=True, hidden_dropout=0.3, attention_dropout=0.3, **recompute,
        )
        model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ)
        loss = model(tokens[:MICRO_BATCH], POSITIONS, None, labels=labels[:MICRO_BATCH]).sum()
        loss.backward()
        outcomes.append([loss.detach()] + [param.grad for param in model.parameters()])
    parallel_state.destroy_model_parallel()
    return max((a - b).abs().max().item() for a, b in zip(*outcomes))


def _all_checks(rank, world_size, references):
    return {
        "layouts": {layout: _tensor_parallel_run(*layout, references[layout[0]]) for layout in LAYOUTS},
        "dropout": {sequence_parallel: _sequence_parallel_dropout(sequence_parallel) for sequence_parallel in (False, True)},
        "recompute": _recompute_difference(),
    }


@pytest.fixture(scope="module")
def results():
    references = {name: _reference_run(name) for name in {**MODELS, **SPEC_MODELS}}
    return run_distributed(_all_checks, 4, references)


def test_tensor_parallel_training_matches_tp1_over_several_steps(results):
    """TP=2 (x DP=2) and TP=4, with and without SP (TP=2 + SP also with --tp-comm-overlap), GQA with 2 groups at
    TP=4, Gated DeltaNet and the gates of Qwen3-Next: same losses, un-sharded grads (every bias's too), grad norms
    and final weights as TP=1; identical initial weights with use_cpu_initialization."""
    for per_rank in results:
        for layout, worst in per_rank["layouts"].items():
            worst = dict(worst)
            assert worst.pop("initial weights") == 0.0, layout
            weights = worst.pop("final weights")
            assert weights < WEIGHT_TOLERANCE, f"{layout}: final weights differ by {weights}"
            bad = {key: value for key, value in worst.items() if value > TOLERANCE}
            assert not bad, f"{layout}: {bad}"


def test_hidden_dropout_differs_across_tp_ranks_only_under_sequence_parallelism(results):
    """Replicated activations need one mask on every TP rank; sequence-parallel shards need their own."""
    replicated, sequence_parallel = results[0]["dropout"][False], results[0]["dropout"][True]
    for outputs in (replicated, sequence_parallel):
        assert set(torch.cat(outputs).unique().tolist()) == {0.0, 2.0, 4.0}  # two dropout(1) masks, p = 0.5
    assert torch.equal(replicated[0], replicated[1])
    assert not torch.equal(sequence_parallel[0], sequence_parallel[1])


def test_recompute_replays_the_sequence_parallel_dropout(results):
    assert all(per_rank["recompute"] < 1e-6 for per_rank in results), [r["recompute"] for r in results]
