"""Fixtures of the data-parallel tests."""

import pytest
import torch.distributed as dist

from megatron.core import parallel_state


@pytest.fixture
def single_rank_groups():
    """A one-process gloo group with parallel_state set up, for tests that need no peers."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
