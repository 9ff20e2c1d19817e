"""--tp-comm-overlap on GPUs: the sequence-parallel MLP of the GPT 1.3B, equality and time per implementation.

    python tools/bench/tp_overlap_check.py          # launches itself on 2 GPUs (torchrun), ~30 s
                                                    # (without GPUs: 2 CPU processes, gloo, tiny timing shape)

ColumnParallelLinear (fc1, h -> 4h) -> GELU -> RowParallelLinear (fc2, 4h -> h), sequence parallel, TP=2:

1. Equality, fp32, seq 256, micro batch 2, h 256: the output and all gradients of
       plain               all-gather / reduce-scatter beside the GEMMs (the backward ones overlapped)
       symmetric_memory    --tp-comm-overlap through torch.ops.symm_mem (when the GPUs allow it)
       chunked             --tp-comm-overlap through async NCCL collectives and p2p partial sums
   against plain's (max abs difference; the GEMMs are split by rows, so ~1e-6 is expected).
2. Time, bf16, the 1.3B shape (seq 2048, micro batch 4, h 2048): forward + backward of the MLP, median of
   20 after 5 warm-up, per implementation, and the same local GEMMs with no communication (the floor: what
   TP would cost if communication were free). Efficiency = floor / time.
3. The same, captured once in a CUDA graph and replayed (CUDA only): the time without the host's launches,
   which a `--cuda-graph-impl full_iteration` run would see, or why the capture failed; and, in fp32 at the
   shapes of 1., the replay's output and gradients for two new inputs copied into the captured ones against
   plain's eager results on those inputs (the full-iteration graph refuses --tp-comm-overlap until its
   implementations are shown to capture and replay correctly).
4. The collectives alone, at the message size of the MLP's (the [s/2, b, h] bf16 shard): all-gather and
   reduce-scatter, median time and bus bandwidth (bytes each rank sends / time), eager and replayed from a
   CUDA graph: how much of the GEMM-only gap the transfers themselves explain.

The implementations run on separate TP groups of the same two ranks: the overlap implementation is chosen
once per group (comm_overlap.py), and MEGATRON_TP_COMM_OVERLAP_IMPL=chunked makes the second group's chunked.
"""

import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # runs from a clone without pip install
from megatron.core import parallel_state  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, comm_overlap  # noqa: E402
from megatron.core.tensor_parallel.mappings import all_gather_single, reduce_scatter_single  # noqa: E402
from megatron.core.transformer.init_methods import init_method_normal  # noqa: E402


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def mlp(group, overlap: bool, hidden: int, dtype: torch.dtype):
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=overlap,
                                 params_dtype=dtype, use_cpu_initialization=True)
    init = init_method_normal(0.02)
    torch.manual_seed(0)  # the same master weights (use_cpu_initialization) for every implementation
    fc1 = ColumnParallelLinear(hidden, 4 * hidden, config=config, init_method=init, bias=True, tp_group=group)
    fc2 = RowParallelLinear(4 * hidden, hidden, config=config, init_method=init, bias=True, tp_group=group)
    return fc1.to(DEVICE), fc2.to(DEVICE)


def step(layers, x, grad):
    fc1, fc2 = layers
    output, _ = fc2(F.gelu(fc1(x)[0]))
    output.backward(grad)
    return output


def median_ms(function, warmup: int = 5, repeats: int = 20) -> float:
    times = []
    for index in range(warmup + repeats):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            function()
            elapsed = (time.perf_counter() - began) * 1e3
        if index >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def graphed_ms(function) -> float | str:
    """`function` captured in a CUDA graph (after warm-up on the capture's side stream) and replayed: median ms
    of a replay, or why the capture failed."""
    try:
        graph = _captured(function)
    except RuntimeError as error:
        return f"capture failed: {str(error).splitlines()[0][:160]}"
    return median_ms(graph.replay)


