"""What tools/preprocess_data.py leaves for training to check: the tokenizer record next to the dataset,
the first document of a file that starts with a UTF-8 byte order mark, and a progress line every
--log-interval documents. (Empty output and corrupt input are rows of tests/functional_tests/bad_inputs_run.py.)"""

import json

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.tokenizer_record import read_tokenizer_record

from .tool_loader import load_tool

preprocess_data = load_tool("preprocess_data")


def _gpt2_files(tmp_path) -> list:
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
            "--merge-file", str(tmp_path / "merges.txt")]


def test_bom_record_and_progress_every_n_documents(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"\xef\xbb\xbf" + b"".join(b'{"text": "%s"}\n' % (b"ab" * (i + 1)) for i in range(7)))
    prefix = str(tmp_path / "out")
    argv = ["--input", str(corpus), "--output-prefix", prefix, "--workers", "1", "--log-interval", "2"]
    assert preprocess_data.main(argv + _gpt2_files(tmp_path)) == 0

    dataset = IndexedDataset(prefix + "_text_document")
    assert len(dataset) == 7 and dataset[0].tolist() == [2]  # the first document, after the BOM, is kept
    record = read_tokenizer_record(prefix + "_text_document")
    assert record["tokenizer_type"] == "GPT2BPETokenizer" and record["vocab_size"] == 4
    assert set(record["vocabulary_files"]) == {"vocab_file", "merge_file"}
    progress = [line.split(" documents")[0] for line in capsys.readouterr().err.splitlines()
                if line.startswith("Processed ")]
    assert progress == ["Processed 2", "Processed 4", "Processed 6"]
