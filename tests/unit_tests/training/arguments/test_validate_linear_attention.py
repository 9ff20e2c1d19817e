"""Validation of the Qwen3-Next flags: Gated DeltaNet layers (Megatron-Core's rules, named by flag), the
attention output gate, the shared-expert gate, weight decay on the q/k norms."""

import pytest

from .conftest import MINIMAL

GDN = [*MINIMAL, "--experimental-attention-variant", "gated_delta_net", "--linear-num-key-heads", "4",
       "--linear-num-value-heads", "8", "--linear-key-head-dim", "16", "--linear-value-head-dim", "16"]


def test_qwen3_next_flags_reach_the_arguments(validated):
    args = validated(*GDN, "--linear-attention-freq", "([1]*1+[0]*1)", "--attention-output-gate",
                     "--apply-wd-to-qk-layernorm", "--num-experts", "4", "--moe-shared-expert-intermediate-size", "32",
                     "--moe-shared-expert-gate", "--disable-bias-linear")
    assert args.linear_attention_freq == [1, 0] and args.experimental_attention_variant == "gated_delta_net"
    assert args.attention_output_gate and args.apply_wd_to_qk_layernorm and args.moe_shared_expert_gate
    assert validated(*GDN, "--linear-attention-freq", "4").linear_attention_freq == 4


@pytest.mark.parametrize("extra, expected", [
    ([], "--experimental-attention-variant gated_delta_net needs --linear-attention-freq"),
    (["--linear-attention-freq", "[1,1,1]"], "--linear-attention-freq [1, 1, 1] must hold one 0 or 1 per layer (2)"),
    (["--linear-attention-freq", "every"], "--linear-attention-freq 'every' must be an integer or a 0/1 list"),
    (["--linear-attention-freq", "2", "--linear-num-value-heads", "6"],
     "--linear-num-value-heads 6 must be a multiple of --linear-num-key-heads 4"),
    (["--linear-attention-freq", "2", "--experimental-attention-variant", "dsa"],
     "--experimental-attention-variant dsa is not supported yet; use gated_delta_net (gdn)"),
    (["--linear-attention-freq", "2", "--linear-num-value-heads", "12", "--fp8-format", "hybrid", "--bf16"],
     "FP8 GEMMs need Gated DeltaNet's in_proj width 2 nk dk + 2 nv (dv + 1) = 536 to be a multiple of 16"),
    (["--linear-attention-freq", "2", "--moe-shared-expert-gate"],
     "--moe-shared-expert-gate needs shared experts (--moe-shared-expert-intermediate-size)"),
    (["--linear-attention-freq", "2", "--attention-output-gate", "--multi-latent-attention"],
     "--attention-output-gate with --multi-latent-attention is not supported yet"),
])
def test_linear_attention_problems(problems, extra, expected):
    assert expected in problems(*GDN, *extra)


def test_heads_must_split_over_tensor_parallel_ranks(problems, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    message = problems(*GDN, "--linear-attention-freq", "2", "--tensor-model-parallel-size", "8",
                       "--num-attention-heads", "8")
    assert ("--linear-num-key-heads 4 and --linear-num-value-heads 8 must be divisible by --tensor-model-parallel-size "
            "8; valid TP sizes: 1, 2, 4") in message
