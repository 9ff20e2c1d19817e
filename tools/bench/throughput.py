"""Training throughput on one GPU: our GPT next to a plain PyTorch reference of the same shape.

    python tools/bench/throughput.py                          # every configuration of CONFIGS
    python tools/bench/throughput.py --configs gpt2-small --steps 40 --profile-dir /tmp/prof
    python tools/bench/throughput.py --variants "eager=;compiled=--use-torch-compile"   # our flag variants

Each configuration runs in its own process, which times both models one after the other (so machine
noise cancels in the ratio):
- ours through the pieces of `pretrain_gpt.py`: `initialize_megatron`, `setup_model_and_optimizer`
  (DDP with fp32 grad buffers, the mixed-precision fused AdamW), the mock-data iterator and `train_step`
  with `forward_step` of megatron/training/tasks/gpt.py (everything of the train loop but the logging);
- the reference `tools/bench/reference_model.py`: fp32 params, bf16 autocast, SDPA, fused AdamW,
  `torch.compile`, gradient clipping at 1.0 like ours.

Tokens/s is the median over windows of `--window` steps after `--warmup` steps (compilation included in
the warm-up). TFLOP/s uses Megatron's formula (docs/benchmarks.md, `num_floating_point_operations`, causal
attention): B*s*[12*L*h*f*g + 12*L*h^2*r*(1 + q + s/(2h)) + 6*h*V]; MFU = TFLOP/s / 989 (H100/H200 dense
bf16 peak). Memory is `torch.cuda.max_memory_allocated` over the whole run of that model.
"""

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]  # runs from a clone without pip install

from reference_model import ReferenceConfig, build_reference, reference_train_step  # noqa: E402
from step_profile import profile_steps  # noqa: E402

PEAK_TFLOPS = 989.0
COMMON = ("--mock-data --tokenizer-type NullTokenizer --bf16 --hidden-dropout 0 --attention-dropout 0 "
          "--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 "
          "--adam-beta2 0.95 --clip-grad 1.0 --train-iters 1000 --eval-interval 100000 --eval-iters 0 "
          "--num-workers 2")
GPT = "--vocab-size 50304 --position-embedding-type learned_absolute"
LLAMA = ("--vocab-size 128256 --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 --swiglu "
         "--normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--disable-bias-linear")
# name: (megatron flags, reference shape); the benchmark models of docs/benchmarks.md.
CONFIGS = {
    "gpt2-small": (
        f"{GPT} --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
        "--max-position-embeddings 1024 --micro-batch-size 8",
        ReferenceConfig(12, 768, 12, 3072, 50304, 1024),
    ),
    "gpt-1.3b": (
        f"{GPT} --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 4",
        ReferenceConfig(24, 2048, 16, 8192, 50304, 2048),
    ),
    "llama-3.6b": (
        f"{LLAMA} --num-layers 28 --hidden-size 3072 --num-attention-heads 24 --seq-length 4096 "
        "--max-position-embeddings 4096 --micro-batch-size 1",
        ReferenceConfig(28, 3072, 24, 8192, 128256, 4096, num_query_groups=8, swiglu=True, rmsnorm=True,
                        rope=True, bias=False, tied_embeddings=False),
    ),
}


