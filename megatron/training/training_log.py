"""The per-interval console line and TensorBoard scalars (Megatron-LM's `training_log`), plus throughput.

Megatron's line, field for field, with what users of torchtitan and litgpt expect added after the
elapsed time: tokens/s per GPU, TFLOP/s per GPU, and MFU against a stated dense bf16 peak (docs/benchmarks.md).
"""

import math
import sys
from dataclasses import dataclass
from datetime import datetime

import torch

from megatron.core.datasets.rank_logging import global_rank
from megatron.core.transformer.config_rules import linear_attention_pattern
from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
from megatron.core.transformer.moe.moe_utils import aux_losses_for_logging, moe_aux_loss_names
from megatron.training.batch_plan import StepBatch
from megatron.core.transformer.multi_token_prediction import mtp_losses_for_logging
from megatron.training.console import print_rank_last
from megatron.training.profiling import dump_memory_snapshot
from megatron.training.progress import progress_bar
from megatron.training.train_state import TrainState

# Dense (not sparse) bf16 peaks, TFLOP/s, by a substring of `torch.cuda.get_device_name()`.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def num_floating_point_operations(args, batch_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward) of a GPT, Megatron's formula:

        B*s*[12*h*f*g + L*A + 6*h*V*(1 + D) + 6*D*(3h + 2h^2)]

    B sequences, s tokens, L layers, h hidden, g = 1.5 with SwiGLU (three GEMMs of f) else 1, V padded
    vocab, D multi-token-prediction depths (each a layer of the last layer's kind with its own logits and
    eh_proj). f sums the MLP widths a token goes through: L*ffn for a dense model; with MoE, dense layers
    count ffn and MoE layers topk*moe_ffn + the shared-expert width (the router's h*E is negligible). A is
    one layer's attention per token (`_attention_flops_per_token`), counted causally; L*A sums it over the
    layers, whose Gated DeltaNet layers count `_linear_attention_flops_per_token` instead.
    """
    s, h, L = args.seq_length, args.hidden_size, args.num_layers
    depths = getattr(args, "mtp_num_layers", None) or 0
    widths = [args.ffn_hidden_size] * L
    if getattr(args, "num_experts", None) is not None:
        moe_width = args.moe_router_topk * args.moe_ffn_hidden_size + (args.moe_shared_expert_intermediate_size or 0)
        widths = [moe_width if is_moe else args.ffn_hidden_size for is_moe in moe_layer_pattern(L, args.moe_layer_freq)]
    f = sum(widths) + depths * widths[-1]
    g = 1.5 if args.swiglu else 1.0
    linear = linear_attention_pattern(L, args.experimental_attention_variant, args.linear_attention_freq)
    per_layer = [_linear_attention_flops_per_token(args) if is_linear else _attention_flops_per_token(args)
                 for is_linear in linear]
    return batch_size * s * (
        12 * h * f * g + sum(per_layer) + depths * per_layer[-1]
        + 6 * h * args.padded_vocab_size * (1 + depths) + 6 * depths * (3 * h + 2 * h * h)
    )


def _linear_attention_flops_per_token(args) -> float:
    """Forward + backward FLOPs of one Gated DeltaNet layer per token, as Megatron-LM counts them:
    6*[h(2 qk + 2 v + 2 nv) + K(2 qk + v) + 4 nv dv^2 + v h], qk = nk dk and v = nv dv the key and value
    widths, K the convolution width (in_proj, conv1d, the delta rule's four products, out_proj)."""
    qk, v = args.linear_num_key_heads * args.linear_key_head_dim, args.linear_num_value_heads * args.linear_value_head_dim
    heads, h = args.linear_num_value_heads, args.hidden_size
    return 6 * (h * (2 * qk + 2 * v + 2 * heads) + args.linear_conv_kernel_dim * (2 * qk + v)
                + 4 * heads * args.linear_value_head_dim**2 + v * h)


def _attention_flops_per_token(args) -> float:
    """Forward + backward FLOPs of one layer's self-attention per token (3 x 2 x the multiply-adds), causal.

    Standard: 12*h^2*r*(1 + q + s/(2h)), r = kv_channels*heads/h, q = query groups/heads (+ 6*h^2*r for
    the output gate's projection). Multi-latent
    attention (n heads, latents r_q, r_kv): 6*[r_q(h + n(d_nope + d_rope) + 1) (h.n(d_nope + d_rope) without
    r_q) + r_kv(h + n(d_nope + d_v) + 1) + h.d_rope + n.d_v.h] + 6*s*n*(d_nope + d_rope + d_v)/2, as
    Megatron-LM counts it (the +1: the latent norms)."""
    s, h, heads = args.seq_length, args.hidden_size, args.num_attention_heads
    if getattr(args, "multi_latent_attention", False):
        q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            queries = h * heads * q_head
        else:
            queries = args.q_lora_rank * (h + heads * q_head + 1)
        keys_values = args.kv_lora_rank * (h + heads * (args.qk_head_dim + args.v_head_dim) + 1)
        projections = queries + keys_values + h * args.qk_pos_emb_head_dim + heads * args.v_head_dim * h
        return 6 * projections + 6 * s * heads * (q_head + args.v_head_dim) / 2
    r = args.kv_channels * heads / h
    groups = args.num_query_groups if args.group_query_attention else heads
    gate = 6 * h * h * r if getattr(args, "attention_output_gate", False) else 0  # the gate's projection
    return 12 * h * h * r * (1 + groups / heads + s / (2 * h)) + gate


def peak_tflops() -> float | None:
    """The dense bf16 peak of this GPU, or None when unknown (then no MFU is printed)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in _PEAK_TFLOPS.items() if key in name), None)


class _Interval:
    """Sums over the iterations between two log lines. Once a step's verdict comes as a device flag
    (bad_step.py), an iteration only keeps one row [skipped flag, losses..., grad norm] (two kernel launches, no
    host sync: the host is on the step's critical path when the GPU waits for the next step's launches) and
    `settle` folds the rows into the counts when the line is printed."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.losses = {}
        self.iterations = 0
        self.advanced = 0
        self.skipped = 0
        self.nan = 0
        self._rows = []  # (loss keys, row tensor) of device-flagged iterations

    def add(self, loss_dict: dict, skipped_iter, grad_norm) -> None:
        """Counts one iteration: `skipped_iter` 0/1, or a device flag (nonzero: its update was skipped)."""
        self.iterations += 1
        if torch.is_tensor(skipped_iter):
            values = [skipped_iter.reshape(()).float()] + [value.detach().float().reshape(()) for value in
                                                           loss_dict.values()]
            if grad_norm is not None:
                values.append(torch.as_tensor(grad_norm, dtype=torch.float32).reshape(()).to(values[0].device))
            # A copy: the values may be buffers the next iteration rewrites (a CUDA graph's outputs).
            self._rows.append((tuple(loss_dict), torch.stack(values)))
        elif skipped_iter:
            self.skipped += 1
            # A step skipped for non-finite gradients has a finite loss; its grad norm then reads NaN.
            nonfinite_grads = grad_norm is not None and not math.isfinite(float(grad_norm))
            self.nan += int(nonfinite_grads or any(not math.isfinite(float(v)) for v in loss_dict.values()))
        else:
            self.advanced += 1
            for key, value in loss_dict.items():
                self.losses[key] = self.losses.get(key, 0.0) + value.detach()

    def settle(self) -> None:
        """Folds the device-flagged rows into the counts (device tensors then; nothing is read): a skipped
        iteration's losses are left out; it counts as a nan iteration when a loss or its grad norm is not
        finite."""
        groups = {}  # rows of one layout: the same losses, with or without a grad norm
        for keys, row in self._rows:
            groups.setdefault((keys, row.numel()), []).append(row)
        for (keys, _), rows in groups.items():
            rows = torch.stack(rows)  # [iterations, 1 + losses (+ grad norm)]
            skipped = rows[:, 0] != 0
            nonfinite = ~torch.isfinite(rows[:, 1:].sum(dim=1))
            self.skipped = self.skipped + skipped.sum()
            self.nan = self.nan + (skipped & nonfinite).sum()
            self.advanced = self.advanced + (~skipped).sum()
            kept = torch.where(skipped[:, None], 0.0, rows[:, 1:1 + len(keys)]).sum(dim=0)
            for key, total in zip(keys, kept):
                self.losses[key] = self.losses.get(key, 0.0) + total
        self._rows = []


@dataclass
class _Line:
    """What the console line of one log iteration shows, taken when the iteration has been queued.

    `values`: the interval's counts and loss sums, the loss scale, grad norm and zero count, by name; device
    values among them are read through `read()`. Staged (`stage()`), they are copied to pinned host memory
    behind the iteration, with an event after the copy: reading them later waits for that event only, where
    reading a device tensor would wait for everything queued on its stream since (the next iteration)."""

    iteration: int
    consumed_samples: int
    batch_size: int
    iterations: int
    learning_rate: float
    decoupled_learning_rate: float | None
    params_norm: object
    values: dict
    _host: object = None
    _done: object = None

    def stage(self) -> None:
        """Takes the values now: host tensors are read at once, GPU ones copied as described above."""
        for name, value in self.values.items():
            if torch.is_tensor(value) and not value.is_cuda:
                self.values[name] = float(value)
        names = [name for name, value in self.values.items() if torch.is_tensor(value)]
        if not names:
            return
        on_device = torch.stack([self.values[name].detach().reshape(()).to(torch.float64) for name in names])
        self._host = (names, torch.empty(on_device.shape, dtype=torch.float64, pin_memory=True))
        self._host[1].copy_(on_device, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def read(self) -> dict:
        """The values as Python numbers (waiting for the staged copy, if any)."""
        values = dict(self.values)
        if self._host is not None:
            self._done.synchronize()
            names, host = self._host
            values.update(zip(names, host.tolist()))
        return {name: None if value is None else float(value) for name, value in values.items()}


class TrainingLogger:
    """The per-iteration scalars and the per-interval console line of one run.

    `train_iters` is the run's length (the progress and time-remaining fields); `writer` / `wandb_writer` the
    TensorBoard and W&B writers (None where there are none: every rank but the last).

    `defer_line` (on a GPU, where nothing else waits for the device every iteration): the line of a log
    iteration is printed by the next call, once the following iteration has been queued, or by `flush()`.
    Printing reads the losses and the clock, which waits for the GPU to finish the iteration; done at once,
    the GPU then idled while the host queued the next iteration (the batch's copies, the gradient buffers'
    reset, a CUDA graph's launch: 4.2 ms after such a read in a profiled GPT 1.3B step on an H100, once per
    logged line). Deferred, the GPU runs the next iteration meanwhile; the
    interval's time is read when its last iteration's event has completed, so it still counts exactly
    the logged iterations. The caller flushes before anything it prints in between (evaluation, checkpoints,
    the exit)."""

    def __init__(self, args, timers, train_iters: int, data_parallel_rank: int, writer=None, wandb_writer=None,
                 defer_line: bool = False):
        self.args, self.timers, self.train_iters = args, timers, train_iters
        self.data_parallel_rank = data_parallel_rank
        self.writer, self.wandb_writer = writer, wandb_writer
        self.interval = _Interval()
        self.defer_line = defer_line
        self._pending: _Line | None = None
        self._memory_reported = False

    def log(self, state: TrainState, batch: StepBatch, loss_dict: dict, learning_rate: float, loss_scale,
            skipped_iter, grad_norm, num_zeros_in_grad, params_norm=None, decoupled_learning_rate=None) -> None:
        """Accumulates the iteration `state.iteration` just finished (`batch` its batch) and, every
        `--log-interval` iterations, prints the console line (with `defer_line`: the next call or `flush()`
        prints it).

        `loss_scale` and `grad_norm` may be 1-element device tensors (the optimizer's, unread): they are
        converted only where written, so an iteration that logs nothing queues no host sync."""
        self.flush()  # the line of the iteration before, now that this one is queued
        args, iteration = self.args, state.iteration
        writer, wandb_writer, interval = self.writer, self.wandb_writer, self.interval
        if args.num_experts is not None:
            loss_dict = {**loss_dict, **_moe_aux_losses(args, batch.num_microbatches)}
        if args.mtp_num_layers:
            loss_dict = {**loss_dict, **mtp_losses_for_logging(args.mtp_num_layers, 1.0 / batch.num_microbatches)}

        interval.add(loss_dict, skipped_iter, grad_norm)

        batch_size = batch.running_global_batch_size
        if writer is not None and iteration % args.tensorboard_log_interval == 0:
            samples = state.consumed_train_samples
            scalars = {"batch-size": batch_size}
            if args.log_learning_rate_to_tensorboard:
                scalars["learning-rate"] = learning_rate
            if args.log_loss_scale_to_tensorboard:
                scalars["loss-scale"] = float(loss_scale)
            scalars.update({key: float(value) for key, value in loss_dict.items()})
            if grad_norm is not None:
                scalars["grad-norm"] = float(grad_norm)
            if num_zeros_in_grad is not None:
                scalars["num-zeros"] = float(num_zeros_in_grad)
            if params_norm is not None:
                scalars["params-norm"] = float(params_norm)
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
                writer.add_scalar(tag + " vs samples", value, samples)
            if args.log_world_size_to_tensorboard:
                writer.add_scalar("world-size", args.world_size, iteration)
            if args.log_memory_to_tensorboard and torch.cuda.is_available():
                for tag, value in _cuda_memory_scalars().items():
                    writer.add_scalar(tag, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log(scalars, iteration)

        if iteration % args.log_interval != 0:
            return

        dump_memory_snapshot(args)
        interval.settle()
        values = {"advanced": interval.advanced, "skipped": interval.skipped, "nan": interval.nan,
                  "loss scale": loss_scale, "grad norm": grad_norm, "num zeros": num_zeros_in_grad,
                  **{("loss", key): total for key, total in interval.losses.items()}}
        line = _Line(iteration, state.consumed_train_samples, batch_size, interval.iterations, learning_rate,
                     decoupled_learning_rate, params_norm, values)
        self.interval = _Interval()
        if self.defer_line:
            line.stage()
            self._pending = line
        else:
            self._print(line, line.read(), self.timers("interval-time").elapsed(barrier=True))

    def flush(self) -> None:
        """Prints the deferred line, if any (waiting for its iteration to finish on the GPU)."""
        if self._pending is None:
            return
        line, self._pending = self._pending, None
        values = line.read()
        # The clock is read as the iteration's event completes: the queued iteration after it is not waited for.
        self._print(line, values, self.timers("interval-time").elapsed(synchronize=False))

    def _print(self, line: _Line, values: dict, elapsed: float) -> None:
        args, timers, writer = self.args, self.timers, self.writer
        iteration, batch_size, params_norm = line.iteration, line.batch_size, line.params_norm
        learning_rate, decoupled_learning_rate = line.learning_rate, line.decoupled_learning_rate
        seconds_per_iteration = elapsed / max(line.iterations, 1)
        tokens_per_gpu = batch_size * args.seq_length / args.world_size / seconds_per_iteration
        tflops_per_gpu = (num_floating_point_operations(args, batch_size) / seconds_per_iteration / 1e12
                          / args.world_size)
        if writer is not None:
            if args.log_timers_to_tensorboard:
                writer.add_scalar("iteration-time", seconds_per_iteration, iteration)
            if args.log_throughput and args.log_timers_to_tensorboard:
                writer.add_scalar("throughput", tflops_per_gpu, iteration)
            writer.add_scalar("tokens-per-second-per-gpu", tokens_per_gpu, iteration)

        fields = [
            f"iteration {iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {line.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {seconds_per_iteration * 1000.0:.1f}",
            f"tokens/s/GPU: {tokens_per_gpu:.0f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f}",
        ]
        peak = peak_tflops()
        if peak is not None:
            fields.append(f"MFU: {100 * tflops_per_gpu / peak:.1f}% (of {peak:.0f} TFLOP/s dense bf16)")
        remaining = (self.train_iters - iteration) * seconds_per_iteration
        if sys.stdout.isatty():
            fields.append(progress_bar(iteration, self.train_iters))
        fields.append(f"time remaining: {_format_duration(remaining)}")
        fields.append(f"learning rate: {learning_rate:.6E}")
        if decoupled_learning_rate is not None:
            fields.append(f"decoupled learning rate: {decoupled_learning_rate:.6E}")
        fields.append(f"global batch size: {batch_size:5d}")
        advanced, skipped, nan = int(values["advanced"]), int(values["skipped"]), int(values["nan"])
        losses = {name[1]: total for name, total in values.items() if isinstance(name, tuple)}  # ("loss", key)
        for key, total in losses.items():
            average = total / max(advanced, 1)
            if average > 0.0:
                fields.append(f"{key}: {average:.6E}")
        fields.append(f"loss scale: {values['loss scale']:.1f}")
        if values["grad norm"] is not None:
            fields.append(f"grad norm: {values['grad norm']:.3f}")
        if values["num zeros"] is not None:
            fields.append(f"num zeros: {values['num zeros']:.1f}")
        if params_norm is not None:
            fields.append(f"params norm: {float(params_norm):.3f}")
        fields.append(f"number of skipped iterations: {skipped:3d}")
        fields.append(f"number of nan iterations: {nan:3d}")
        timestamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        print_rank_last(f" [{timestamp}] " + " | ".join(fields) + " |")

        if torch.cuda.is_available() and not self._memory_reported:
            self._memory_reported = True
            self._report_memory(iteration)
        if args.timing_log_level > 0:  # else none of them runs; and their all-gather would wait for the GPU
            timers.log(_TIMERS_TO_LOG, normalizer=args.log_interval)

    def _report_memory(self, iteration: int) -> None:
        mb = 1024 * 1024
        if self.data_parallel_rank != 0:
            return
        print(
            f"[Rank {global_rank()}] (after {iteration} iterations) memory (MB) | "
            f"allocated: {torch.cuda.memory_allocated() / mb:.1f} | "
            f"max allocated: {torch.cuda.max_memory_allocated() / mb:.1f} | "
            f"reserved: {torch.cuda.memory_reserved() / mb:.1f} | max reserved: {torch.cuda.max_memory_reserved() / mb:.1f}",
            flush=True,
        )


def _cuda_memory_scalars() -> dict:
    """Megatron's --log-memory-to-tensorboard tags: the CUDA caching allocator's current reserved and
    allocated bytes, peak allocated bytes and live allocation count."""
    stats = torch.cuda.memory_stats()
    return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0)}


_TIMERS_TO_LOG = [
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "batch-generator",
    "optimizer",
]


def _moe_aux_losses(args, num_microbatches: int) -> dict:
    """This step's MoE router losses (load_balancing_loss, z_loss, ...), each the mean over the MoE
    layers and microbatches, without its coefficient, as Megatron logs them (collective: all ranks)."""
    names = moe_aux_loss_names(args.moe_router_load_balancing_type, args.moe_aux_loss_coeff, args.moe_z_loss_coeff)
    pattern = moe_layer_pattern(args.num_layers, args.moe_layer_freq)
    mtp = args.mtp_num_layers or 0  # multi-token prediction layers repeat the last layer's kind
    num_moe_layers = sum(pattern) + mtp * pattern[-1]
    return aux_losses_for_logging(names, args.num_layers + mtp, num_moe_layers, 1.0 / num_microbatches)


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
