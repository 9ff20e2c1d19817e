"""Throughput of the local experts: one grouped GEMM (`torch._grouped_mm`, `--moe-grouped-gemm`) against
one GEMM per expert, forward + backward, bf16, on one GPU; prints a table.

    python tools/bench/moe_grouped_gemm.py [--iterations 20] [--imbalance 0.5]

Each row is an expert layer shape (local experts, hidden h, expert FFN f, SwiGLU); the tokens routed to
this rank's experts (`tokens` rows = micro-batch tokens x top-k / EP) are spread over the experts with a
Dirichlet draw whose concentration `--imbalance` sets how uneven the loads are. FLOPs per pass:
3 GEMMs (fc1 is 2f wide) x 2 (multiply-add) x tokens x h x f x 3 (forward + two backward GEMMs) = 18 T h f.
Both paths compute the same function; the table also shows their largest output difference.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install
from megatron.core.transformer.moe.experts import GroupedMLP  # noqa: E402
from megatron.core.transformer.moe.grouped_gemm import grouped_mm_supported  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

# (name, local experts, hidden, expert ffn, routed tokens on this rank)
SHAPES = [
    ("Mixtral 8x7B, EP 1", 8, 4096, 14336, 16384),
    ("Mixtral 8x7B, EP 8", 1, 4096, 14336, 16384),
    ("Qwen2-57B-A14B-like, EP 8", 8, 3584, 2560, 32768),
    ("DeepSeek-V2-Lite-like, EP 8", 8, 2048, 1408, 49152),
    ("64 small experts, EP 1", 64, 1024, 512, 32768),
]


def _experts(num_local: int, hidden: int, ffn: int) -> GroupedMLP:
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, num_moe_experts=num_local, moe_ffn_hidden_size=ffn,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, params_dtype=torch.bfloat16,
        moe_grouped_gemm=True, init_method_std=0.01,
        moe_router_topk=1,  # no router here; top-k must only be valid for a layer of `num_local` experts
    )
    return GroupedMLP(num_local, config, list(range(num_local))).cuda()


def _tokens_per_expert(tokens: int, experts: int, imbalance: float, generator: torch.Generator) -> torch.Tensor:
    shares = torch.distributions.Dirichlet(torch.full((experts,), imbalance)).sample()
    counts = torch.floor(shares * tokens).long()
    counts[torch.argmax(counts)] += tokens - counts.sum()
    return counts


def _time_ms(step, iterations: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def _measure(name, experts, hidden, ffn, tokens, options, generator) -> None:
    """Prints one row: the loop over experts against torch._grouped_mm, forward + backward."""
    module = _experts(experts, hidden, ffn)
    rows = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = _tokens_per_expert(tokens, experts, options.imbalance, generator)
    upstream = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_supported(rows, module.linear_fc1.weights()):
        print(f"{name:<30} torch._grouped_mm is not available here (needs compute capability >= 9.0)")
        return
    outputs = {}

    def step(grouped: bool):
        module.use_grouped_mm = grouped
        output = module(rows, counts)
        output.backward(upstream)
        outputs[grouped] = output.detach()

    loop_ms = _time_ms(lambda: step(False), options.iterations)
    grouped_ms = _time_ms(lambda: step(True), options.iterations)
    flops = 18 * tokens * hidden * ffn
    difference = (outputs[True].float() - outputs[False].float()).abs().max().item()
    print(f"{name:<30} {experts:>3} {hidden:>5} {ffn:>6} {tokens:>6} {loop_ms:>8.2f} {grouped_ms:>10.2f} "
          f"{loop_ms / grouped_ms:>6.2f}x {flops / loop_ms / 1e9:>9.0f} {flops / grouped_ms / 1e9:>8.0f} "
          f"{difference:>10.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--imbalance", type=float, default=0.5, help="Dirichlet concentration (large = even).")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, forward + backward")
    header = f"{'shape':<30} {'E':>3} {'h':>5} {'f':>6} {'tokens':>6} {'loop ms':>8} {'grouped ms':>10} " \
             f"{'speedup':>7} {'loop TF/s':>9} {'grp TF/s':>8} {'max |diff|':>10}"
    print(header)
    print("-" * len(header))
    for shape in SHAPES:
        _measure(*shape, options, generator)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
