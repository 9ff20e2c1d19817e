"""How a dimension is divided among the tensor-parallel ranks.

Rank r of p owns the contiguous range [r*c, min((r+1)*c, n)) with c = ceil(n / p). When p divides n
this is Megatron's even split; otherwise the last rank(s) hold less. Only the vocabulary is ever split
unevenly (so that e.g. vocab_size=50257 works at TP=2); every other split is checked to be even.
"""

import torch


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must divide exactly."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def partition_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of `rank`'s share of a dimension of `size` split over `world_size` ranks."""
    chunk = -(-size // world_size)
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def partition_size(size: int, rank: int, world_size: int) -> int:
    """Length of `rank`'s share (see `partition_range`)."""
    start, end = partition_range(size, rank, world_size)
    return end - start


class VocabUtility:
    """Vocabulary ranges of the tensor-parallel ranks (Megatron-Core's helper names)."""

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int):
        return partition_range(global_vocab_size, rank, world_size)

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size: int):
        start = rank * per_partition_vocab_size
        return start, start + per_partition_vocab_size


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False):
    """Splits the last dimension into `num_partitions` equal chunks."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    return tuple(chunk.contiguous() for chunk in chunks) if contiguous_split_chunks else chunks
