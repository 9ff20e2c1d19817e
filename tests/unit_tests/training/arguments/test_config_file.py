"""`--config-file`: YAML keys are flag names, values typed like the command line, the command line wins."""

import argparse

import pytest

from megatron.training.arguments import parse_args

from .conftest import MINIMAL


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_values_are_typed_like_the_command_line(tmp_path):
    path = write(tmp_path, """
hidden-size: 128             # int flag
num_attention_heads: "8"     # a string still goes through the flag's type
lr: 1e-4                     # YAML 1.1 reads this as a string; --lr's float type converts it
min-lr: 1.0e-5
data-path: [0.3, corpus_a, 0.7, corpus_b]
split: 98,2,0
rampup-batch-size: [16, 16, 1000]
normalization: RMSNorm
""")
    args = parse_args(args_list=["--config-file", path])
    assert args.hidden_size == 128 and args.num_attention_heads == 8
    assert args.lr == pytest.approx(1e-4) and args.min_lr == pytest.approx(1e-5)
    assert args.data_path == ["0.3", "corpus_a", "0.7", "corpus_b"]  # strings, as from a shell
    assert args.split == "98,2,0"
    assert args.rampup_batch_size == [16, 16, 1000]
    assert args.normalization == "RMSNorm"


def test_a_scalar_for_an_nargs_flag_is_a_one_element_list(tmp_path):
    args = parse_args(args_list=["--config-file", write(tmp_path, "data-path: my-gpt2_text_document\n")])
    assert args.data_path == ["my-gpt2_text_document"]


def test_switches_by_flag_name_and_by_dest(tmp_path):
    path = write(tmp_path, """
swiglu: true                              # store_true by flag name: the flag is given
untie_embeddings_and_output_weights: true # store_true by dest
no-masked-softmax-fusion: true            # store_false by flag name: the flag is given
bias_dropout_fusion: false                # store_false by dest: the dest's value
disable-bias-linear: false                # a flag name set to false: as if not given
""")
    args = parse_args(args_list=["--config-file", path])
    assert args.swiglu is True and args.untie_embeddings_and_output_weights is True
    assert args.masked_softmax_fusion is False and args.bias_dropout_fusion is False
    assert args.add_bias_linear is True


def test_command_line_overrides_the_file(tmp_path):
    path = write(tmp_path, "hidden-size: 128\nlr: 0.1\nfp16: true\ndata-path: [a, b]\n")
    args = parse_args(args_list=["--hidden-size", "256", "--config-file", path, "--data-path", "c"])
    assert args.hidden_size == 256  # the command line wins wherever the flag sits
    assert args.lr == 0.1 and args.fp16 is True  # untouched file values stay
    assert args.data_path == ["c"]  # an nargs flag is replaced, not appended to


def test_file_values_do_not_count_as_defaults_for_unbuilt_features(tmp_path, problems):
    message = problems("--config-file", write(tmp_path, "fp4-param-gather: true\n"), *MINIMAL)
    assert "--fp4-param-gather: FP4 training is not supported yet" in message


def test_unknown_key_names_the_key_the_file_and_the_closest_flag(tmp_path):
    path = write(tmp_path, "hiden-size: 128\nnum_atention_heads: 8\nlr: 0.1\n")
    with pytest.raises(ValueError) as error:
        parse_args(args_list=["--config-file", path])
    message = str(error.value)
    assert path in message
    assert "unknown key 'hiden-size'; did you mean 'hidden-size' (--hidden-size)?" in message
    assert "unknown key 'num_atention_heads'; did you mean 'num-attention-heads' (--num-attention-heads)?" in message


@pytest.mark.parametrize("text, expected", [
    ("hidden-size: abc\n", "key 'hidden-size' (flag --hidden-size): invalid literal for int()"),
    ("normalization: BatchNorm\n", "'BatchNorm' is not one of ['LayerNorm', 'RMSNorm']"),
    ("fp16: yes please\n", "key 'fp16' (flag --fp16): expects true or false"),
    ("hidden-size: [1, 2]\n", "expects a single value, not a list"),
    ("hidden-size: true\n", "expects a value, not true/false"),
    ("hidden-size: 1\nhidden_size: 2\n", "key 'hidden_size' sets hidden_size a second time"),
    ("- hidden-size\n", "expected a mapping of flag names to values, got list"),
])
def test_bad_values_are_reported_with_the_flag(tmp_path, text, expected):
    with pytest.raises(ValueError) as error:
        parse_args(args_list=["--config-file", write(tmp_path, text)])
    assert expected in str(error.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="--config-file .*nope.yaml: no such file"):
        parse_args(args_list=["--config-file", str(tmp_path / "nope.yaml")])


def test_extra_args_provider_flags_are_valid_keys(tmp_path):
    def extra(parser: argparse.ArgumentParser):
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    args = parse_args(extra, args_list=["--config-file", write(tmp_path, "my_flag: 7\n")])
    assert args.my_flag == 7