def _captured(function):
    """`function` after warm-up on a side stream, captured in a CUDA graph (raises RuntimeError on failure)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        function()
    return graph


def replay_difference(group, plain_group, rank: int) -> float | str:
    """Max abs difference between a graph replay of the overlapped fp32 MLP step (on `group`) and plain's eager
    step (on `plain_group`), output and all gradients, for two inputs copied into the captured buffers."""
    layers, plain = mlp(group, True, 256, torch.float32), mlp(plain_group, False, 256, torch.float32)
    x = torch.zeros(128, 2, 256, device=DEVICE, requires_grad=True)
    grad = torch.zeros(128, 2, 256, device=DEVICE)
    parameters = [p for layer in layers for p in layer.parameters()]
    outputs = []

    def captured_step():
        for tensor in parameters + [x]:
            tensor.grad = None  # the backward allocates fresh gradients: replays rewrite the same ones
        outputs[:] = [step(layers, x, grad)]

    try:
        graph = _captured(captured_step)
    except RuntimeError as error:
        return f"capture failed: {str(error).splitlines()[0][:160]}"
    worst = 0.0
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        x_full, grad_full = torch.randn(256, 2, 256, generator=generator), torch.randn(256, 2, 256, generator=generator)
        with torch.no_grad():
            x.copy_(x_full.chunk(2)[rank])
            grad.copy_(grad_full.chunk(2)[rank])
        graph.replay()
        got = [outputs[0], x.grad] + [p.grad for p in parameters]
        x_eager = x_full.chunk(2)[rank].to(DEVICE).requires_grad_(True)
        for layer in plain:
            layer.zero_grad(set_to_none=True)
        want = [step(plain, x_eager, grad_full.chunk(2)[rank].to(DEVICE)), x_eager.grad]
        want += [p.grad for layer in plain for p in layer.parameters()]
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(got, want)))
    return worst


def collective_lines(group, shard: torch.Tensor) -> list[str]:
    """Time of an all-gather of `shard` and a reduce-scatter into it over `group` (2 ranks), eager and graphed."""
    gathered = shard.new_empty((2 * shard.size(0),) + shard.shape[1:])
    sent = shard.numel() * shard.element_size()  # what each rank sends in either collective on 2 ranks
    lines = []
    for name, function in (("all-gather", lambda: all_gather_single(gathered, shard, group=group)),
                           ("reduce-scatter", lambda: reduce_scatter_single(shard, gathered, group=group))):
        for mode, ms in (("eager", median_ms(function)), ("graphed", graphed_ms(function) if CUDA else None)):
            if isinstance(ms, float):
                lines.append(f"  {name:<15}{mode:<8}{ms * 1e3:8.1f} us  {sent / ms / 1e6:7.1f} GB/s")
            elif ms is not None:
                lines.append(f"  {name:<15}{mode:<8}{ms}")
    return lines


def floor_step(sequence: int, batch: int, hidden: int, dtype):
    """The MLP's local GEMMs at TP=2 (the whole sequence, half the columns), no communication: forward and
    backward, as a function."""
    x = torch.randn(sequence, batch, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    w1 = torch.randn(2 * hidden, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    w2 = torch.randn(hidden, 2 * hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    grad = torch.randn(sequence, batch, hidden, device=DEVICE, dtype=dtype)
    return lambda: F.linear(F.gelu(F.linear(x, w1)), w2).backward(grad)


def main() -> None:
    rank = int(os.environ["RANK"])
    if CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    groups = {"plain": parallel_state.get_tensor_model_parallel_group(),
              "symmetric_memory": parallel_state.get_tensor_model_parallel_group()}
    os.environ[comm_overlap.IMPLEMENTATION_VARIABLE] = comm_overlap.CHUNKED
    groups["chunked"] = dist.new_group([0, 1])
    comm_overlap.implementation(groups["chunked"], torch.device(DEVICE))
    del os.environ[comm_overlap.IMPLEMENTATION_VARIABLE]
    symmetric = comm_overlap.implementation(groups["symmetric_memory"], torch.device(DEVICE))
    names = ["plain", "chunked"] + (["symmetric_memory"] if symmetric == comm_overlap.SYMMETRIC_MEMORY else [])
    lines = [f"symmetric memory for the TP group: {symmetric == comm_overlap.SYMMETRIC_MEMORY}"]

    generator = torch.Generator().manual_seed(0)
    x_full = torch.randn(256, 2, 256, generator=generator)
    grad_full = torch.randn(256, 2, 256, generator=generator)
    outcomes = {}
    for name in names:
        layers = mlp(groups[name], name != "plain", 256, torch.float32)
        x = x_full.chunk(2)[rank].to(DEVICE).requires_grad_(True)
        output = step(layers, x, grad_full.chunk(2)[rank].to(DEVICE))
        outcomes[name] = [output.detach(), x.grad] + [p.grad for layer in layers for p in layer.parameters()]
    for name in names[1:]:
        worst = max((a - b).abs().max().item() for a, b in zip(outcomes[name], outcomes["plain"]))
        lines.append(f"fp32 {name} vs plain: max abs difference {worst:.2e}")

    sequence, batch, hidden = (2048, 4, 2048) if CUDA else (64, 2, 64)
    local_gemms = floor_step(sequence, batch, hidden, torch.bfloat16)
    floor = median_ms(local_gemms)
    lines.append(f"bf16 MLP h {hidden} fwd+bwd, seq {sequence} x mbs {batch}: local GEMMs alone {floor:.2f} ms")
    inputs = {}
    for name in names:
        layers = mlp(groups[name], name != "plain", hidden, torch.bfloat16)
        x = torch.randn(sequence // 2, batch, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(sequence // 2, batch, hidden, device=DEVICE, dtype=torch.bfloat16)
        inputs[name] = layers, x, grad
        ms = median_ms(lambda: step(layers, x, grad))
        lines.append(f"  {name:<17} {ms:7.2f} ms   {100 * floor / ms:5.1f}% of the GEMM-only time")
    if CUDA:
        floor = graphed_ms(local_gemms)
        lines.append(f"captured in a CUDA graph and replayed: local GEMMs alone {floor:.2f} ms")
        for name in names:  # symmetric memory last: a failed capture may leave the stream unusable
            layers, x, grad = inputs[name]
            ms = graphed_ms(lambda: step(layers, x, grad))
            lines.append(f"  {name:<17} " + (ms if isinstance(ms, str) else
                                              f"{ms:7.2f} ms   {100 * floor / ms:5.1f}% of the GEMM-only time"))
        for name in names[1:]:
            difference = replay_difference(groups[name], groups["plain"], rank)
            lines.append(f"fp32 {name}, graph replay vs plain eager: " + (
                difference if isinstance(difference, str) else f"max abs difference {difference:.2e}"))
    shard = torch.randn(sequence // 2, batch, hidden, device=DEVICE, dtype=torch.bfloat16)
    lines.append(f"collectives of one [{sequence // 2}, {batch}, {hidden}] bf16 shard over 2 ranks:")
    lines += collective_lines(groups["plain"], shard)
    if rank == 0:
        print("\n".join(lines), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
        sys.exit(subprocess.run(command, env=dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")).returncode)
