"""`Trainer`: one training run, from building the model to the final validation and test passes.

What a Trainer owns, and who makes it:

    args                the validated arguments (read-only here but for the compatibility mirror below)
    layout              ParallelLayout: this rank's sizes, ranks and process groups (parallel_layout.py)
    plan                BatchPlan: micro batch x data-parallel size x microbatches, the ramp-up (batch_plan.py)
    schedule            TrainingSchedule: the number of iterations, the scheduler's lengths (train_schedule.py),
                        made with the scheduler
    state               TrainState: iteration, consumed samples, FLOPs; checkpointed (train_state.py)
    model, optimizer, opt_param_scheduler   built by `build_model_and_optimizer`, resumed from --load
    data                DataIterators, built by `build_data_iterators` (data_iterators.py)
    evaluator           the validation and test passes (evaluation.py)
    during `train`:     the re-run engine (rerun_engine.py), the bad-step guard (bad_step.py), the
                        console/TensorBoard logger (training_log.py), the progress file (progress.py), profiler
                        and garbage-collection hooks (profiling.py) and the save/exit decisions
                        (exit_conditions.py)

`pretrain()` (training.py) builds one after `initialize_megatron` and calls `run`. Code written against
Megatron-LM reads the run's counters and derived values from `get_args()` (`args.iteration`: the iteration
the run started at, `args.consumed_train_samples`, `args.train_iters`, `args.do_train`, ...): the Trainer
writes them there (`TrainState.publish`, `TrainingSchedule.publish`, `build_model_and_optimizer`,
`build_data_iterators`) and never reads them back.
"""

import contextlib
import sys
import time

import torch
import torch.distributed as dist

from megatron.core.distributed import finalize_model_grads
from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import get_model_config
from megatron.core.rerun_state_machine import destroy_rerun_state_machine
from megatron.training.arguments import optimizer_config_from_args
from megatron.training.bad_step import BadStepGuard, BadStepStop, stop_on_bad_step
from megatron.training.banner import print_startup_banner
from megatron.training.batch_plan import BatchPlan
from megatron.training.checkpointing.format_conversion import save_in_converted_format
from megatron.training.checkpointing.loading import load_train_state
from megatron.training.checkpointing.saving import save_checkpoint
from megatron.training.console import print_rank_0
from megatron.training.data_iterators import DataIterators, build_data_iterators
from megatron.training.data_vocabulary import check_data_vocabulary
from megatron.training.evaluation import Evaluator
from megatron.training.exit_conditions import ExitConditions
from megatron.training.global_vars import get_tensorboard_writer, get_timers, get_tokenizer, get_wandb_writer
from megatron.training.model_chunks import get_model
from megatron.training.parallel_layout import ParallelLayout
from megatron.training.profiling import LoopInstrumentation, start_memory_history
from megatron.training.progress import ProgressLog
from megatron.training.rerun_engine import replayable, start_rerun_engine, validates_results
from megatron.training.run_callbacks import bind_args
from megatron.training.step import RerunExit, learning_rates, run_train_step
from megatron.training.train_schedule import TrainingSchedule
from megatron.training.train_state import TrainState
from megatron.training.training_log import TrainingLogger, num_floating_point_operations
from megatron.training.weight_hash import check_weight_hashes_across_dp_replicas


