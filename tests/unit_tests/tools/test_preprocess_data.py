"""tools/preprocess_data.py end to end: order, round trip, naming, inputs, bad-input policy, atomicity."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer

from .tool_loader import TOOLS, load_tool

preprocess_data = load_tool("preprocess_data")
# A hang in the worker pool fails the test instead of blocking the run (conftest.py).
pytestmark = pytest.mark.usefixtures("hang_guard")


def gpt2_args(files, *extra):
    vocab, merges = files
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, *extra]


def write_lines(path, lines):
    with open(path, "wb") as stream:
        for line in lines:
            stream.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            stream.write(b"\n")
    return str(path)


def texts_of(corpus):
    with open(corpus, encoding="utf-8") as stream:
        return [json.loads(line)["text"] for line in stream]


def test_builtin_corpus_two_workers_in_order_and_round_trips(tmp_path, stdlib_corpus, gpt2_tokenizer_files):
    prefix = str(tmp_path / "stdlib")
    argv = ["--input", stdlib_corpus, "--output-prefix", prefix, "--append-eod", "--workers", "2"]
    assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 0
    dataset = IndexedDataset(prefix + "_text_document")
    tokenizer = GPT2BPETokenizer(*gpt2_tokenizer_files)
    texts = [t for t in texts_of(stdlib_corpus) if t]  # empty files make empty documents, which are skipped
    assert len(dataset) == len(texts) and len(dataset.document_indices) == len(texts) + 1
    assert dataset.dtype == np.uint16
    for i, text in enumerate(texts):
        tokens = dataset[i]
        assert tokens[-1] == tokenizer.eod
        assert tokenizer.detokenize(tokens[:-1].tolist()) == text, f"document {i} does not round-trip"


def test_output_does_not_depend_on_workers_and_equals_per_document_tokenization(tmp_path, gpt2_tokenizer_files):
    texts = ["def f(x):\n    return x + 1\n", "héllo wörld 中文 😀", "   \t\n  spaces  ", "x" * 5000]
    corpus = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in texts * 50])
    outputs = []
    for workers in (1, 3):
        prefix = str(tmp_path / f"w{workers}")
        argv = ["--input", corpus, "--output-prefix", prefix, "--workers", str(workers)]
        assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 0
        outputs.append([open(prefix + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    tokenizer = GPT2BPETokenizer(*gpt2_tokenizer_files)
    with IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16) as builder:
        for text in texts * 50:
            ids = tokenizer.tokenize(text)
            builder.add_document(ids, [len(ids)])
        builder.finalize(str(tmp_path / "ref.idx"))
    assert outputs[0] == [open(tmp_path / ("ref" + ext), "rb").read() for ext in (".bin", ".idx")]


def test_several_json_keys_give_aligned_outputs(tmp_path, gpt2_tokenizer_files):
    records = [{"text": f"body {i}", "title": f"title {i}"} for i in range(20)]
    corpus = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in records])
    prefix = str(tmp_path / "out")
    argv = ["--input", corpus, "--output-prefix", prefix, "--json-keys", "text", "title", "--workers", "2"]
    assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 0
    tokenizer = GPT2BPETokenizer(*gpt2_tokenizer_files)
    for key in ("text", "title"):
        dataset = IndexedDataset(f"{prefix}_{key}_document")
        assert [tokenizer.detokenize(d.tolist()) for d in dataset[0:20]] == [r[key] for r in records]


def test_compressed_glob_and_directory_inputs_match_plain_input(tmp_path, gpt2_tokenizer_files):
    zstandard = pytest.importorskip("zstandard")
    lines = [json.dumps({"text": f"document number {i} " * (i % 7 + 1)}) for i in range(300)]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_lines(shards / "a.jsonl", lines[:100])
    with gzip.open(shards / "b.jsonl.gz", "wb") as stream:
        stream.write(("\n".join(lines[100:200]) + "\n").encode())
    with open(shards / "c.jsonl.zst", "wb") as stream:
        stream.write(zstandard.ZstdCompressor().compress(("\n".join(lines[200:]) + "\n").encode()))
    plain = write_lines(tmp_path / "all.jsonl", lines)

    def run(input_arg, name):
        prefix = str(tmp_path / name)
        assert preprocess_data.main(["--input", input_arg, "--output-prefix", prefix, "--workers", "2"]
                                    + gpt2_args(gpt2_tokenizer_files)) == 0
        return [open(prefix + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx")]

    expected = run(plain, "plain")
    assert run(str(shards), "dir") == expected
    assert run(str(shards / "*.json*"), "glob") == expected


BAD_LINES = [
    ('{"text": "good one"}', None),
    ('{"text": "unterminated', "malformed JSON"),
    ('{"body": "no text key"}', "missing key"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8"),
    ("[1, 2, 3]", "not a JSON object"),
    ('{"text": 42}', "not text"),
    ('{"text": ""}', "empty document"),
    ("", None),  # blank lines are ignored, not errors
    ('{"text": "good two"}', None),
]


def test_bad_lines_are_skipped_and_listed_with_line_numbers(tmp_path, gpt2_tokenizer_files, capsys):
    corpus = write_lines(tmp_path / "in.jsonl", [line for line, _ in BAD_LINES])
    prefix = str(tmp_path / "out")
    assert preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--workers", "2"]
                                + gpt2_args(gpt2_tokenizer_files)) == 0
    err = capsys.readouterr().err
    for number, (_, kind) in enumerate(BAD_LINES, start=1):
        if kind is not None:
            assert f"in.jsonl:{number}: {kind}" in err
    assert "Skipped 6 lines" in err and "Ignored 1 blank lines" in err
    tokenizer = GPT2BPETokenizer(*gpt2_tokenizer_files)
    dataset = IndexedDataset(prefix + "_text_document")
    assert [tokenizer.detokenize(d.tolist()) for d in dataset[0:len(dataset)]] == ["good one", "good two"]


@pytest.mark.parametrize("line, kind", [(line, kind) for line, kind in BAD_LINES if kind is not None])
def test_strict_stops_at_the_first_bad_line_and_writes_nothing(tmp_path, gpt2_tokenizer_files, capsys, line, kind):
    good = ['{"text": "fine"}'] * 3000  # several tasks' worth, so that output was being written
    corpus = write_lines(tmp_path / "in.jsonl", good + [line] + good)
    out = tmp_path / "out"
    argv = ["--input", corpus, "--output-prefix", str(out / "data"), "--strict", "--workers", "2"]
    assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 1
    assert f"in.jsonl:3001: {kind}" in capsys.readouterr().err
    assert os.listdir(out) == []


def test_failure_while_writing_leaves_no_files(tmp_path, gpt2_tokenizer_files, monkeypatch, capsys):
    corpus = write_lines(tmp_path / "in.jsonl", ['{"text": "' + "some text here " * 20 + '"}'] * 10000)
    calls = []

    def failing_add(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return original(self, *args)

    original = IndexedDatasetBuilder.add_documents
    monkeypatch.setattr(IndexedDatasetBuilder, "add_documents", failing_add)
    out = tmp_path / "out"
    argv = ["--input", corpus, "--output-prefix", str(out / "data"), "--workers", "2"]
    assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert len(calls) == 2 and os.listdir(out) == []


def test_progress_line_reports_rates_and_eta(tmp_path, gpt2_tokenizer_files, capsys):
    corpus = write_lines(tmp_path / "in.jsonl", ['{"text": "a line of text"}'] * 50)
    argv = ["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--log-interval", "10", "--workers", "1"]
    assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 0
    err = capsys.readouterr().err
    assert "Processed 50 documents (" in err and "docs/s" in err and "MB/s" in err and "ETA " in err


def test_codeparrot_tutorial_command_with_old_flags(tmp_path, gpt2_tokenizer_files, capsys):
    vocab, merges = gpt2_tokenizer_files
    corpus = write_lines(tmp_path / "codeparrot_data.json", ['{"text": "print(1)"}'] * 5)
    argv = [
        "--input", corpus, "--output-prefix", str(tmp_path / "codeparrot"), "--vocab", vocab,
        "--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer", "--merge-file", merges,
        "--json-keys", "text", "--workers", "2", "--chunk-size", "25",
    ]
    assert preprocess_data.main(argv) == 0
    assert "--dataset-impl and --chunk-size are no longer needed" in capsys.readouterr().err
    assert IndexedDataset.exists(str(tmp_path / "codeparrot_text_document"))


def test_missing_input_and_missing_tokenizer_file_are_clear(tmp_path, gpt2_tokenizer_files, capsys):
    argv = ["--input", str(tmp_path / "nope*.jsonl"), "--output-prefix", str(tmp_path / "o")]
    assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 1
    assert "no such file, and no file matches it as a glob" in capsys.readouterr().err
    corpus = write_lines(tmp_path / "in.jsonl", ['{"text": "x"}'])
    argv = ["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(tmp_path / "missing.json"), "--merge-file", gpt2_tokenizer_files[1]]
    assert preprocess_data.main(argv) == 1
    assert "missing.json" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_find_optimal_num_workers_prints_a_table(tmp_path, gpt2_tokenizer_files, capsys):
    corpus = write_lines(tmp_path / "in.jsonl", ['{"text": "tokens tokens"}'] * 100)
    argv = ["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--find-optimal-num-workers",
            "--workers-to-check", "1", "2", "--max-documents", "50"]
    assert preprocess_data.main(argv + gpt2_args(gpt2_tokenizer_files)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["workers", "docs/s", "MB/s", "tokens/s"] and len(lines) == 3
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def _run_script(args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def test_preprocessing_never_imports_torch(tmp_path, gpt2_tokenizer_files):
    corpus = write_lines(tmp_path / "in.jsonl", ['{"text": "x = 1"}'] * 10)
    code = (
        "import runpy, sys; sys.argv = sys.argv[1:]; "
        "exec(\"try:\\n runpy.run_path(sys.argv[0], run_name='__main__')\\nexcept SystemExit: pass\"); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    script = os.path.join(TOOLS, "preprocess_data.py")
    result = _run_script(["-c", code, script, "--input", corpus, "--output-prefix", str(tmp_path / "o"),
                          "--workers", "2"] + gpt2_args(gpt2_tokenizer_files))
    assert result.returncode == 0, result.stderr
    assert IndexedDataset.exists(str(tmp_path / "o_text_document"))


def _install_trained_punkt(root, text: str) -> str:
    """Trains a punkt model on `text` with nltk's own trainer and installs it as punkt_tab/english."""
    import nltk
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    nltk.data.path.insert(0, str(root))  # nltk only writes inside its data directories
    trainer = PunktTrainer()
    trainer.train(text, finalize=True)
    target = os.path.join(root, "tokenizers", "punkt_tab", "english")
    os.makedirs(target)
    save_punkt_params(trainer.get_params(), target)
    return str(root)


