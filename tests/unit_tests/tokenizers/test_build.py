"""build_tokenizer, add_tokenizer_args and the padded vocabulary, against Megatron's flags and numbers."""

import argparse
import types

import pytest

from megatron.core.tokenizers import (
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    NullTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
from megatron.preprocessing.tokenizer_arguments import add_tokenizer_args


def parse(argv, parser=None):
    if parser is None:
        parser = add_tokenizer_args(argparse.ArgumentParser(allow_abbrev=True))
    else:  # a parser that already has --make-vocab-size-divisible-by, as the training parser does
        add_tokenizer_args(parser, vocab_padding=False)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "vocab, divisible_by, tp, padded",
    [(50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 8, 51200), (50304, 128, 1, 50304),
     (30522, 128, 1, 30592), (32000, 64, 4, 32000), (1, 128, 1, 128)],
)
def test_padded_vocab_size(vocab, divisible_by, tp, padded):
    assert vocab_size_with_padding(vocab, divisible_by, tp) == padded


def test_defaults_are_megatrons():
    args = parse([])
    assert args.tokenizer_type is None and args.vocab_file is None and args.merge_file is None
    assert (args.vocab_extra_ids, args.make_vocab_size_divisible_by, args.tiktoken_num_special_tokens) == (0, 128, 1000)
    assert (args.null_tokenizer_eod_id, args.null_tokenizer_pad_id, args.padded_vocab_size) == (None, -1, None)
    assert args.tokenizer_hf_no_include_special_tokens is False and args.trust_remote_code is False


def test_vocab_alias_and_prefixes():
    # "--vocab" is an exact alias, not an ambiguous prefix of --vocab-size / --vocab-extra-ids.
    assert parse(["--vocab", "v.json", "--vocab-size", "7"]).vocab_file == "v.json"
    assert parse(["--vocab-file", "v.json"]).vocab_file == "v.json"
    assert parse(["--tokenizer-hf-no-include-special-tokens"]).tokenizer_hf_no_include_special_tokens is True
    assert parse(["--tokenizer-hf-include-special-tokens"]).tokenizer_hf_no_include_special_tokens is False


def test_unknown_types_get_a_helpful_message(capsys):
    for value, message in [
        ("HFTokenizer", "is spelt HuggingFaceTokenizer"),
        ("MultimodalTokenizer", "is not supported yet"),
        ("Llama3Tokenizer", "use --tokenizer-type HuggingFaceTokenizer"),
        ("GPT2BPETokeniser", "did you mean GPT2BPETokenizer?"),
    ]:
        with pytest.raises(SystemExit):
            parse(["--tokenizer-type", value])
        assert message in capsys.readouterr().err


def test_coexists_with_the_model_flag_group():
    parser = argparse.ArgumentParser()
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=64)
    assert parse(["--tokenizer-type", "NullTokenizer"], parser).make_vocab_size_divisible_by == 64


def test_builds_and_pads(gpt2_files, capsys):
    args = parse(["--tokenizer-type", "GPT2BPETokenizer", "--vocab", gpt2_files[0], "--merge-file", gpt2_files[1]])
    args.tensor_model_parallel_size = 2
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, GPT2BPETokenizer)
    assert args.padded_vocab_size == 2048  # 2000 -> multiple of 128 * 2
    assert capsys.readouterr().out == (
        "> building GPT2BPETokenizer tokenizer ...\n > padded vocab (size: 2000) with 48 dummy tokens (new size: 2048)\n"
    )


def test_quiet_off_rank_zero_and_keeps_a_given_padded_size(capsys):
    args = parse(["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--padded-vocab-size", "1200"])
    args.rank = 1
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, NullTokenizer) and args.padded_vocab_size == 1200
    assert capsys.readouterr().out == ""
    args.padded_vocab_size = 999
    with pytest.raises(ValueError, match="--padded-vocab-size 999 is smaller than the NullTokenizer vocabulary"):
        build_tokenizer(args)


def test_any_object_with_the_attributes_works(wordpiece_vocab_cased):
    args = types.SimpleNamespace(tokenizer_type="BertWordPieceCase", vocab_file=wordpiece_vocab_cased, rank=1)
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, BertWordPieceTokenizer)
    assert args.padded_vocab_size == vocab_size_with_padding(tokenizer.vocab_size)
    assert tokenizer.unique_identifiers["lower_case"] == "False"


@pytest.mark.parametrize(
    "argv, messages",
    [
        ([], ["--tokenizer-type is required; choose one of BertWordPieceLowerCase"]),
        (["--tokenizer-type", "GPT2BPETokenizer"],
         ["--vocab-file is required by --tokenizer-type GPT2BPETokenizer",
          "--merge-file is required by --tokenizer-type GPT2BPETokenizer"]),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/no/such/vocab.json", "--merge-file", "/no/m.txt"],
         ["--vocab-file '/no/such/vocab.json' (needed by --tokenizer-type GPT2BPETokenizer) does not exist",
          "--merge-file '/no/m.txt' (needed by --tokenizer-type GPT2BPETokenizer) does not exist"]),
        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/"],
         ["--tokenizer-model '/' (needed by --tokenizer-type Llama2Tokenizer) is a directory, not a file"]),
        (["--tokenizer-type", "HuggingFaceTokenizer"], ["--tokenizer-model (a directory or a hub id) is required"]),
        (["--tokenizer-type", "NullTokenizer"], ["--vocab-size is required by --tokenizer-type NullTokenizer"]),
        (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", __file__],
         ["--tiktoken-pattern v1 or v2 is required by --tokenizer-type TikTokenizer"]),
    ],
)
def test_invalid_arguments_are_all_reported(argv, messages):
    with pytest.raises(ValueError) as raised:
        build_tokenizer(parse(argv))
    for message in messages:
        assert message in str(raised.value)
