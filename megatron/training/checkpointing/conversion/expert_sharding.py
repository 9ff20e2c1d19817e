"""Routed experts of a mixture-of-experts GPT across expert-parallel files, and their two key spellings.

A full state dict names every expert by its global number e = 0 .. E-1; the file of expert-parallel rank
r (`mp_rank_TT[_PPP]_EEE`, reference 8.1) holds experts r*E/EP .. (r+1)*E/EP - 1 under local numbers
0 .. E/EP - 1, next to a copy of every dense tensor:

    SequentialMLP (default)   decoder.layers.N.mlp.experts.local_experts.{e}.linear_fc{1,2}.weight
    GroupedMLP (--moe-grouped-gemm)   decoder.layers.N.mlp.experts.linear_fc{1,2}.weight{e}

Full state dicts here always use the SequentialMLP spelling; files are read and written in the spelling
of the checkpoint's `--moe-grouped-gemm`. Within a file the experts are split over TP like a dense MLP
(tensor_parallel_sharding.py), expert-TP being TP.
"""

import re

# A decoder layer's experts, or those of a multi-token-prediction layer (mtp.layers.K.mtp_model_layer).
_LAYER = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.mtp_model_layer)"
_SEQUENTIAL = re.compile(rf"({_LAYER}\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)")
_GROUPED = re.compile(rf"({_LAYER}\.mlp\.experts\.)(linear_fc[12]\.weight)(\d+)")


def expert_number(name: str) -> int | None:
    """The expert number of a SequentialMLP-spelt expert tensor, None for any other tensor."""
    match = _SEQUENTIAL.fullmatch(name)
    return None if match is None else int(match.group(2))


def renumber_expert(name: str, number: int) -> str:
    match = _SEQUENTIAL.fullmatch(name)
    return f"{match.group(1)}local_experts.{number}.{match.group(3)}"


def _renamed(state: dict, pattern: re.Pattern, spelling) -> dict:
    """`state` with the names `pattern` matches respelt by `spelling(match)`."""
    return {(spelling(match) if (match := pattern.fullmatch(name)) else name): tensor for name, tensor in state.items()}


def from_grouped_keys(state: dict) -> dict:
    """GroupedMLP keys `experts.linear_fc1.weight{e}` -> SequentialMLP `experts.local_experts.{e}.linear_fc1.weight`."""
    return _renamed(state, _GROUPED, lambda match: f"{match.group(1)}local_experts.{match.group(3)}.{match.group(2)}")


def to_grouped_keys(state: dict) -> dict:
    """Inverse of `from_grouped_keys`."""
    return _renamed(state, _SEQUENTIAL, lambda match: f"{match.group(1)}{match.group(3)}{match.group(2)}")


def check_expert_parallel_size(num_experts: int | None, ep: int) -> None:
    if num_experts is None and ep != 1:
        raise ValueError(f"--target-expert-parallel-size {ep}: the model has no experts (only 1 is legal)")
    if num_experts is not None and (ep < 1 or num_experts % ep):
        legal = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"--target-expert-parallel-size {ep} must divide the {num_experts} experts: legal sizes "
                         f"{', '.join(map(str, legal))}")


def split_experts(state: dict, ep: int, num_experts: int) -> list[dict]:
    """One state dict per expert-parallel rank: every dense tensor, and that rank's experts renumbered locally."""
    check_expert_parallel_size(num_experts, ep)
    per_rank = num_experts // ep
    shards = [{} for _ in range(ep)]
    for name, tensor in state.items():
        number = expert_number(name)
        if number is None:
            for shard in shards:
                shard[name] = tensor
        else:
            shards[number // per_rank][renumber_expert(name, number % per_rank)] = tensor
    return shards


def merge_experts(shards: list[dict]) -> dict:
    """The state dict with global expert numbers of the expert-parallel ranks' state dicts (dense tensors
    from rank 0; inverse of `split_experts`)."""
    per_rank = len({expert_number(name) for name in shards[0]} - {None})
    merged = {}
    for rank, shard in enumerate(shards):
        for name, tensor in shard.items():
            number = expert_number(name)
            if number is not None:
                merged[renumber_expert(name, rank * per_rank + number)] = tensor
            elif rank == 0:
                merged[name] = tensor
    return merged
