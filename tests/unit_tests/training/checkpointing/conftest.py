"""A single rank with torch.distributed (gloo, world size 1), the parallel groups and the microbatch
calculator, as a training run has them when it saves or loads a checkpoint."""

import pytest
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.training import global_vars
from tests.unit_tests.training.checkpointing.tiny_run import BATCH_SIZE


@pytest.fixture
def single_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    init_num_microbatches_calculator(0, None, BATCH_SIZE, BATCH_SIZE, 1)
    yield
    destroy_num_microbatches_calculator()
    get_cuda_rng_tracker().reset()
    global_vars.unset_global_variables()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
