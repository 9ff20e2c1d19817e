"""Throughput of tools/preprocess_data.py against Megatron-LM's preprocessing design, same files, same workers.

    python tools/bench/preprocess_throughput.py --input data/quickstart/stdlib.jsonl \\
        --vocab-file data/quickstart/tokenizer/vocab.json --merge-file data/quickstart/tokenizer/merges.txt \\
        --workers 2

The baseline reproduces Megatron-LM's `tools/preprocess_data.py` design (its `Encoder` and `main`): each
pool worker runs the pure-Python GPT-2 BPE of Megatron's `gpt2_tokenization.py` (regex pre-split,
byte-to-unicode map, greedy lowest-rank merges, a per-worker cache), the parent feeds lines with
`pool.imap(encode, lines, 32)` and is the single writer, one `add_item` + `end_document` per document. Both
runs must produce byte-identical files (checked), so the comparison is like for like. Prints one table;
speed claims come from here, not from tests.
"""

import argparse
import filecmp
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import regex

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode() -> dict:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


class MegatronStyleEncoder:
    """Megatron's per-worker Python BPE (the algorithm of OpenAI's encoder.py), one document per call."""

    def __init__(self, vocab_file, merge_file, json_key, append_eod):
        self.vocab_file, self.merge_file, self.json_key, self.append_eod = vocab_file, merge_file, json_key, append_eod

    def initializer(self):
        with open(self.vocab_file, encoding="utf-8") as stream:
            MegatronStyleEncoder.encoder = json.load(stream)
        with open(self.merge_file, encoding="utf-8") as stream:
            merges = [tuple(line.split()) for line in stream.read().split("\n")[1:] if line]
        MegatronStyleEncoder.ranks = dict(zip(merges, range(len(merges))))
        MegatronStyleEncoder.byte_encoder = _bytes_to_unicode()
        MegatronStyleEncoder.pattern = regex.compile(_PATTERN)
        MegatronStyleEncoder.cache = {}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            first, second = best
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        result = " ".join(word)
        self.cache[token] = result
        return result

    def encode(self, line):
        text = json.loads(line)[self.json_key]
        ids = []
        for token in self.pattern.findall(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self.bpe(token).split(" "))
        if ids and self.append_eod:
            ids.append(self.encoder["<|endoftext|>"])
        return ids, len(line)


def run_megatron_style(args, prefix) -> dict:
    encoder = MegatronStyleEncoder(args.vocab_file, args.merge_file, "text", True)
    with open(args.vocab_file, encoding="utf-8") as stream:
        dtype = DType.optimal_dtype(len(json.load(stream)))
    start = time.time()
    documents = tokens = 0
    with open(args.input, encoding="utf-8") as lines, multiprocessing.Pool(args.workers, encoder.initializer) as pool:
        with IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) as builder:
            for ids, _ in pool.imap(encoder.encode, lines, 32):
                if not ids:
                    continue  # our pipeline drops empty documents; keep the outputs comparable
                builder.add_item(np.array(ids, dtype=dtype))
                builder.end_document()
                documents += 1
                tokens += len(ids)
            builder.finalize(prefix + ".idx")
    return {"seconds": time.time() - start, "documents": documents, "tokens": tokens}


def run_ours(args, prefix) -> dict:
    from megatron.core.tokenizers import build_tokenizer
    from megatron.preprocessing.encoder import EncoderConfig
    from megatron.preprocessing.pipeline import output_prefix_for, preprocess

    tokenizer_args = argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer", vocab_file=args.vocab_file, merge_file=args.merge_file,
        rank=1, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_extra_ids=0,
    )
    dtype = DType.optimal_dtype(build_tokenizer(tokenizer_args).vocab_size)
    config = EncoderConfig(tokenizer_args=tokenizer_args, json_keys=["text"], append_eod=True, dtype=dtype)
    summary = preprocess([args.input], prefix, config, args.workers, log_interval=0)
    os.replace(output_prefix_for(prefix, "text", False) + ".bin", prefix + ".bin")
    os.replace(output_prefix_for(prefix, "text", False) + ".idx", prefix + ".idx")
    return {"seconds": summary.seconds, "documents": summary.documents, "tokens": summary.tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--vocab-file", required=True)
    parser.add_argument("--merge-file", required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        results = {
            "megatron-style": run_megatron_style(args, os.path.join(scratch, "megatron")),
            "ours": run_ours(args, os.path.join(scratch, "ours")),
        }
        identical = all(
            filecmp.cmp(os.path.join(scratch, "megatron" + ext), os.path.join(scratch, "ours" + ext), shallow=False)
            for ext in (".bin", ".idx")
        )
    base = results["megatron-style"]["seconds"]
    input_bytes = os.path.getsize(args.input)
    print(f"\ninput {args.input}, {args.workers} workers, outputs byte-identical: {identical}")
    print(f"{'pipeline':<16}{'seconds':>9}{'docs/s':>10}{'MB/s':>8}{'tokens/s':>12}{'speed-up':>10}")
    for name, r in results.items():
        s = r["seconds"]
        print(
            f"{name:<16}{s:>9.2f}{r['documents'] / s:>10.0f}{input_bytes / 1e6 / s:>8.2f}"
            f"{r['tokens'] / s:>12.0f}{base / s:>9.2f}x"
        )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
