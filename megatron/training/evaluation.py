"""Validation and test passes: forward-only iterations, exact global token-mean losses, Megatron's lines:

    -------------------------------------------------------------------------------------------
     validation loss at iteration 1000 | lm loss value: 5.012345E+00 | lm loss PPL: 1.502345E+02 |
    -------------------------------------------------------------------------------------------
"""

import math

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training.console import print_rank_last
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer
from megatron.training.pipeline_loss import broadcast_from_last_stage


def evaluate(forward_step_func, data_iterator, model, config) -> dict:
    """`--eval-iters` evaluation global batches (--eval-global-batch-size, in micro-batches of
    --eval-micro-batch-size) forward-only; returns {loss name: global token mean}."""
    args = get_args()
    for chunk in model:
        chunk.eval()
    num_microbatches = args.eval_global_batch_size // (args.eval_micro_batch_size * args.data_parallel_size)
    sums = {}  # key -> tensor([numerator, denominator])
    averaged_keys = set()  # legacy 1-element reports, already averaged over DP by the loss function
    # Evaluation is not part of the training step's forward-backward time (Megatron switches it off too).
    timers, config.timers = config.timers, None
    with torch.no_grad():
        for _ in range(args.eval_iters):
            reports = get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.eval_micro_batch_size,
                decoder_seq_length=args.decoder_seq_length,
                forward_only=True,
            )
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                for report in reports:
                    for key, value in report.items():
                        value = torch.as_tensor(value).detach().float().view(-1)
                        if value.numel() == 2:
                            pair = value
                        else:
                            averaged_keys.add(key)
                            pair = torch.stack([value[0], torch.ones_like(value[0])])
                        sums[key] = sums.get(key, torch.zeros_like(pair)) + pair
            args.consumed_valid_samples += args.eval_global_batch_size
    config.timers = timers
    for chunk in model:
        chunk.train()
    results = {}
    for key, pair in sums.items():
        # Summed over DP x CP: with context parallelism each rank holds the sums of its part of the sequences.
        if key not in averaged_keys and parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
            dist.all_reduce(pair, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        results[key] = (pair[0] / pair[1].clamp(min=1)).item()
    return {key: float(value) for key, value in broadcast_from_last_stage(results).items()}


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration, config, write_to_tensorboard=True):
    args = get_args()
    writer = get_tensorboard_writer() if write_to_tensorboard else None
    wandb_writer = get_wandb_writer() if write_to_tensorboard else None
    results = evaluate(forward_step_func, data_iterator, model, config)
    line = f" validation loss at {prefix} | "
    for key, value in results.items():
        ppl = math.exp(min(20.0, value))
        line += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
        if writer is not None:
            writer.add_scalar(f"{key} validation", value, iteration)
            writer.add_scalar(f"{key} validation vs samples", value, args.consumed_train_samples)
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
                writer.add_scalar(f"{key} validation ppl vs samples", ppl, args.consumed_train_samples)
        if wandb_writer is not None:
            wandb_writer.log({f"{key} validation": value}, iteration)
    bar = "-" * (len(line) + 1)
    print_rank_last(bar)
    print_rank_last(line)
    print_rank_last(bar)
    return results
