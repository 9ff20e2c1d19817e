"""Expert parallelism on 4 CPU ranks equals EP = 1: same losses, same (DDP-reduced) gradients, same logged
router losses, for both dispatchers, with data parallelism, with TP = 2 (sequence parallel or not,
expert TP 2 or 1) and with expert TP 2 over TP 1; with expert biases (add_bias_linear) at expert TP 2.

One spawn runs every layout in turn on the same global batch of 4 sequences. Weights come from
`use_cpu_initialization` (the same full weights whatever the layout); each layout's gradients are
reassembled into full tensors named by global expert index and compared with the EP = 1 run, and the
Megatron optimizer's gradient norm (dense and expert statistics reduced over their own groups) must be the
norm of those full gradients: each shard and replica counted once.

Tolerance (fp32): loss and logged router losses 1e-5 relative, gradients 1e-4 relative + 1e-6 absolute;
measured: losses equal or within 1.1e-7, gradients within 8.5e-7 of the largest entry. With capacity
factor 1 every layout keeps the same (token, expert) slots: 113 and 116 of 128 in the two layers.
"""

import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import aux_losses_for_logging, moe_aux_loss_names
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

SEQ, VOCAB, BATCH, EXPERTS = 16, 64, 4, 4
WITH_DROPPING = dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_expert_capacity_factor=1.0)
# The load-balancing loss is taken over each rank's tokens, so it depends on how TP splits them: the TP
# layouts are compared on the z-loss (a per-token mean) without capacity.
Z_LOSS_ONLY = dict(moe_z_loss_coeff=0.01)

LAYOUTS = {
    "ep1": dict(routing=WITH_DROPPING),
    "ep2 allgather": dict(ep=2, routing=WITH_DROPPING),
    "ep4 alltoall": dict(ep=4, dispatcher="alltoall", routing=WITH_DROPPING),
    "ep4 allgather": dict(ep=4, routing=WITH_DROPPING),
    "ep1 z": dict(routing=Z_LOSS_ONLY),
    "tp2 sp ep2 allgather": dict(tp=2, sp=True, ep=2, routing=Z_LOSS_ONLY),
    "tp2 ep2 alltoall": dict(tp=2, ep=2, dispatcher="alltoall", routing=Z_LOSS_ONLY),
    "tp2 sp etp1 ep4 alltoall": dict(tp=2, sp=True, ep=4, etp=1, dispatcher="alltoall", routing=Z_LOSS_ONLY),
    "tp2 etp1 ep4 allgather": dict(tp=2, ep=4, etp=1, routing=Z_LOSS_ONLY),
    "etp2 ep2 alltoall": dict(ep=2, etp=2, dispatcher="alltoall", routing=WITH_DROPPING),
    "ep1 z bias": dict(routing=Z_LOSS_ONLY, bias=True),
    "tp2 sp ep2 allgather bias": dict(tp=2, sp=True, ep=2, routing=Z_LOSS_ONLY, bias=True),
}
# Biases start at zero. The bias layouts set the output biases (fc2, attention projection: [h], whole on
# every rank) to a pattern along h (a constant shift would vanish in the next norm), the others (split
# over TP ranks in some layouts) to a constant, the same in every shard.
BIAS = 0.05
OUTPUT_BIASES = ("linear_fc2.bias", "linear_proj.bias")


def _global_batch():
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _global_name(name: str, first_local_expert: int) -> str:
    """`…local_experts.{i}…` -> the global expert index."""
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + first_local_expert}.", name)


def _shards(model, num_local_experts):
    """(global name, TP rank, TP size, split dim or None, stride, grad) of every parameter on this rank."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    entries = []
    for name, param in model.module.named_parameters():
        expert = not getattr(param, "allreduce", True)
        if expert:
            name = _global_name(name, ep_rank * num_local_experts)
            tp_rank = parallel_state.get_expert_tensor_parallel_rank()
            tp_size = parallel_state.get_expert_tensor_parallel_world_size()
        else:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
        split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        entries.append((name, tp_rank, tp_size, split, getattr(param, "partition_stride", 1), param.main_grad.clone()))
    return entries


def _assemble(all_entries):
    """Full gradients from every rank's shards; replicas of one shard must agree (DP / expert-DP reduction)."""
    shards = {}
    for name, tp_rank, tp_size, split, stride, grad in all_entries:
        previous = shards.setdefault(name, {}).get(tp_rank)
        if previous is not None:
            torch.testing.assert_close(previous[3], grad, msg=f"replicas of {name} disagree")
        shards[name][tp_rank] = (tp_size, split, stride, grad)
    full = {}
    for name, by_rank in shards.items():
        tp_size, split, stride, _ = by_rank[0]
        if split is None:  # a whole copy on every (expert-)TP rank: the copies' gradients must agree too
            for _, _, _, grad in by_rank.values():
                torch.testing.assert_close(grad, by_rank[0][3], msg=f"TP copies of {name} disagree")
            full[name] = by_rank[0][3]
            continue
        # Each rank's shard holds `stride` blocks ([gate_r; up_r]): concatenate block b over ranks, then blocks.
        blocks = [[by_rank[r][3].chunk(stride, dim=split)[b] for r in range(tp_size)] for b in range(stride)]
        full[name] = torch.cat([torch.cat(block, dim=split) for block in blocks], dim=split)
    return full


