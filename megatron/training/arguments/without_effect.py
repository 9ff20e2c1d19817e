"""Flags of Megatron-LM that have no effect on a run here, each with the reason: flags that only change
Megatron-LM's speed where this implementation has no counterpart (or always does what they ask for), flags
Megatron-LM itself ignores, and --transformer-impl transformer_engine, whose model runs on this framework's own
layers. They are accepted, so that Megatron-LM's command lines run as written, and
each one given prints one line saying what happens instead: none is ignored silently.

A row is printed when its flag differs from the parser default (or, for a row that lists `values`, when it is
one of them). A flag whose behaviour lands here gets its own code and loses its row.
"""

import argparse
from dataclasses import dataclass

from megatron.core.extensions.transformer_engine import transformer_impl_note
from megatron.training.arguments.parser import given_rows
from megatron.training.arguments.reporting import print_rank_0


@dataclass(frozen=True)
class WithoutEffect:
    flag: str
    reason: str  # why nothing changes, and what happens here
    values: tuple = ()  # empty: any value other than the default


_SPEED_ONLY = "only changes Megatron-LM's speed"

WITHOUT_EFFECT = (
    WithoutEffect("--cross-entropy-loss-fusion", f"{_SPEED_ONLY}; the language-model loss here always runs the "
                                                 "fused vocab-parallel cross entropy (the same values)"),
    WithoutEffect("--no-align-grad-reduce", f"{_SPEED_ONLY}; each pipeline stage here always launches its "
                                            "gradient reduction from its own backward pass, as the flag asks"),
    WithoutEffect("--moe-permute-fusion", f"{_SPEED_ONLY}; the MoE token permutation here is one gather and one "
                                          "scatter-add, with no separate fused kernel"),
    WithoutEffect("--fp8-interval", "Transformer Engine ignores it since v1.8, and so does Megatron-LM"),
    # Megatron-LM's default: printed for every run that keeps it.
    WithoutEffect("--transformer-impl", transformer_impl_note(), values=("transformer_engine",)),
)


def print_without_effect_notes(args: argparse.Namespace) -> None:
    """One line per flag of WITHOUT_EFFECT that `args` sets (rank 0)."""
    for row, shown in given_rows(args, WITHOUT_EFFECT):
        print_rank_0(f"note: {shown} has no effect here: {row.reason}")