def timed_run(step_fn, warmup: int, steps: int, window: int) -> float:
    """Median seconds per step over windows of `window` steps, after `warmup` steps."""
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(max(steps // window, 1)):
        start = time.perf_counter()
        for _ in range(window):
            step_fn()
        torch.cuda.synchronize()
        seconds.append((time.perf_counter() - start) / window)
    return statistics.median(seconds)


def figures(seconds_per_step: float, tokens_per_step: int, flops_per_step: float) -> dict:
    tflops = flops_per_step / seconds_per_step / 1e12
    return {
        "tokens_per_s": tokens_per_step / seconds_per_step,
        "tflops": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def release_memory() -> None:
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_ours(flags: str, options) -> tuple:
    """Our model through the pretrain_gpt.py components; returns (figures, args) for the reference."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import get_model_config
    from megatron.training.data_iterators import build_train_valid_test_data_iterators
    from megatron.training.global_vars import get_args, get_timers
    from megatron.training.initialize import initialize_megatron
    from megatron.training.tasks.gpt import forward_step, model_provider, train_valid_test_datasets_provider
    from megatron.training.training import setup_model_and_optimizer, train_step
    from megatron.training.training_log import num_floating_point_operations

    sys.argv = [sys.argv[0], *shlex.split(f"{COMMON} {flags}")]
    initialize_megatron()
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, ModelType.encoder_or_decoder)
    config = get_model_config(model[0])
    config.grad_scale_func, config.timers = optimizer.scale_loss, get_timers()
    config.no_sync_func, config.finalize_model_grads_func = model[0].no_sync, finalize_model_grads
    for chunk in model:
        chunk.train()
    train_iterator, _, _ = build_train_valid_test_data_iterators(train_valid_test_datasets_provider)

    def step():
        train_step(forward_step, train_iterator, model, optimizer, scheduler, config)

    seconds = timed_run(step, options.warmup, options.steps, options.window)
    tokens = args.micro_batch_size * args.seq_length
    result = figures(seconds, tokens, num_floating_point_operations(args, args.micro_batch_size))
    if options.profile_dir:
        path = os.path.join(options.profile_dir, f"{options.child}-{options.label}.txt")
        result["profile"] = profile_steps(step, 3, path, options.label)
    return result, args


def run_reference(shape: ReferenceConfig, args, options) -> dict:
    from megatron.training.training_log import num_floating_point_operations

    device = torch.device("cuda")
    model, optimizer = build_reference(shape, device)
    generator = torch.Generator(device=device).manual_seed(0)
    batch = args.micro_batch_size

    def step():
        data = torch.randint(0, shape.vocab_size, (batch, shape.seq_length + 1), device=device, generator=generator)
        reference_train_step(model, optimizer, data[:, :-1], data[:, 1:])

    seconds = timed_run(step, options.warmup, options.steps, options.window)
    result = figures(seconds, batch * shape.seq_length, num_floating_point_operations(args, batch))
    if options.profile_dir:
        path = os.path.join(options.profile_dir, f"{options.child}-reference.txt")
        result["profile"] = profile_steps(step, 3, path, "reference")
    return result


def child(options) -> None:
    """One configuration, both models, in this process; prints one `RESULT {json}` line."""
    flags, shape = CONFIGS[options.child]
    result = {"config": options.child}
    try:
        result["ours"], args = run_ours(f"{flags} {options.ours_extra}", options)
    except torch.OutOfMemoryError:
        result["ours"], args = {"error": "out of memory"}, None
    release_memory()
    if not options.skip_reference:
        if args is None:
            from megatron.training.global_vars import get_args

            args = get_args()
        try:
            result["reference"] = run_reference(shape, args, options)
        except torch.OutOfMemoryError:
            result["reference"] = {"error": "out of memory"}
    print("RESULT " + json.dumps(result), flush=True)


def table(results: list) -> str:
    """One row per configuration and model: ours (each variant) with its ratio to the reference."""
    lines = ["| config | model | tokens/s/GPU | TFLOP/s | MFU | peak GiB | vs reference |", "|---|---|---|---|---|---|---|"]
    for result in results:
        reference = result["reference"] or {}
        rows = [(label, row) for label, row in result["variants"]] + [("reference", reference)] * bool(reference)
        for label, row in rows:
            if "error" in row:
                lines.append(f"| {result['config']} | {label} | {row['error']} | | | | |")
                continue
            ratio = ""
            if label != "reference" and "tokens_per_s" in reference:
                ratio = f"{row['tokens_per_s'] / reference['tokens_per_s']:.2f}x"
            lines.append(
                f"| {result['config']} | {label} | {row['tokens_per_s'] / 1e3:.1f}k | {row['tflops']:.1f} | "
                f"{row['mfu']:.1%} | {row['peak_gib']:.1f} | {ratio} |"
            )
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    parser.add_argument("--variants", default="ours=",
                        help="our runs as 'label=extra pretrain_gpt.py flags', separated by ';'")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (compilation happens here)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--window", type=int, default=5, help="steps per timed window (median over windows)")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--profile-dir", default=None, help="profile 3 steps of each model, tables written here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--label", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--ours-extra", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def run_child(options, name: str, label: str, flags: str, with_reference: bool) -> dict | None:
    """Runs one configuration and variant (and the reference) in a fresh process; its RESULT dict."""
    command = [sys.executable, os.path.abspath(__file__), "--child", name, f"--label={label}",
               f"--ours-extra={flags}", f"--warmup={options.warmup}", f"--steps={options.steps}",
               f"--window={options.window}"]
    command += ["--skip-reference"] * (not with_reference)
    command += [f"--profile-dir={options.profile_dir}"] * bool(options.profile_dir)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"== {name} {label} failed (exit {done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-2500:]}")
        return None
    result = json.loads(lines[-1][len("RESULT "):])
    for key in ("ours", "reference"):
        if "profile" in result.get(key, {}):
            print(f"{name} {result[key]['profile']}")
    return result


def main() -> int:
    options = parse()
    if options.child:
        child(options)
        return 0
    unknown = [name for name in options.configs.split(",") if name not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    variants = [entry.partition("=")[::2] for entry in options.variants.split(";") if entry.strip()]
    if not torch.cuda.is_available():
        raise SystemExit("throughput.py measures GPU training: no CUDA device found")
    if options.profile_dir:
        os.makedirs(options.profile_dir, exist_ok=True)
    results = []
    for name in options.configs.split(","):
        summary = {"config": name, "variants": [], "reference": None}
        for index, (label, flags) in enumerate(variants):
            result = run_child(options, name, label.strip(), flags, index == 0 and not options.skip_reference)
            if result is None:
                continue
            summary["variants"].append((label.strip(), result["ours"]))
            summary["reference"] = summary["reference"] or result.get("reference")
        results.append(summary)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; MFU = TFLOP/s / {PEAK_TFLOPS:g}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
