"""One spawn of gloo ranks per world size for all the pipeline checks of this folder: each spawn costs
seconds of start-up per process on a 2-core machine, so the schedule-order and training checks that need
the same number of ranks share it."""

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.pipeline_parallel.test_p2p_communication import _exchange
from tests.unit_tests.pipeline_parallel.test_pipeline_training import MODELS, _layouts_of_world, _reference_run
from tests.unit_tests.pipeline_parallel.test_schedule_order import ORDER_CASES, _record_order


def _checks_of_world(rank, world_size, references):
    orders = {case: _record_order(rank, world_size, *case[1:]) for case in ORDER_CASES if case[0] == world_size}
    checks = {"orders": orders, "training": _layouts_of_world(rank, world_size, references)}
    if world_size == 2:
        checks["p2p"] = _exchange(rank, world_size)
    return checks


@pytest.fixture(scope="session")
def pipeline_ranks():
    """pipeline_ranks(world_size) -> every rank's {"orders": {case: (log, reports)}, "training": {layout:
    worst errors}} (and "p2p" on 2 ranks), spawned once per world size."""
    references = {name: _reference_run(name) for name in MODELS}
    results = {}

    def run(world_size: int) -> list[dict]:
        if world_size not in results:
            results[world_size] = run_distributed(_checks_of_world, world_size, references)
        return results[world_size]

    return run
