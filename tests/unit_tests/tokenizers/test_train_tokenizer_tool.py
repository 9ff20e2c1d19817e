"""tools/train_tokenizer.py end to end: JSONL in, files that the tokenizers and `transformers` load."""

import gzip
import json

import pytest
from transformers import BertTokenizer, GPT2Tokenizer

from megatron.core.tokenizers import BertWordPieceTokenizer, GPT2BPETokenizer
from tests.unit_tests.tools.tool_loader import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("train_tokenizer")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, documents) -> str:
    """Half the documents in a plain JSONL, half in a gzipped one, under one directory."""
    directory = tmp_path_factory.mktemp("corpus")
    half = len(documents) // 2
    with open(directory / "a.jsonl", "w", encoding="utf-8") as file:
        file.writelines(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(documents[:half]))
    with gzip.open(directory / "b.jsonl.gz", "wt", encoding="utf-8") as file:
        file.writelines(json.dumps({"content": d}) + "\n" for d in documents[half:])
    return str(directory)


def test_gpt2(tool, corpus, tmp_path, documents, capsys):
    out = tmp_path / "gpt2"
    assert tool.main(["--input", corpus, "--json-key", "content", "--type", "gpt2", "--vocab-size", "1000",
                      "--output-dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["merges.txt", "vocab.json"]
    assert "Wrote vocab.json and merges.txt (1000 tokens)" in capsys.readouterr().err
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 1000 and vocab["<|endoftext|>"] == 999  # the last id, as GPT-2's 50256
    assert (out / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    ours = GPT2BPETokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    reference = GPT2Tokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    assert ours.eod == 999
    for document in documents[:20]:
        ids = ours.tokenize(document)
        assert ids == reference.encode(document) and ours.detokenize(ids) == document


@pytest.mark.parametrize("case_flag, lower_case", [("--lowercase", True), ("--cased", False)])
def test_wordpiece(tool, corpus, tmp_path, documents, case_flag, lower_case):
    out = tmp_path / "wordpiece"
    assert tool.main(["--input", corpus, "--json-key", "content", "--type", "wordpiece", "--vocab-size", "800",
                      case_flag, "--output-dir", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["vocab.txt"]
    lines = (out / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ours = BertWordPieceTokenizer(str(out / "vocab.txt"), lower_case=lower_case)
    reference = BertTokenizer(str(out / "vocab.txt"), do_lower_case=lower_case)
    text = "Hello World, the Quick brown fox's tale."
    assert ours.tokenize(text) == reference.encode(text, add_special_tokens=False)
    assert ours.unique_identifiers["lower_case"] == str(lower_case)
    assert any(token.startswith("##") for token in lines)
    assert any(token != token.lower() for token in lines[5:]) == (not lower_case)


def test_bad_lines_name_the_file_and_line(tool, tmp_path, capsys):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n{"body": "no text key"}\n', encoding="utf-8")
    assert tool.main(["--input", str(corpus), "--type", "gpt2", "--vocab-size", "300", "--output-dir",
                      str(tmp_path / "out")]) == 1
    assert f"error: {corpus} line 2 has no --json-key 'text' (found: ['body'])" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    corpus.write_text('{"text": "fine"}\nnot json\n', encoding="utf-8")
    assert tool.main(["--input", str(corpus), "--type", "wordpiece", "--output-dir", str(tmp_path / "out")]) == 1
    assert "line 2 is not valid JSON" in capsys.readouterr().err
    assert tool.main(["--input", str(tmp_path / "missing*.jsonl"), "--type", "gpt2", "--output-dir", "x"]) == 1
    assert "no such file" in capsys.readouterr().err
    corpus.write_text('{"text": "fine"}\n', encoding="utf-8")
    assert tool.main(["--input", str(corpus), "--type", "gpt2", "--vocab-size", "100", "--output-dir", "x"]) == 1
    assert "--vocab-size 100 is too small for a byte-level BPE" in capsys.readouterr().err
