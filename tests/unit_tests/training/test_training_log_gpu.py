"""The deferred console line on a GPU: printing iteration N's line waits for iteration N only, not for the
iteration queued after it (training_log.py, `defer_line`)."""

import pytest
import torch

from megatron.core.timers import Timers
from megatron.training.arguments import parse_args, validate_args
from megatron.training.batch_plan import StepBatch
from megatron.training.train_state import TrainState
from megatron.training.training_log import TrainingLogger

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_line_is_read_without_waiting_for_the_next_iteration(capsys):
    args = validate_args(parse_args(args_list=[
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--log-interval", "2"]))
    args.padded_vocab_size = 1024
    timers = Timers(0, "minmax")
    timers("interval-time", log_level=0).start()
    logger, state = TrainingLogger(args, timers, 4, 0, defer_line=True), TrainState()
    loss, scale = torch.zeros((), device="cuda"), torch.ones((), device="cuda")
    for iteration in (1, 2, 3):
        state.iteration, state.consumed_train_samples = iteration, 2 * iteration
        loss.fill_(float(iteration))  # the buffer a CUDA graph would rewrite
        if iteration == 3:  # the next iteration: ~1 s of GPU work queued before the line of iteration 2 is read
            torch.cuda._sleep(2_000_000_000)
            queued = torch.cuda.Event()
            queued.record()
        logger.log(state, StepBatch(2, 2, 1), {"lm loss": loss * 1}, 1e-3, scale, 0, loss * 0.5, None)
        scale.fill_(2.0 ** iteration)
    printed = capsys.readouterr().out
    assert not queued.query(), "printing iteration 2's line waited for the work queued after it"
    assert "iteration        2/" in printed and "lm loss: 1.500000E+00" in printed and "loss scale: 2.0" in printed
    assert "grad norm: 1.000" in printed
    torch.cuda.synchronize()
