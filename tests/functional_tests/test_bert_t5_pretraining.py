"""BERT and T5 end to end on a sentence-split slice of the built-in corpus: preprocess -> pretrain_bert.py /
pretrain_t5.py -> falling losses in TensorBoard; TP=2 under torchrun equal to TP=1; the trained BERT exported
with tools/checkpoint/export_bert_hf.py gives the same logits in `transformers`; the example scripts run
with tiny overrides for 2 iterations and pass Megatron's recipe to torchrun.

NLTK's punkt sentence model is trained on the corpus itself with PunktTrainer and installed in a temporary
NLTK_DATA (no download), as tests/unit_tests/tools/test_preprocess_data.py does.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from .harness import ROOT, read_scalars, run
from .test_examples import _environment, _run

TINY_ENCODER = [
    "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "128",
    "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--seed", "1234", "--num-workers", "0",
    "--eval-interval", "1000", "--eval-iters", "1", "--split", "90,10,0",
]
TINY_BERT = TINY_ENCODER + ["--num-layers", "2", "--seq-length", "128"]
TINY_T5 = TINY_ENCODER + ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--encoder-seq-length", "128",
                          "--decoder-seq-length", "64", "--vocab-extra-ids", "100"]


def _install_punkt(nltk_data: str, corpus: str) -> None:
    """A punkt model trained on the corpus, as tokenizers/punkt_tab/english under `nltk_data`."""
    nltk = pytest.importorskip("nltk")
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    with open(corpus) as stream:
        text = "\n".join(json.loads(line)["text"] for line in stream)
    nltk.data.path.insert(0, nltk_data)  # nltk writes only inside its data directories
    trainer = PunktTrainer()
    trainer.train(text, finalize=True)
    target = os.path.join(nltk_data, "tokenizers", "punkt_tab", "english")
    os.makedirs(target)
    save_punkt_params(trainer.get_params(), target)


@pytest.fixture(scope="module")
def sentence_data(tmp_path_factory):
    """60 files of the built-in corpus, a WordPiece vocab trained on them, split into sentences:
    (data flags, vocab.txt)."""
    work = tmp_path_factory.mktemp("sentences")
    corpus = str(work / "stdlib.jsonl")
    run("tools/build_stdlib_corpus.py", ["--output", corpus, "--max-files", "60"])
    run("tools/train_tokenizer.py", ["--input", corpus, "--type", "wordpiece", "--vocab-size", "2000",
                                     "--output-dir", str(work / "tok")])
    vocab = str(work / "tok" / "vocab.txt")
    _install_punkt(str(work / "nltk_data"), corpus)
    run("tools/preprocess_data.py", ["--input", corpus, "--output-prefix", str(work / "stdlib"), "--tokenizer-type",
                                     "BertWordPieceLowerCase", "--vocab-file", vocab, "--split-sentences",
                                     "--workers", "2"], env={"NLTK_DATA": str(work / "nltk_data")})
    return ["--data-path", str(work / "stdlib_text_sentence"), "--vocab-file", vocab], vocab


def _assert_learns(losses: dict, steps: int, drop: float) -> None:
    assert sorted(losses) == list(range(1, steps + 1))
    assert losses[1] > math.log(2000) - 0.5  # starts near uniform over the vocabulary
    assert losses[steps] < losses[1] - drop, (losses[1], losses[steps])


def _checkpoint_model(save_dir: str):
    """(BertModel with the weights of the latest checkpoint, its args, a validation-like sample)."""
    from megatron.core.models.bert import BertModel
    from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.checkpointing.conversion.torch_checkpoint import read_torch_checkpoint

    state, args, _, _ = read_torch_checkpoint(save_dir)
    model = BertModel(core_transformer_config_from_args(args), 2, get_bert_layer_local_spec(), args.padded_vocab_size,
                      args.max_position_embeddings, share_embeddings_and_output_weights=True)
    model.load_state_dict(state)
    return model.eval(), args


def test_bert_learns_and_its_export_gives_the_same_logits_in_transformers(tmp_path, sentence_data):
    transformers = pytest.importorskip("transformers")
    data, vocab = sentence_data
    tensorboard, save = str(tmp_path / "tb"), str(tmp_path / "ckpt")
    # Post-norm (original BERT) and exact GELU: the model BertForPreTraining computes.
    run("pretrain_bert.py", TINY_BERT + data + [
        "--train-iters", "60", "--log-interval", "10", "--tensorboard-dir", tensorboard, "--save", save,
        "--save-interval", "1000", "--apply-residual-connection-post-layernorm", "--no-bias-gelu-fusion",
    ])
    _assert_learns(read_scalars(tensorboard, "lm loss"), 60, drop=1.0)
    sop = read_scalars(tensorboard, "sop loss")
    assert sorted(sop) == list(range(1, 61)) and all(0.3 < value < 1.2 for value in sop.values())

    run("tools/checkpoint/export_bert_hf.py", ["--load", save, "--save-dir", str(tmp_path / "hf")])
    model, args = _checkpoint_model(save)
    reference = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    tokenizer = transformers.BertTokenizer.from_pretrained(str(tmp_path / "hf"))
    encoded = tokenizer(["def main(argv): return parse(argv)", "Raise an error. Tell the user why."],
                        text_pair=["import os", "It is simple."], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits, binary_logits = model(encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"])
        output = reference(**encoded)
    vocab_size = reference.config.vocab_size
    torch.testing.assert_close(logits[..., :vocab_size], output.prediction_logits, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(binary_logits, output.seq_relationship_logits, atol=1e-5, rtol=1e-5)


def test_t5_learns_span_corruption(tmp_path, sentence_data):
    data, _ = sentence_data
    tensorboard = str(tmp_path / "tb")
    run("pretrain_t5.py", TINY_T5 + data + ["--train-iters", "60", "--log-interval", "10",
                                            "--tensorboard-dir", tensorboard])
    _assert_learns(read_scalars(tensorboard, "lm loss"), 60, drop=1.5)


def test_bert_at_tp2_under_torchrun_equals_tp1(tmp_path, sentence_data):
    """The same 8 iterations at TP=1 and at TP=2 on 2 ranks: the same losses (no dropout, and the initial
    weights drawn whole on the CPU, so that both layouts start from the same model)."""
    data, _ = sentence_data
    common = TINY_BERT + data + ["--train-iters", "8", "--log-interval", "1", "--hidden-dropout", "0",
                                 "--attention-dropout", "0", "--use-cpu-initialization"]
    run("pretrain_bert.py", common + ["--tensorboard-dir", str(tmp_path / "tp1")])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
          os.path.join(ROOT, "pretrain_bert.py"), *common, "--tensor-model-parallel-size", "2",
          "--tensorboard-dir", str(tmp_path / "tp2")], cwd=tmp_path)
    for tag in ("lm loss", "sop loss"):
        single, split = read_scalars(str(tmp_path / "tp1"), tag), read_scalars(str(tmp_path / "tp2"), tag)
        assert sorted(split) == list(range(1, 9))
        assert [split[step] for step in range(1, 9)] == pytest.approx([single[step] for step in range(1, 9)],
                                                                        rel=1e-4), tag


EXAMPLE_OVERRIDES = [
    "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "128",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "2", "--lr-decay-iters", "2",
    "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2",
    "--num-workers", "0", "--split", "90,10,0",
]
EXAMPLES = {
    "examples/bert/train_bert_340m_distributed.sh": ["--num-layers", "2", "--seq-length", "128"],
    "examples/t5/train_t5_220m_distributed.sh": ["--encoder-num-layers", "2", "--decoder-num-layers", "2",
                                                 "--kv-channels", "16", "--ffn-hidden-size", "128",
                                                 "--encoder-seq-length", "128", "--decoder-seq-length", "64"],
}


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_script_trains_two_iterations_on_cpu(script, tmp_path, sentence_data):
    data, vocab = sentence_data
    output = _run(["bash", os.path.join(ROOT, script), "ckpt", "tb", vocab, data[1], *EXAMPLE_OVERRIDES,
                   *EXAMPLES[script]], cwd=tmp_path)
    assert "iteration        2/       2 |" in output
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(read_scalars(str(tmp_path / "tb"), "lm loss")) == [1, 2]


def _launched_arguments(script: str, tmp_path) -> list[str]:
    """What `script` hands to pretrain_*.py, recorded by a stand-in torchrun on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD"\n')
    (bin_dir / "torchrun").chmod(0o755)
    environment = _environment(GPUS_PER_NODE="8", RECORD=str(tmp_path / "record"))
    environment["PATH"] = f"{bin_dir}{os.pathsep}{environment['PATH']}"
    subprocess.run(["bash", os.path.join(ROOT, script), "ckpt", "tb", "vocab.txt", "corpus_text_sentence"],
                   cwd=tmp_path, env=environment, check=True, capture_output=True)
    words = (tmp_path / "record").read_text().splitlines()
    return words[next(i for i, word in enumerate(words) if word.endswith(".py")) + 1:]