def _run_layout(tp=1, sp=False, ep=1, etp=None, dispatcher="allgather", routing=(), bias=False):
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=None if bias else 32, moe_layer_freq=[1, 1],
        add_bias_linear=bias, gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp, sequence_parallel=sp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, moe_token_dispatcher_type=dispatcher,
        **dict(routing),
    )
    model = GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False), VOCAB, SEQ)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(OUTPUT_BIASES):
                param.copy_(BIAS * torch.cos(torch.arange(param.numel(), dtype=param.dtype)))
            elif name.endswith(".bias"):
                param.fill_(BIAS)
    kept_slots = []  # per MoE layer, the (token, expert) pairs this rank's router kept after the capacity cut
    for layer in model.decoder.layers:
        layer.mlp.router.register_forward_hook(lambda module, inputs, output: kept_slots.append(output[1].sum()))
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    tokens, labels = (tensor[rows] for tensor in _global_batch())
    positions = torch.arange(SEQ).expand_as(tokens)
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    finalize_model_grads([model])
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0), [model])
    optimizer.prepare_main_grads()
    grad_norm = optimizer.get_grad_norm()  # dense and expert statistics, each reduced over its own groups
    names = moe_aux_loss_names(
        config.moe_router_load_balancing_type, config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    )
    logged = {name: float(value) for name, value in aux_losses_for_logging(names, 2, 2, 1.0).items()}
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=parallel_state.get_data_parallel_group())
    kept = torch.stack(kept_slots)
    dist.all_reduce(kept)  # every token is routed on one rank (TP ranks route their share of positions)
    shards = _shards(model, EXPERTS // ep)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shards)
    parallel_state.destroy_model_parallel()
    if dist.get_rank() != 0:
        return None
    grads = _assemble([entry for rank in gathered for entry in rank])
    full_norm = math.sqrt(sum(float(grad.double().square().sum()) for grad in grads.values()))
    assert grad_norm == pytest.approx(full_norm, rel=1e-5), "each shard and replica must count once"
    return float(mean_loss) / dp_size, logged, grads, kept.tolist()


def _all_layouts(rank, world_size):
    return {name: _run_layout(**layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_layouts, 4)[0]


def _assert_same(result, reference):
    loss, logged, grads, kept = result
    ref_loss, ref_logged, ref_grads, ref_kept = reference
    assert kept == ref_kept  # the capacity cut drops the same slots
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert logged.keys() == ref_logged.keys()
    for name in logged:
        assert logged[name] == pytest.approx(ref_logged[name], rel=1e-5), name
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["ep2 allgather", "ep4 alltoall", "ep4 allgather", "etp2 ep2 alltoall"])
def test_expert_parallel_with_data_parallel_equals_ep1(results, layout):
    _assert_same(results[layout], results["ep1"])


@pytest.mark.parametrize(
    "layout",
    ["tp2 sp ep2 allgather", "tp2 ep2 alltoall", "tp2 sp etp1 ep4 alltoall", "tp2 etp1 ep4 allgather"],
)
def test_expert_parallel_with_tensor_parallel_equals_ep1(results, layout):
    _assert_same(results[layout], results["ep1 z"])


def test_expert_biases_with_expert_tensor_parallel_equal_ep1(results):
    """Each of the 2 expert-TP ranks adds half of fc2's bias, and both copies get its whole gradient."""
    _assert_same(results["tp2 sp ep2 allgather bias"], results["ep1 z bias"])
    grads = results["ep1 z bias"][2]
    assert torch.count_nonzero(grads["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.bias"])


def test_reference_runs_route_drop_and_log(results):
    loss, logged, grads, kept = results["ep1"]
    # Capacity factor 1: each expert takes at most 16 x 2 / 4 = 8 of a rank's 16 tokens; some are dropped.
    assert all(slots < BATCH * SEQ * 2 for slots in kept) and results["ep1 z"][3] == [BATCH * SEQ * 2] * 2
    assert set(logged) == {"load_balancing_loss", "z_loss"} and logged["load_balancing_loss"] >= 1.0
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in grads
    assert all(torch.count_nonzero(grads[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"])
               for e in range(EXPERTS))
