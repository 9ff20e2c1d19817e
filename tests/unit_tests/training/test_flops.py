"""The FLOPs formula of the throughput/MFU line against the FLOPs PyTorch counts for one training step
(forward and backward) of the built model, for a DeepSeek-V3-shaped model (multi-latent attention with and
without the query latent, MoE with a shared expert, multi-token prediction) and a Llama-shaped one.

`FlopCounterMode` counts every matmul of the projections, MLPs, experts and output layers; core attention
(QK^T and PV, which it does not count on a CPU) is added as the causal half of its 3 x 2 x s^2 multiply-adds
per head and head width: that part of the formula is this arithmetic itself. Tolerance 1%: the formula leaves
out the router (2.h.E per token) and counts the latent and MTP norms as Megatron-LM does (measured <= 0.3%).
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.training.training_log import num_floating_point_operations
from tests.unit_tests.training.checkpointing.conftest import single_rank  # noqa: F401 (the fixture)
from tests.unit_tests.training.test_memory_estimate import DEEPSEEK_V3, VOCAB, _args, _gpt

SEQ, BATCH = 32, 2
SHORT = ("--seq-length", str(SEQ), "--micro-batch-size", str(BATCH))


def _causal_core_attention_flops(args) -> float:
    """3 (forward, two backward GEMMs) x 2 (multiply-add) x b.s^2/2 x n x (query/key width + value width)."""
    if args.multi_latent_attention:
        widths = args.qk_head_dim + args.qk_pos_emb_head_dim + args.v_head_dim
    else:
        widths = 2 * args.kv_channels
    layers = args.num_layers + (args.mtp_num_layers or 0)
    return 6 * BATCH * SEQ * SEQ / 2 * args.num_attention_heads * widths * layers


def _counted_flops(args) -> float:
    """FLOPs of one forward and backward: the counted GEMMs, and core attention (module docstring)."""
    model = _gpt(args)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with FlopCounterMode(display=False) as counter:
        model(tokens, positions, None, labels=tokens).float().mean().backward()
    gemms = sum(count for op, count in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm",
                                                                                               "aten.bmm"))
    return gemms + _causal_core_attention_flops(args)


@pytest.mark.parametrize("flags", [
    DEEPSEEK_V3,
    DEEPSEEK_V3[:1] + DEEPSEEK_V3[3:],  # no query latent
    ("--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--group-query-attention",
     "--num-query-groups", "2", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
])
def test_formula_matches_the_counted_flops(single_rank, flags):
    args = _args(*flags, *SHORT)
    assert num_floating_point_operations(args, BATCH) == pytest.approx(_counted_flops(args), rel=0.01)
