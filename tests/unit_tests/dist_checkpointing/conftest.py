"""The single-rank setup (gloo world of 1, parallel groups, microbatch calculator) of the checkpoint tests."""

from tests.unit_tests.training.checkpointing.conftest import single_rank  # noqa: F401 (a fixture)
