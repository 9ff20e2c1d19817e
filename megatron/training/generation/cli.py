"""The command line of `tools/text_generation_cli.py`: sample text from a training checkpoint.

    python tools/text_generation_cli.py --load checkpoints/gpt --prompt "def main(" --max-new-tokens 64 \\
        --temperature 0.8 --top-p 0.9

Without --prompt it reads prompts from stdin, one per line, until end of input. The generated text
goes to stdout (each prompt followed by its continuation); loading notes go to stderr.
"""

import argparse
import contextlib
import sys

import torch

from megatron.core.inference import SamplingParams, generate
from megatron.training.errors import ArgumentParser, report_user_error
from megatron.training.generation.checkpoint_model import load_model_for_inference


def build_parser() -> argparse.ArgumentParser:
    """The flags; Megatron's spellings (`--top_k`, `--out-seq-length`, ...) are accepted as aliases."""
    parser = ArgumentParser(description="Generate text from a Megatron checkpoint (TP=1, PP=1).")
    source = parser.add_argument_group("checkpoint")
    source.add_argument("--load", required=True, help="checkpoint directory (the --save of the training run)")
    source.add_argument("--ckpt-step", type=int, default=None,
                        help="iteration to load instead of the latest one in latest_checkpointed_iteration.txt")
    source.add_argument("--vocab-file", default=None, help="replaces the vocab file recorded in the checkpoint")
    source.add_argument("--merge-file", default=None, help="replaces the BPE merge file recorded in the checkpoint")
    source.add_argument("--tokenizer-model", default=None,
                        help="replaces the tokenizer model (file or directory) recorded in the checkpoint")
    source.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU when there is one)")

    text = parser.add_argument_group("generation")
    text.add_argument("--prompt", action="append", dest="prompts", default=None,
                      help="a prompt (repeat for a batch); without any, prompts are read from stdin, one per line")
    text.add_argument("--max-new-tokens", "--out-seq-length", "--num-tokens-to-generate", type=int, default=30,
                      dest="max_new_tokens", help="tokens to generate per prompt (fewer when end-of-document comes)")
    text.add_argument("--temperature", type=float, default=1.0, help="divides the logits before sampling")
    text.add_argument("--top-k", "--top_k", type=int, default=0, dest="top_k",
                      help="sample among the k most likely tokens (0: all; 1: greedy)")
    text.add_argument("--top-p", "--top_p", type=float, default=0.0, dest="top_p",
                      help="sample among the most likely tokens holding probability top_p (0: off)")
    text.add_argument("--greedy", action="store_true", help="always take the most likely token")
    text.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    return parser


def _stdin_prompts(stream):
    """Non-empty lines of `stream`, asking for each on a terminal."""
    while True:
        if stream.isatty():
            print("Enter prompt (Ctrl-D to quit): ", end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line:
            return
        prompt = line.rstrip("\r\n")
        if prompt:
            yield prompt


def main(argv=None, stdin=None) -> int:
    """Runs the CLI; returns the exit status (1 with a message on stderr for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        sampling_params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, use_greedy=args.greedy
        )
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        tokenizer_files = {"vocab_file": args.vocab_file, "merge_file": args.merge_file,
                           "tokenizer_model": args.tokenizer_model}
        with contextlib.redirect_stdout(sys.stderr):
            model, tokenizer, _ = load_model_for_inference(args.load, args.ckpt_step, tokenizer_files, args.device)
    except Exception as error:
        if not report_user_error(error):
            raise
        return 1

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(args.seed)

    def complete(prompts):
        texts = generate(model, tokenizer, prompts, args.max_new_tokens, sampling_params, generator)
        for text in texts:
            print(text, flush=True)

    if args.prompts is not None:
        try:
            complete(args.prompts)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        return 0
    for prompt in _stdin_prompts(stdin if stdin is not None else sys.stdin):
        try:
            complete([prompt])
        except ValueError as error:  # one bad prompt (too long, ...) does not end the session
            print(f"error: {error}", file=sys.stderr)
    return 0