class Trainer:
    """One run (module docstring). Collective: every rank builds one and calls the same methods."""

    def __init__(self, args, forward_step_func=None, start_time: float | None = None):
        """`args`: validated, after `initialize_megatron` (the process groups, timers and writers exist).
        `forward_step_func(data_iterator, model)`: Megatron's forward step (needed to train and evaluate); the
        Trainer binds `args` into the callbacks that take them (run_callbacks.py), here and where it builds the
        model and the data.
        `start_time`: when the job started (for --exit-duration-in-mins and the start-up time line)."""
        self.args = args
        self.forward_step_func = bind_args(forward_step_func, args)
        self.start_time = time.time() if start_time is None else start_time
        self.timers = get_timers()
        self.writer, self.wandb_writer = get_tensorboard_writer(), get_wandb_writer()
        self.layout = ParallelLayout.from_parallel_state()
        self.plan = BatchPlan.from_args(args, self.layout.data_parallel_size)
        self.state = TrainState()
        self.schedule = self.model = self.optimizer = self.opt_param_scheduler = self.config = self.evaluator = None
        self.data = DataIterators(None, None, None, False, False, False)
        # The loop's helpers, made when `train` starts.
        self.bad_step_guard = self.logger = self.progress_log = self.instrumentation = None
        self.exit_conditions = self.forward_backward_func = None
        # (batch size, FLOPs) of the last iterations, taken back when a verdict settled late stops the run.
        self._recent = []

    def run(self, datasets_provider, model_provider, model_type) -> int | None:
        """Builds model, optimizer and data, trains, saves, then validates and tests; returns the exit code
        of a run that stopped early (a collective decision), None for one that ran to its end."""
        args, timers = self.args, self.timers
        startup = torch.tensor([time.time() - self.start_time], dtype=torch.double, device=self.layout.device)
        dist.all_reduce(startup, op=dist.ReduceOp.MAX)
        print_rank_0(f"time to initialize megatron (seconds): {startup.item():.3f}")

        start_memory_history(args)
        timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
        self.build_model_and_optimizer(model_provider, model_type)
        timers("model-and-optimizer-setup").stop()
        check_data_vocabulary(args, get_tokenizer().vocab_size)
        timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
        self.build_data_iterators(datasets_provider)
        timers("train/valid/test-data-iterators-setup").stop()
        timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)
        print_startup_banner(args, self.model, self.plan.step_batch(self.state.consumed_train_samples).num_microbatches,
                             self.layout)

        if not args.skip_train and self.data.do_train:
            print_rank_0("training ...")
            exit_code = self.train()
            args.curr_iteration = self.state.iteration  # Megatron's live iteration; the run summary reads it
            if exit_code is not None:
                return exit_code
            iteration = self.state.iteration
            if args.save and iteration != 0 and iteration % args.save_interval != 0:
                self._write_checkpoint()
        for split, iterator, wanted in (("validation", self.data.valid, self.data.do_valid),
                                        ("test", self.data.test, self.data.do_test)):
            if wanted:
                self.evaluator.evaluate_and_print(f"iteration {self.state.iteration} on {split} set", iterator,
                                                  self.state, write_to_tensorboard=not args.skip_train)
        return None

    def build_model_and_optimizer(self, model_provider, model_type, no_wd_decay_cond=None, scale_lr_cond=None,
                                  lr_mult: float = 1.0) -> None:
        """The model chunks, the optimizer, the schedule and the scheduler; resumes them and `state` from
        --load (or --pretrained-checkpoint)."""
        args, timers = self.args, self.timers
        self.model = get_model(model_provider, model_type, args=args, layout=self.layout)
        optimizer_config = optimizer_config_from_args(args)
        optimizer_config.timers = timers
        model_config = get_model_config(self.model[0])
        self.optimizer = get_megatron_optimizer(optimizer_config, self.model, no_wd_decay_cond, scale_lr_cond, lr_mult,
                                                mup_width_mult=model_config.mup_width_mult if args.use_mup else None)
        self.schedule = TrainingSchedule.from_args(args, self.plan)
        self.schedule.publish(args)
        self.opt_param_scheduler = self.schedule.build_scheduler(self.optimizer, args)
        if args.load is not None or args.pretrained_checkpoint is not None:
            timers("load-checkpoint", log_level=0).start(barrier=True)
            loaded = load_train_state(self.model, self.optimizer, self.opt_param_scheduler, args)
            timers("load-checkpoint").stop(barrier=True)
            timers.log(["load-checkpoint"])
            if loaded is not None:
                self.state = loaded
                self.plan.move_calculator(loaded.consumed_train_samples, verbose=True)
        self.state.publish(args)
        args.iteration = self.state.iteration  # Megatron's meaning: the iteration this run starts at
        if args.ckpt_convert_format is not None:
            save_in_converted_format(args, self.model, self.optimizer, self.opt_param_scheduler, self.state)
        self.config = get_model_config(self.model[0])
        self.evaluator = Evaluator(self.forward_step_func, self.model, self.config, args, self.plan, self.layout,
                                   self.writer, self.wandb_writer)

    def build_data_iterators(self, datasets_provider) -> None:
        """The train/valid/test iterators, starting at `state`'s consumed samples; one set per model chunk
        with virtual pipeline stages (each chunk reads its own copy of the data, as Megatron builds them)."""
        per_chunk = [build_data_iterators(datasets_provider, self.args, self.plan, self.layout, self.state,
                                          self.schedule.train_iters) for _ in self.model]
        first = per_chunk[0]
        if len(per_chunk) > 1:
            first = DataIterators([chunk.train for chunk in per_chunk], [chunk.valid for chunk in per_chunk],
                                  [chunk.test for chunk in per_chunk], first.do_train, first.do_valid, first.do_test)
        self.data = first
        self.args.do_train, self.args.do_valid, self.args.do_test = first.do_train, first.do_valid, first.do_test

    def train(self) -> int | None:
        """The loop up to the schedule's last iteration; returns the exit code of a run that stops early
        (exit flags, a signal, a bad step, the re-run engine), None when it ran to its end."""
        args = self.args
        self._prepare_loop()
        self.timers("interval-time", log_level=0).start(barrier=True)
        try:
            while self.state.iteration < self.schedule.train_iters:
                try:
                    try:
                        exit_code = self._train_iteration()
                    except RerunExit as stop:
                        self.logger.flush()
                        self.bad_step_guard.resolve()  # a verdict on the step before, still on the device, first
                        return self._stop_for_rerun_engine(stop)
                except BadStepStop as stop:
                    self.logger.flush()
                    self._rewind(stop.iteration)
                    return stop_on_bad_step(stop, self.save if args.save else None)
                if exit_code is not None:
                    return exit_code
            return None
        finally:
            self._flush_log()
            self.instrumentation.finish()
            destroy_rerun_state_machine()

    def _flush_log(self) -> None:
        """The deferred console line, when training ends. Where it ends by an exception, that exception is the
        one to see: a flush failing after it (the GPU in error) is not raised over it."""
        if self.logger is None:
            return
        if sys.exc_info()[1] is None:
            self.logger.flush()
            return
        with contextlib.suppress(Exception):
            self.logger.flush()

    def _stop_for_rerun_engine(self, stop: RerunExit) -> int:
        """The engine's exit before the update of iteration `state.iteration + 1`; the checkpoint it asks for
        is of the state after `state.iteration` (Megatron's)."""
        if stop.save_checkpoint:
            if self.args.save:
                self.save()
            else:
                print_rank_0("WARNING: the re-run engine asks for a checkpoint to re-run the iteration from, but "
                             "no --save directory was given")
            print_rank_0(f"note: a job resumed from this checkpoint re-runs iteration {self.state.iteration + 1} "
                         "as a new one: Megatron-LM's diagnosis by a re-run on another GPU is not supported yet")
        return stop.exit_code

    def _prepare_loop(self) -> None:
        """The model in training mode, the schedule's hooks in its config, and the loop's helpers."""
        args, model, optimizer, config = self.args, self.model, self.optimizer, self.config
        for chunk in model:
            chunk.train()
        config.grad_scale_func = optimizer.scale_loss
        config.timers = self.timers
        config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
        self.exit_conditions = ExitConditions(args, self.start_time, self.layout.device)
        start_rerun_engine(args, self.state.iteration)
        if validates_results(args):
            self.data.train = replayable(self.data.train)
        self.bad_step_guard = BadStepGuard(args, self.state.iteration, self.layout, optimizer,
                                           self.opt_param_scheduler)
        config.finalize_model_grads_func = self.bad_step_guard.wrap_finalize(finalize_model_grads, model)
        self.progress_log = ProgressLog(args, self.state.num_floating_point_operations_so_far)
        self.progress_log.job_started()
        # The console line is printed once the next iteration is queued (training_log.py) where nothing else
        # waits for the GPU every iteration: on CUDA without the timers of --timing-log-level 1 and 2.
        defer_line = self.layout.device.type == "cuda" and args.timing_log_level == 0
        self.logger = TrainingLogger(args, self.timers, self.schedule.train_iters, self.layout.data_parallel_rank,
                                     self.writer, self.wandb_writer, defer_line=defer_line)
        self.forward_backward_func = get_forward_backward_func()
        if args.cuda_graph_impl == "full_iteration":
            self.forward_backward_func = FullCudaGraphWrapper(self.forward_backward_func, args.cuda_graph_warmup_steps)
        self.instrumentation = LoopInstrumentation(args)

    def _train_iteration(self) -> int | None:
        """One iteration and what follows it (log, evaluation, save, exit decision); returns the exit code."""
        args, state = self.args, self.state
        batch = self.plan.step_batch(state.consumed_train_samples)
        self.plan.move_calculator(state.consumed_train_samples)
        self.instrumentation.before_iteration(state.iteration + 1)
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = run_train_step(
            self.forward_step_func, self.data.train, self.model, self.optimizer, self.opt_param_scheduler,
            self.config, args, batch, self.layout, self.bad_step_guard, self.forward_backward_func,
        )
        flops = num_floating_point_operations(args, batch.running_global_batch_size)
        state.iteration += 1
        state.consumed_train_samples += batch.running_global_batch_size
        state.num_floating_point_operations_so_far += flops
        state.publish(args)
        self._recent = (self._recent + [(batch.running_global_batch_size, flops)])[-2:]
        learning_rate, decoupled_learning_rate = learning_rates(self.optimizer)
        params_norm = self.optimizer.get_params_norm() if args.log_params_norm else None
        self.logger.log(state, batch, loss_dict, learning_rate, self.optimizer.get_loss_scale(), skipped_iter,
                        grad_norm, num_zeros_in_grad, params_norm=params_norm,
                        decoupled_learning_rate=decoupled_learning_rate)
        self.instrumentation.after_iteration(state.iteration)
        hash_interval = args.check_weight_hash_across_dp_replicas_interval
        if hash_interval and state.iteration % hash_interval == 0:
            check_weight_hashes_across_dp_replicas(self.model, state.iteration)
        if args.eval_interval and state.iteration % args.eval_interval == 0 and self.data.do_valid:
            self.logger.flush()
            self.bad_step_guard.resolve()
            self.timers("interval-time").stop()
            with self.instrumentation.evaluation():
                self.evaluator.evaluate_and_print(f"iteration {state.iteration}", self.data.valid, state)
            self.timers("interval-time", log_level=0).start(barrier=True)
        if args.async_save:  # (--async-save writes torch_dist checkpoints: dist_saving.py is loaded)
            from megatron.training.checkpointing.dist_saving import finalize_async_save

            finalize_async_save(blocking=False)  # a finished background save becomes "latest" now
        exit_code = self.exit_conditions.checkpoint_and_decide_exit(state.iteration, self.save, self.logger.flush)
        if exit_code is not None or state.iteration == self.schedule.train_iters:
            self.bad_step_guard.resolve()  # the last step's verdict, if it is still on the device
        return exit_code

    def _rewind(self, iteration: int) -> None:
        """A verdict settled one step late: the bad iteration (and the one after) were counted; back to the
        end of `iteration`, the last good one."""
        state = self.state
        for batch_size, flops in self._recent[len(self._recent) - (state.iteration - iteration):]:
            state.consumed_train_samples -= batch_size
            state.num_floating_point_operations_so_far -= flops
        state.iteration = iteration
        state.publish(self.args)

    def save(self) -> None:
        """Saves a checkpoint during training. What is saved must be settled: a bad step found now stops the
        run instead (BadStepStop)."""
        self.logger.flush()
        self.bad_step_guard.resolve()
        # Checkpoint time is not iteration time: pause the interval timer around it.
        self.timers("interval-time").stop()
        self._write_checkpoint()
        # The logs up to a checkpoint survive a crash after it, so a resumed run's curves have no gap.
        if self.writer is not None:
            self.writer.flush()
        self.progress_log.checkpoint_saved(self.state)
        self.timers("interval-time", log_level=0).start(barrier=True)

    def _write_checkpoint(self) -> None:
        """The checkpoint of the model, optimizer, scheduler and `state` (whose sample counters the checkpoint
        records in its `args`, Megatron's place for them)."""
        self.state.publish(self.args)
        save_checkpoint(self.state.iteration, self.model, self.optimizer, self.opt_param_scheduler,
                        self.state.num_floating_point_operations_so_far, args=self.args)
