"""Merge every `.bin/.idx` dataset in a directory into one, as Megatron-LM's `tools/merge_datasets.py`.

    python tools/merge_datasets.py --input shards/ --output-prefix merged

Datasets are taken in lexicographic order of their prefixes, and the documents of each follow the
previous ones. All must share one dtype, and datasets whose tokenizer records (`<prefix>.tokenizer`,
written by tools/preprocess_data.py) name different vocabularies are refused; when every input has the
same record, the output gets it too. The output appears only when complete. Needs no torch.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a clone without pip install

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megatron.core.datasets.tokenizer_record import (  # noqa: E402
    describe,
    read_tokenizer_record,
    same_vocabulary,
    write_tokenizer_record,
)
from megatron.training.errors import ArgumentParser, report_user_error, run_entry_point  # noqa: E402


def find_prefixes(directory: str, exclude: str | None = None) -> list[str]:
    """Sorted dataset prefixes in `directory`; every `.bin` needs its `.idx` and vice versa."""
    if not os.path.isdir(directory):
        raise ValueError(f"--input {directory} is not a directory")
    names = os.listdir(directory)
    stems = {os.path.splitext(n)[0] for n in names if n.endswith((".bin", ".idx"))}
    prefixes = []
    for stem in sorted(stems):
        path = os.path.join(directory, stem)
        if exclude is not None and os.path.abspath(path) == os.path.abspath(exclude):
            continue
        missing = [ext for ext in (".bin", ".idx") if stem + ext not in names]
        if missing:
            raise ValueError(f"{path}{missing[0]} is missing: every dataset in --input needs both .bin and .idx")
        prefixes.append(path)
    if not prefixes:
        raise ValueError(f"--input {directory} holds no .bin/.idx datasets")
    return prefixes


def common_tokenizer_record(prefixes: list[str]) -> dict | None:
    """The tokenizer record every input has, None when some have none; ValueError when two differ."""
    records = {prefix: read_tokenizer_record(prefix) for prefix in prefixes}
    known = [(prefix, record) for prefix, record in records.items() if record is not None]
    for prefix, record in known[1:]:
        if same_vocabulary(known[0][1], record) is False:
            raise ValueError(f"{known[0][0]} was tokenized with {describe(known[0][1])} but {prefix} with "
                             f"{describe(record)}: merged, their token ids would mean different words")
    return known[0][1] if known and len(known) == len(prefixes) else None


def merge(prefixes: list[str], output_prefix: str, multimodal: bool = False) -> None:
    first = IndexedDataset(prefixes[0], multimodal=multimodal)
    record = common_tokenizer_record(prefixes)
    with IndexedDatasetBuilder(output_prefix + ".bin", dtype=first.dtype, multimodal=multimodal) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        if record is not None:
            write_tokenizer_record(output_prefix, record)
        builder.finalize(output_prefix + ".idx")


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="directory holding the datasets to merge")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx")
    parser.add_argument("--multimodal", action="store_true", help="the datasets carry sequence modes")
    args = parser.parse_args(argv)
    try:
        prefixes = find_prefixes(args.input, exclude=args.output_prefix)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        merge(prefixes, args.output_prefix, args.multimodal)
    except Exception as error:
        if not report_user_error(error):
            raise
        return 1
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_entry_point(main)
