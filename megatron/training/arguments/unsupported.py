"""The one table of flags whose feature is not built yet.

Validation refuses a row's flag when its value differs from the parser default (or, for a row that lists
`values`, when it is one of them), so a run never silently ignores what was asked for. When a feature lands,
delete its row.
"""

import argparse
from dataclasses import dataclass

from megatron.training.arguments.parser import given_rows


@dataclass(frozen=True)
class Unsupported:
    flag: str
    message: str
    values: tuple = ()  # empty: every value other than the default is refused



UNSUPPORTED = (
    Unsupported("--hierarchical-context-parallel-sizes", "is for --cp-comm-type a2a+p2p, which is not supported "
                                                          "yet; use --cp-comm-type p2p or allgather"),
    Unsupported("--fp8-recipe", "is not supported yet; use delayed or tensorwise", ("mxfp8", "blockwise", "custom")),
    Unsupported("--fp4-format", "FP4 training is not supported yet"),
    Unsupported("--fp4-param-gather", "FP4 training is not supported yet"),
    Unsupported("--te-rng-tracker", "the Transformer Engine back end is not supported yet"),
    Unsupported("--transformer-impl", "is not supported yet; use --transformer-impl local", ("inference_optimized",)),
    Unsupported("--position-embedding-type", "is not supported yet; use learned_absolute, rope or none",
                ("yarn", "mrope", "relative")),
    Unsupported("--optimizer", "is not supported yet; use adam, sgd or muon", ("lion", "soap", "adaptive_muon")),
    Unsupported("--ckpt-format", "is not supported yet; use torch_dist or torch", ("torch_dcp", "fsdp_dtensor")),
    Unsupported("--non-persistent-save-interval", "non-persistent checkpoints are not supported yet"),
    Unsupported("--non-persistent-ckpt-type", "non-persistent checkpoints are not supported yet"),
    Unsupported("--adlr-autoresume", "ADLR autoresume needs NVIDIA's internal cluster library"),
    Unsupported("--adlr-autoresume-interval", "ADLR autoresume needs NVIDIA's internal cluster library"),
    Unsupported("--non-persistent-global-ckpt-dir", "non-persistent checkpoints are not supported yet"),
    Unsupported("--fp4-recipe", "FP4 training is not supported yet"),
    Unsupported("--fp32-residual-connection", "keeping the residual stream in fp32 is not supported yet"),
    Unsupported("--optimizer-cpu-offload", "keeping the optimizer state on the host is not supported yet"),
    Unsupported("--error-injection-type", "injecting a correct result needs Megatron-LM's second re-run on another "
                                          "GPU, which is not supported yet", ("correct_result",)),
    Unsupported("--rerun-mode", "the re-run engine's determinism statistics are not supported yet (and Megatron-LM "
                                "itself stops on this value, its engine naming the mode report_determinism_stats)",
                ("report_stats",)),
    Unsupported("--multiple-validation-sets", "evaluating each validation dataset separately is not supported yet"),
    Unsupported("--moe-router-load-balancing-type", "is not supported yet; use aux_loss, seq_aux_loss, sinkhorn or "
                                                    "none", ("global_aux_loss", "quantile_balancing")),
    Unsupported("--moe-router-score-function", "is not supported yet; use softmax or sigmoid", ("sqrtsoftplus",)),
    Unsupported("--moe-token-dispatcher-type", "is not supported yet; use allgather or alltoall", ("flex",)),
)


def find_unsupported(args: argparse.Namespace) -> list:
    """One message per row of UNSUPPORTED that `args` asks for."""
    return [f"{shown}: {row.message}" for row, shown in given_rows(args, UNSUPPORTED)]