PROSE = (
    "The quick brown fox jumps over the lazy dog. It was not amused! Was it? Dr. Smith said so.\n"
    "A second paragraph starts here. It has two sentences.\n"
)


def test_split_sentences_in_one_pass(tmp_path, wordpiece_vocab, gpt2_tokenizer_files):
    pytest.importorskip("nltk")
    nltk_data = _install_trained_punkt(tmp_path / "nltk_data", PROSE * 200)
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params

    model = nltk.data.find("tokenizers/punkt_tab/english/", paths=[nltk_data])
    reference = PunktSentenceTokenizer(load_punkt_params(model))
    sentences_per_document = len(reference.tokenize(PROSE))
    assert sentences_per_document > 3
    corpus = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": PROSE})] * 4)
    common = ["--input", corpus, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", wordpiece_vocab,
              "--split-sentences", "--workers", "2"]
    result = _run_script([os.path.join(TOOLS, "preprocess_data.py"), *common, "--output-prefix",
                          str(tmp_path / "plain")], {"NLTK_DATA": nltk_data})
    assert result.returncode == 0, result.stderr
    dataset = IndexedDataset(str(tmp_path / "plain_text_sentence"))
    assert len(dataset.document_indices) == 5  # 4 documents
    assert np.diff(dataset.document_indices).tolist() == [sentences_per_document] * 4

    # --keep-newlines keeps the whitespace after each sentence, so the sentences put back together are
    # the document again (checked with the byte-exact GPT-2 tokenizer), less the whitespace at its very
    # end, which punkt drops as Megatron's splitter does.
    kept = ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_tokenizer_files[0],
            "--merge-file", gpt2_tokenizer_files[1], "--split-sentences", "--keep-newlines", "--workers", "2",
            "--output-prefix", str(tmp_path / "kept")]
    result = _run_script([os.path.join(TOOLS, "preprocess_data.py"), *kept], {"NLTK_DATA": nltk_data})
    assert result.returncode == 0, result.stderr
    dataset = IndexedDataset(str(tmp_path / "kept_text_sentence"))
    tokenizer = GPT2BPETokenizer(*gpt2_tokenizer_files)
    first = dataset.document_indices[0:2]
    sentences = [tokenizer.detokenize(dataset[i].tolist()) for i in range(first[0], first[1])]
    assert len(sentences) == sentences_per_document and "".join(sentences) == PROSE.rstrip()


def test_split_sentences_without_punkt_fails_before_any_work(tmp_path, wordpiece_vocab):
    pytest.importorskip("nltk")
    corpus = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": PROSE})])
    empty = tmp_path / "empty_nltk_data"
    empty.mkdir()
    result = _run_script(
        [os.path.join(TOOLS, "preprocess_data.py"), "--input", corpus, "--output-prefix", str(tmp_path / "out" / "x"),
         "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", wordpiece_vocab, "--split-sentences"],
        {"NLTK_DATA": str(empty), "HOME": str(tmp_path)},
    )
    assert result.returncode == 1
    assert "python -m nltk.downloader punkt_tab" in result.stderr
    assert not (tmp_path / "out").exists()
