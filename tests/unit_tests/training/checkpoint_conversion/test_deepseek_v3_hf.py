"""DeepSeek-V3 exchange with Hugging Face through tools/checkpoint/convert.py: a tiny DeepSeek-V3-shaped
GPTModel (multi-latent attention with q and kv latents and YaRN, one dense layer then MoE layers with
group-limited sigmoid routing, expert bias, scaling factor and a shared expert) exports to a directory that
`transformers` loads as DeepseekV3ForCausalLM with the same logits and the same greedy generation, and imports
back bitwise; variants without q compression and with plain RoPE, and a dense model.

Tolerance: fp32 logits within atol 1e-4 (observed ~1e-6 at |logits| ~ 5); a missing YaRN concentration
factor, softmax mscale or rotary de-interleaving moves them by > 1e-2.
"""

import json

import pytest
import torch

from megatron.core.inference.generation import generate_tokens
from megatron.training.arguments import parse_args, validate_args
from megatron.training.checkpoint_conversion.convert import main as convert
from megatron.training.checkpoint_conversion.torch_checkpoint import read_torch_checkpoint
from tests.unit_tests.training.checkpoint.conftest import single_rank  # noqa: F401 (the fixture)
from tests.unit_tests.training.checkpoint_conversion.gpt_models import (
    COMMON,
    DEEPSEEK_V3_FLAGS,
    PADDED_VOCAB,
    TRUE_VOCAB,
    build_model,
    logits,
    save_model,
)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 6
pytestmark = pytest.mark.usefixtures("single_rank")


def _args(drop: tuple = (), extra: tuple = ()):
    """The DeepSeek-V3-shaped arguments without the flags in `drop` (each with its value) and with `extra`."""
    flags = list(DEEPSEEK_V3_FLAGS)
    for flag in drop:
        index = flags.index(flag)
        del flags[index:index + 2]
    args = validate_args(parse_args(args_list=[*COMMON, *flags, *extra]))
    args.padded_vocab_size = PADDED_VOCAB
    return args


def _export(tmp_path, args):
    model = build_model(args)
    save_model(model, args, str(tmp_path / "megatron"))
    convert(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", str(tmp_path / "megatron"),
             "--save-dir", str(tmp_path / "hf"), "--true-vocab-size", str(TRUE_VOCAB)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    return model, hf


@pytest.mark.parametrize("drop, extra", [
    ((), ()),
    # queries projected directly, plain RoPE (YaRN's softmax mscale off), a dense model
    (("--q-lora-rank", "--num-experts", "--moe-layer-freq", "--moe-shared-expert-intermediate-size"),
     ("--rope-type", "rope", "--rotary-scaling-factor", "1")),
])
def test_export_matches_transformers_logits_and_greedy_generation(tmp_path, drop, extra):
    model, hf = _export(tmp_path, _args(drop, extra))
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, TRUE_VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(logits(model, tokens)[..., :TRUE_VOCAB], theirs, atol=ATOL, rtol=0)

    hf.generation_config.eos_token_id = None
    prompt = tokens[0, :6].tolist()
    expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    assert generate_tokens(model, [prompt], NEW_TOKENS, vocab_size=TRUE_VOCAB) == [expected]


def test_import_back_gives_bitwise_identical_weights(tmp_path):
    model, _ = _export(tmp_path, _args())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["first_k_dense_replace"], config["n_group"], config["topk_group"]) == (1, 4, 2)
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_interleave"]
    convert(["--model-type", "GPT", "--loader", "hf", "--saver", "core", "--load-dir", str(tmp_path / "hf"),
             "--save-dir", str(tmp_path / "back")])
    state, args, _, _ = read_torch_checkpoint(str(tmp_path / "back"))
    assert args.multi_latent_attention and args.moe_layer_freq == [0, 1, 1, 1] and args.padded_vocab_size == PADDED_VOCAB
    original = model.state_dict()
    assert set(state) == {key for key in original if not key.endswith("_extra_state")}
    for key, tensor in state.items():
        rows = TRUE_VOCAB if key in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(tensor[:rows], original[key][:rows]), key
