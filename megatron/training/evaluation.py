"""Validation and test passes: forward-only iterations, exact global token-mean losses, Megatron's lines:

    -------------------------------------------------------------------------------------------
     validation loss at iteration 1000 | lm loss value: 5.012345E+00 | lm loss PPL: 1.502345E+02 |
    -------------------------------------------------------------------------------------------

One pass is `--eval-iters` full global batches (the batch plan's microbatches of the full global batch, also
during a batch-size ramp-up); each advances the run's `consumed_valid_samples`, where the validation sampler
of a resumed run starts.
"""

import math

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
from megatron.training.batch_plan import BatchPlan
from megatron.training.console import print_rank_last
from megatron.training.parallel_layout import ParallelLayout
from megatron.training.pipeline_loss import broadcast_from_last_stage
from megatron.training.train_state import TrainState


class Evaluator:
    """The forward-only passes of one run over `model` (its chunks) with `forward_step_func`; writes its
    results to the TensorBoard / W&B writers given (None: not written)."""

    def __init__(self, forward_step_func, model: list, config, args, plan: BatchPlan, layout: ParallelLayout,
                 writer=None, wandb_writer=None):
        self.forward_step_func, self.model, self.config = forward_step_func, model, config
        self.args, self.plan, self.layout = args, plan, layout
        self.writer, self.wandb_writer = writer, wandb_writer

    def evaluate(self, data_iterator, state: TrainState) -> dict:
        """`--eval-iters` evaluation global batches (--eval-global-batch-size, in micro batches of
        --eval-micro-batch-size) forward-only; returns {loss name: global token mean}."""
        args = self.args
        for chunk in self.model:
            chunk.eval()
        sums = {}  # key -> tensor([numerator, denominator])
        averaged_keys = set()  # legacy 1-element reports, already averaged over DP by the loss function
        # Evaluation is not part of the training step's forward-backward time (Megatron switches it off too).
        timers, self.config.timers = self.config.timers, None
        # Only training iterations are validated and re-run (Megatron switches the engine off here too).
        rerun_engine = get_rerun_state_machine()
        rerun_mode = rerun_engine.get_mode()
        rerun_engine.set_mode(RerunMode.DISABLED)
        with torch.no_grad():
            for _ in range(args.eval_iters):
                reports = get_forward_backward_func()(
                    forward_step_func=self.forward_step_func,
                    data_iterator=data_iterator,
                    model=self.model,
                    num_microbatches=self.plan.eval_num_microbatches,
                    seq_length=args.seq_length,
                    micro_batch_size=self.plan.eval_micro,
                    decoder_seq_length=args.decoder_seq_length,
                    forward_only=True,
                )
                if self.layout.is_last_stage:
                    for report in reports:
                        for key, value in report.items():
                            value = torch.as_tensor(value).detach().float().view(-1)
                            if value.numel() == 2:
                                pair = value
                            else:
                                averaged_keys.add(key)
                                pair = torch.stack([value[0], torch.ones_like(value[0])])
                            sums[key] = sums.get(key, torch.zeros_like(pair)) + pair
                state.consumed_valid_samples += self.plan.eval_global
        self.config.timers = timers
        rerun_engine.set_mode(rerun_mode)
        for chunk in self.model:
            chunk.train()
        results = {}
        for key, pair in sums.items():
            # Summed over DP x CP: with context parallelism each rank holds the sums of its part of the sequences.
            if key not in averaged_keys and self.layout.data_context_parallel_size > 1:
                dist.all_reduce(pair, group=self.layout.data_context_parallel_group)
            results[key] = (pair[0] / pair[1].clamp(min=1)).item()
        return {key: float(value) for key, value in broadcast_from_last_stage(results).items()}

    def evaluate_and_print(self, prefix: str, data_iterator, state: TrainState, write_to_tensorboard=True) -> dict:
        """`evaluate`, then the bordered console line (last rank) and the scalars at `state.iteration`."""
        writer = self.writer if write_to_tensorboard else None
        wandb_writer = self.wandb_writer if write_to_tensorboard else None
        results = self.evaluate(data_iterator, state)
        line = f" validation loss at {prefix} | "
        for key, value in results.items():
            ppl = math.exp(min(20.0, value))
            line += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
            if writer is not None:
                writer.add_scalar(f"{key} validation", value, state.iteration)
                writer.add_scalar(f"{key} validation vs samples", value, state.consumed_train_samples)
                if self.args.log_validation_ppl_to_tensorboard:
                    writer.add_scalar(f"{key} validation ppl", ppl, state.iteration)
                    writer.add_scalar(f"{key} validation ppl vs samples", ppl, state.consumed_train_samples)
            if wandb_writer is not None:
                wandb_writer.log({f"{key} validation": value}, state.iteration)
        bar = "-" * (len(line) + 1)
        print_rank_last(bar)
        print_rank_last(line)
        print_rank_last(bar)
        return results
