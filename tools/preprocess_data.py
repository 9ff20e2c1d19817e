"""Turn loose JSON (one `{"text": ...}` object per line) into Megatron `.bin/.idx` token datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8

writes `my-gpt2_text_document.bin/.idx` (`_sentence` with `--split-sentences`), byte-compatible with
Megatron-LM. Megatron's flags are accepted, including the old `--dataset-impl` and `--chunk-size`.
Beyond Megatron: `--input` may be a glob or a directory and `.gz`/`.zst` files; memory stays bounded on
any input size; output appears only when complete; bad lines are skipped and listed (or stop the run
with `--strict`). `--partitions` and `--keep-sequential-samples` are accepted, but there is one pipeline:
documents are always written in input order, and the output is the same for every partition count.
Needs no torch.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a clone without pip install

from megatron.core.datasets.indexed_dataset import DType  # noqa: E402
from megatron.core.datasets.tokenizer_record import tokenizer_fingerprint  # noqa: E402
from megatron.core.tokenizers import build_tokenizer  # noqa: E402
from megatron.preprocessing.encoder import EncoderConfig  # noqa: E402
from megatron.preprocessing.inputs import find_input_files  # noqa: E402
from megatron.preprocessing.pipeline import preprocess  # noqa: E402
from megatron.preprocessing.tokenizer_arguments import add_tokenizer_args  # noqa: E402
from megatron.training.errors import ArgumentParser, report_user_error, run_entry_point  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, glob, or directory (.gz/.zst allowed)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    group.add_argument("--split-sentences", action="store_true", help="split documents into sentences (nltk)")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences")
    group.add_argument("--lang", default="english", help="language of the nltk punkt model")
    group.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")

    add_tokenizer_args(parser)
    group = parser.add_argument_group("tokenization")
    group.add_argument("--append-eod", action="store_true", help="append an end-of-document token to each document")

    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_{document|sentence}.bin/.idx")

    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes (default: CPUs)")
    group.add_argument("--partitions", type=int, default=1, help="accepted for Megatron compatibility; see above")
    group.add_argument("--keep-sequential-samples", action="store_true", help="accepted; order is always kept")
    group.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    group.add_argument("--find-optimal-num-workers", action="store_true", help="time --workers-to-check and exit")
    group.add_argument("--workers-to-check", nargs="+", type=int, default=[16, 32, 64])
    group.add_argument("--max-documents", type=int, default=100000, help="documents per --find-optimal-num-workers run")

    group = parser.add_argument_group("removed Megatron flags, accepted so that old commands still run")
    group.add_argument("--dataset-impl", choices=["lazy", "cached", "mmap"], default=None, help=argparse.SUPPRESS)
    group.add_argument("--chunk-size", type=int, default=None, help=argparse.SUPPRESS)

    args = parser.parse_args(argv)
    if args.dataset_impl is not None or args.chunk_size is not None:
        print(
            "note: --dataset-impl and --chunk-size are no longer needed (mmap is the only format and work is "
            "batched automatically); ignoring them",
            file=sys.stderr,
        )
    if args.partitions < 1:
        parser.error(f"--partitions must be at least 1, got {args.partitions}")
    if args.keep_newlines and not args.split_sentences:
        parser.error("--keep-newlines only applies with --split-sentences")
    # As Megatron's script: no TP padding or sentinel tokens matter when writing token ids.
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    args.vocab_extra_ids = 0
    return args


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        paths = find_input_files(args.input)
        tokenizer = build_tokenizer(args)
        if args.split_sentences:
            from megatron.preprocessing.sentences import check_sentence_splitter

            check_sentence_splitter(args.lang)
        elif args.tokenizer_type.startswith("BertWordPiece"):
            print("note: a BERT tokenizer without --split-sentences: BERT/T5 datasets need sentences", file=sys.stderr)
        encoder = EncoderConfig(
            tokenizer_args=args,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            dtype=DType.optimal_dtype(tokenizer.vocab_size),
            split_sentences=args.split_sentences,
            keep_newlines=args.keep_newlines,
            lang=args.lang,
        )
        if args.find_optimal_num_workers:
            return _find_optimal_num_workers(paths, encoder, args)
        summary = preprocess(paths, args.output_prefix, encoder, args.workers, args.log_interval, args.strict,
                             tokenizer_record=tokenizer_fingerprint(args, tokenizer.vocab_size))
    except Exception as error:
        if not report_user_error(error):
            raise
        return 1
    print(summary.report(), file=sys.stderr)
    return 0


def _find_optimal_num_workers(paths, encoder, args) -> int:
    print(f"{'workers':>8} {'docs/s':>10} {'MB/s':>8} {'tokens/s':>12}")
    with tempfile.TemporaryDirectory() as scratch:
        for workers in args.workers_to_check:
            summary = preprocess(
                paths, os.path.join(scratch, f"w{workers}"), encoder, workers, log_interval=0,
                max_documents=args.max_documents,
            )
            seconds = max(summary.seconds, 1e-9)
            print(
                f"{workers:>8} {summary.documents / seconds:>10.0f} {summary.text_bytes / 1e6 / seconds:>8.2f} "
                f"{summary.tokens / seconds:>12.0f}"
            )
    return 0


if __name__ == "__main__":
    run_entry_point(main)
