"""`--deterministic-mode`: bit-exact reproducible runs, as Megatron-LM sets them up.

    validation   refuses the options Megatron-LM refuses with it (--cross-entropy-loss-fusion,
                 --tp-comm-overlap) and launcher-set environment values that are not deterministic
    start-up     fills the library variables (NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0,
                 CUBLAS_WORKSPACE_CONFIG=:4096:8) unless set, before any communicator or cuBLAS handle
                 exists, then `torch.use_deterministic_algorithms(True)`
    model        TransformerConfig.deterministic_mode: the embedding lookup is an index whose backward is
                 an ordered accumulation; flash-attn runs its deterministic backward (torch's flag)
"""

import os
from typing import Mapping, MutableMapping

import torch

# Megatron-LM's values: what a launcher may set (an unset variable gets the default below).
ENVIRONMENT_DEFAULTS = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                        "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
_NCCL_ALGORITHMS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")
_ACCEPTED_VALUES = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}
# Options that --deterministic-mode needs off (Megatron-LM's list), by dest and flag.
_OPTIONS_OFF = (("cross_entropy_loss_fusion", "--cross-entropy-loss-fusion"), ("tp_comm_overlap", "--tp-comm-overlap"))


def environment_problems(env: Mapping[str, str]) -> list[str]:
    """The determinism variables of `env` set to values that are not deterministic."""
    problems = []
    algorithms = env.get("NCCL_ALGO")
    if algorithms is not None:
        tokens = [token.strip() for token in algorithms.split(",") if token.strip()]
        if not tokens or any(token not in _NCCL_ALGORITHMS for token in tokens):
            problems.append(f"--deterministic-mode: NCCL_ALGO={algorithms!r} is not deterministic; each algorithm "
                            f"must be one of {', '.join(_NCCL_ALGORITHMS)} (or leave it unset: Ring)")
    for name, accepted in _ACCEPTED_VALUES.items():
        if env.get(name) not in (None, *accepted):
            problems.append(f"--deterministic-mode: {name}={env[name]!r} is not deterministic; use "
                            f"{' or '.join(accepted)} (or leave it unset)")
    for name in ("MAMBA_DETERMINISTIC", "CAUSAL_CONV1D_DETERMINISTIC"):
        if env.get(name) and not env[name].startswith("1"):
            problems.append(f"--deterministic-mode: {name}={env[name]!r} turns determinism off; unset it or set 1")
    return problems


def check_determinism(args, problems: list) -> None:
    """Megatron-LM's rules for --deterministic-mode, on the arguments and the launcher's environment."""
    if not args.deterministic_mode:
        return
    for dest, flag in _OPTIONS_OFF:
        if getattr(args, dest):
            problems.append(f"--deterministic-mode cannot be combined with {flag} (not bit-exact); drop {flag}")
    problems.extend(environment_problems(os.environ))


def apply_deterministic_mode(args, env: MutableMapping[str, str] = os.environ) -> None:
    """At start-up, before any NCCL communicator or cuBLAS handle: the library variables left unset get
    Megatron-LM's deterministic values, and torch uses deterministic algorithms only."""
    if not args.deterministic_mode:
        return
    for name, value in ENVIRONMENT_DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