def _flags(words: list[str]) -> dict:
    """{flag: value (or True)} of a command line."""
    flags = {}
    for index, word in enumerate(words):
        if word.startswith("--"):
            following = words[index + 1] if index + 1 < len(words) else None
            flags[word] = following if following is not None and not following.startswith("--") else True
    return flags


def test_example_scripts_pass_megatrons_recipes(tmp_path):
    """The BERT-Large and T5-Base recipes of Megatron-LM's example scripts."""
    bert = _flags(_launched_arguments("examples/bert/train_bert_340m_distributed.sh", tmp_path / "bert"))
    expected = {"--num-layers": "24", "--hidden-size": "1024", "--num-attention-heads": "16", "--seq-length": "512",
                "--micro-batch-size": "4", "--global-batch-size": "32", "--train-iters": "1000000",
                "--lr": "0.0001", "--lr-decay-style": "linear", "--min-lr": "1.0e-5", "--lr-decay-iters": "990000",
                "--lr-warmup-fraction": ".01", "--weight-decay": "1e-2", "--fp16": True, "--split": "949,50,1",
                "--vocab-file": "vocab.txt", "--data-path": "corpus_text_sentence"}
    assert {flag: bert.get(flag) for flag in expected} == expected
    t5 = _flags(_launched_arguments("examples/t5/train_t5_220m_distributed.sh", tmp_path / "t5"))
    expected = {"--encoder-num-layers": "12", "--decoder-num-layers": "12", "--hidden-size": "768",
                "--num-attention-heads": "12", "--kv-channels": "64", "--ffn-hidden-size": "3072",
                "--encoder-seq-length": "512", "--decoder-seq-length": "128", "--micro-batch-size": "64",
                "--global-batch-size": "512", "--lr": "0.0001", "--lr-decay-style": "linear", "--min-lr": "0.00001",
                "--train-iters": "1000000", "--bf16": True, "--vocab-extra-ids": "100", "--init-method-std": "0.015",
                "--tokenizer-type": "BertWordPieceCase", "--split": "99982,9,9", "--transformer-impl": "transformer_engine"}
    assert {flag: t5.get(flag) for flag in expected} == expected
