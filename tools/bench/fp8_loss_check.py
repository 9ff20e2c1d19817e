"""FP8 against bf16 on real text: the same model trained the same steps on the same data each way; the FP8
losses must stay within 1% of bf16's. One GPU of compute capability 8.9+ (H100/H200).

    python tools/bench/fp8_loss_check.py                         # small Llama-style model, 200 steps, ~3 min
    python tools/bench/fp8_loss_check.py --model llama-3.6b      # the benchmark 3.6B shape (global batch 2)
    python tools/bench/fp8_loss_check.py --variants "bf16=;fp8=--fp8-format hybrid;e4m3=--fp8-format e4m3"

Data, built once under --workdir: the quick start's pipeline (tools/build_stdlib_corpus.py, a GPT-2-style
BPE of 32000 tokens from tools/train_tokenizer.py, tools/preprocess_data.py). Each variant is one
`pretrain_gpt.py` run (bf16, same seed, same sample order, no dropout) with its extra flags; the first
variant is the reference. Compared: the mean training loss of the last 10 steps (one step's loss is noisy)
and the validation loss after the last step (the same held-out batches for every variant). Prints one table;
exits 1 when an FP8 variant is further than --tolerance (relative) from the reference on either.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB_SIZE = 32000
FP8 = "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
LLAMA = ("--group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear")
MODELS = {
    "small": f"{LLAMA} --num-layers 12 --hidden-size 768 --num-attention-heads 12 --num-query-groups 4 "
             "--ffn-hidden-size 2048 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 "
             "--global-batch-size 32 --lr 6e-4 --min-lr 6e-5",
    "llama-3.6b": f"{LLAMA} --num-layers 28 --hidden-size 3072 --num-attention-heads 24 --num-query-groups 8 "
                  "--ffn-hidden-size 8192 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 "
                  "--global-batch-size 2 --lr 3e-4 --min-lr 3e-5",
}
COMMON = ("--bf16 --hidden-dropout 0 --attention-dropout 0 --lr-decay-style cosine --lr-warmup-iters 20 "
          "--weight-decay 0.1 --clip-grad 1.0 --seed 1234 --split 98,2,0 --num-workers 2 --log-interval 1 "
          "--eval-iters 10")
TRAINING_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?tokens/s/GPU: (\d+).*?lm loss: ([0-9.E+-]+)")
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def step(command: list[str], what: str) -> str:
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"{what}: {time.time() - started:.0f} s", flush=True)
    return done.stdout


def build_data(workdir: str) -> list[str]:
    """The corpus, tokenizer and .bin/.idx under `workdir` (kept between calls); the data flags."""
    corpus, tokenizer, prefix = (os.path.join(workdir, name) for name in ("stdlib.jsonl", "tokenizer", "stdlib"))
    vocab, merges = os.path.join(tokenizer, "vocab.json"), os.path.join(tokenizer, "merges.txt")
    os.makedirs(workdir, exist_ok=True)
    if not os.path.exists(corpus):
        step([sys.executable, "tools/build_stdlib_corpus.py", "--output", corpus], "corpus")
    if not os.path.exists(merges):
        step([sys.executable, "tools/train_tokenizer.py", "--input", corpus, "--type", "gpt2", "--vocab-size",
              str(VOCAB_SIZE), "--output-dir", tokenizer], "tokenizer")
    if not os.path.exists(prefix + "_text_document.idx"):
        step([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
              "--append-eod", "--workers", str(min(16, os.cpu_count() or 1))], "preprocess")
    return ["--data-path", prefix + "_text_document", "--vocab-file", vocab, "--merge-file", merges]


def train(options, label: str, flags: str, data: list[str]) -> dict:
    """One variant: {losses: {step: loss}, validation, tokens_per_s (median over the second half)}."""
    command = [sys.executable, "pretrain_gpt.py", *shlex.split(f"{COMMON} {MODELS[options.model]} {flags}"),
               "--train-iters", str(options.steps), "--eval-interval", str(options.steps), *data]
    output = step(command, f"train {label}")
    losses = {int(match[0]): float(match[2]) for match in TRAINING_LINE.findall(output)}
    rates = sorted(int(match[1]) for match in TRAINING_LINE.findall(output)[options.steps // 2:])
    validation = [float(match[1]) for match in VALIDATION_LINE.findall(output) if int(match[0]) == options.steps]
    if sorted(losses) != list(range(1, options.steps + 1)) or not validation:
        raise SystemExit(f"train {label}: could not read the losses of {options.steps} steps:\n{output[-3000:]}")
    return {"losses": losses, "validation": validation[0], "tokens_per_s": rates[len(rates) // 2]}


def last_steps_mean(losses: dict, count: int = 10) -> float:
    steps = sorted(losses)[-count:]
    return sum(losses[step] for step in steps) / len(steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest relative loss difference to bf16")
    parser.add_argument("--variants", default=f"bf16=;fp8={FP8}",
                        help="'label=extra pretrain_gpt.py flags' separated by ';', the first is the reference")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "data", "fp8_loss_check"))
    options = parser.parse_args()
    variants = [entry.partition("=")[::2] for entry in options.variants.split(";") if entry.strip()]
    data = build_data(options.workdir)
    results = [(label.strip(), flags, train(options, label.strip(), flags, data)) for label, flags in variants]
    reference = results[0][2]
    failed = False
    lines = [f"{options.model}, {options.steps} steps; loss = mean of the last 10 training steps",
             "| variant | loss step 1 | loss | vs reference | validation loss | vs reference | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for label, flags, result in results:
        loss_change = last_steps_mean(result["losses"]) / last_steps_mean(reference["losses"]) - 1
        validation_change = result["validation"] / reference["validation"] - 1
        if "--fp8-format" in flags and max(abs(loss_change), abs(validation_change)) > options.tolerance:
            failed = True
        lines.append(f"| {label} | {result['losses'][1]:.4f} | {last_steps_mean(result['losses']):.4f} | "
                     f"{loss_change:+.2%} | {result['validation']:.4f} | {validation_change:+.2%} | "
                     f"{result['tokens_per_s'] / 1e3:.1f}k |")
    print("\n".join(lines))
    print(f"{'FAIL' if failed else 'PASS'}: FP8 within {options.tolerance:.0%} of {results[0][0]}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
