"""`pretrain()`: Megatron-LM's training loop (its megatron/training/training.py), with its classic signature.

    pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, ...)

initialise -> build model, optimizer, scheduler (and resume) -> build data iterators -> train, evaluating
every --eval-interval and saving every --save-interval -> final save -> validation and test.
"""

import gc
import inspect
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import shards_params, wrap_data_parallel
from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_current_running_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import get_model_config
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe.moe_utils import set_aux_loss_scale
from megatron.training.arguments import ddp_config_from_args, optimizer_config_from_args
from megatron.training.bad_step import BadStepGuard, BadStepStop, stop_on_bad_step
from megatron.training.banner import print_startup_banner
from megatron.training.checkpoint.dist_saving import finalize_async_save
from megatron.training.checkpoint.format_conversion import save_in_converted_format
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.console import print_rank_0
from megatron.training.data_iterators import build_train_valid_test_data_iterators
from megatron.training.data_vocabulary import check_data_vocabulary
from megatron.training.dry_run import dry_run
from megatron.training.evaluation import evaluate_and_print_results
from megatron.training.exit_conditions import ExitConditions
from megatron.training.global_vars import (
    get_args,
    get_tensorboard_writer,
    get_timers,
    get_tokenizer,
    get_wandb_writer,
)
from megatron.training.initialize import initialize_megatron
from megatron.training.preflight import preflight
from megatron.training.progress import ProgressLog
from megatron.training.pipeline_loss import broadcast_from_last_stage
from megatron.training.profiling import LoopInstrumentation, empty_unused_memory, start_memory_history
from megatron.training.run_summary import print_run_summary
from megatron.training.training_log import num_floating_point_operations, training_log
from megatron.training.weight_hash import check_weight_hashes_across_dp_replicas


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults: dict | None = None,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    parsed_args=None,
):
    """Trains a model from the command line's arguments; see the module docstring for the flow."""
    start = time.time()
    # Parse and validate first: --dry-run stops there, before torch.distributed exists.
    parsed_args = initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults,
                                      parsed_args=parsed_args, skip_mpu_initialization=True)
    # Recorded as Megatron-LM records it; the parameter and memory estimates tell a T5 by it.
    parsed_args.model_type = model_type
    preflight(parsed_args)
    if parsed_args.dry_run:
        dry_run(parsed_args)
        return
    initialize_megatron(
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        parsed_args=parsed_args,
    )
    exit_code = _train_and_evaluate(train_valid_test_dataset_provider, model_provider, model_type,
                                    forward_step_func, start)
    _shut_down()
    print_run_summary(parsed_args, start)
    if exit_code is not None:
        sys.exit(exit_code)


def _train_and_evaluate(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                        start: float) -> int | None:
    """Everything that holds the model, from its construction to the final evaluation; returns the exit code
    of a run that stopped early (a collective decision), None for one that ran to its end. The model and
    optimizer die with this frame, so _shut_down can free their process groups."""
    args, timers = get_args(), get_timers()
    startup = torch.tensor([time.time() - start], dtype=torch.double, device=parallel_state.collective_device())
    dist.all_reduce(startup, op=dist.ReduceOp.MAX)
    print_rank_0(f"time to initialize megatron (seconds): {startup.item():.3f}")

    start_memory_history(args)
    timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    timers("model-and-optimizer-setup").stop()
    config = get_model_config(model[0])

    check_data_vocabulary(args, get_tokenizer().vocab_size)
    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    if len(model) > 1:
        # One iterator per virtual stage, as Megatron builds them: each chunk reads its own copy of the data.
        per_chunk = [build_train_valid_test_data_iterators(train_valid_test_dataset_provider) for _ in model]
        train_iterator, valid_iterator, test_iterator = ([chunk[split] for chunk in per_chunk] for split in range(3))
    else:
        train_iterator, valid_iterator, test_iterator = build_train_valid_test_data_iterators(
            train_valid_test_dataset_provider
        )
    timers("train/valid/test-data-iterators-setup").stop()
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)
    print_startup_banner(args, model, get_num_microbatches())

    iteration = args.iteration
    if not args.skip_train and args.do_train:
        print_rank_0("training ...")
        iteration, exit_code = train(
            forward_step_func, model, optimizer, opt_param_scheduler, train_iterator, valid_iterator, config, start
        )
        args.curr_iteration = iteration
        if exit_code is not None:
            return exit_code
        if args.save and iteration != 0 and iteration % args.save_interval != 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far)
    if args.do_valid:
        evaluate_and_print_results(
            f"iteration {iteration} on validation set", forward_step_func, valid_iterator, model, iteration,
            config, write_to_tensorboard=not args.skip_train,
        )
    if args.do_test:
        evaluate_and_print_results(
            f"iteration {iteration} on test set", forward_step_func, test_iterator, model, iteration,
            config, write_to_tensorboard=not args.skip_train,
        )
    return None


def _shut_down() -> None:
    """The end of a run that every rank reached (a finished run or a collective exit decision): writers
    finished, every rank past its last collective, then the process groups destroyed and freed while the
    interpreter is still whole.

    destroy_process_group alone frees no gloo group that something still references, and a gloo worker thread
    releases a finished collective's tensors a moment after the caller's wait() returned. A release that
    falls into interpreter teardown needs the GIL there and aborts the rank ("terminate called without an
    active exception" in ~AsyncAllgatherWork, seen in CI on a loaded 2-core machine; pytorch/pytorch#190489).
    Freeing the last reference to a group instead joins its worker threads, so this drops ours: the model
    and optimizer (gone with _train_and_evaluate's frame), parallel_state's groups, then a collection pass.
    tests/functional_tests/test_process_exit.py checks that no gloo worker thread is left."""
    # A checkpoint still being written in the background (--async-save) becomes "latest" here.
    finalize_async_save(blocking=True)
    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.finish()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    parallel_state.destroy_model_parallel()
    gc.collect()


def get_model(model_provider_func, model_type, wrap_with_ddp: bool = True) -> list:
    """Builds this rank's model chunks, one per virtual pipeline stage (one without virtual stages):
    provider -> device -> Float16Module (fp16/bf16) -> DDP (or FSDP, mcore_fsdp_adapter.py)."""
    args = get_args()
    takes_vp_stage = "vp_stage" in inspect.signature(model_provider_func).parameters
    num_chunks = args.virtual_pipeline_model_parallel_size or 1
    if num_chunks > 1 and not takes_vp_stage:
        raise ValueError("virtual pipeline stages need a model_provider(pre_process, post_process, vp_stage) that "
                         "builds the layers of stage vp_stage")
    model = []
    for vp_stage in range(num_chunks):
        parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage if num_chunks > 1 else None)
        kwargs = {
            "pre_process": parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            "post_process": parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        }
        if takes_vp_stage:
            kwargs["vp_stage"] = vp_stage if num_chunks > 1 else None
        chunk = model_provider_func(**kwargs)
        chunk.model_type = model_type
        model.append(chunk)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if num_chunks > 1 else None)
    parameters = sum(p.nelement() for chunk in model for p in chunk.parameters())
    if parallel_state.get_data_parallel_rank() == 0:
        print(
            f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({parallel_state.get_tensor_model_parallel_rank()}, {parallel_state.get_pipeline_model_parallel_rank()}): "
            f"{parameters}",
            flush=True,
        )
    wrapped = []
    for index, chunk in enumerate(model):
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        config = get_model_config(chunk)
        ddp_config = ddp_config_from_args(args)
        # FSDP keeps fp32 params (its main params) and gathers them in the compute dtype.
        if (args.fp16 or args.bf16) and not (wrap_with_ddp and shards_params(ddp_config)):
            chunk = Float16Module(config, chunk)
        if wrap_with_ddp:
            # Chunks after the first reduce their gradients at the end of the step, off the critical path.
            chunk = wrap_data_parallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        wrapped.append(chunk)
    return wrapped


def update_train_iters(args) -> None:
    """Sets `--train-iters` from `--train-samples`, walking the batch-size ramp-up when there is one (the
    last partial global batch is dropped, as Megatron does)."""
    if args.train_iters:
        return
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        iterations = consumed = 0
        while consumed <= int(args.rampup_batch_size[2]) and consumed <= args.train_samples:
            update_num_microbatches(consumed, consistency_check=False)
            consumed += get_current_global_batch_size()
            iterations += 1
        update_num_microbatches(0, consistency_check=False)
        if args.train_samples > consumed:
            iterations += (args.train_samples - consumed) // args.global_batch_size
        args.train_iters = iterations
    print_rank_0(f"setting training iterations to {args.train_iters}")


def get_optimizer_param_scheduler(optimizer) -> OptimizerParamScheduler:
    """The LR/WD scheduler, with every length converted to samples (Megatron counts samples)."""
    args = get_args()
    if args.train_iters:
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        decay_steps = args.lr_decay_iters * args.global_batch_size
        wd_incr_steps = args.train_iters * args.global_batch_size
        wsd_decay_steps = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * args.global_batch_size
        warmup_steps = (
            args.lr_warmup_fraction * decay_steps
            if args.lr_warmup_fraction is not None
            else args.lr_warmup_iters * args.global_batch_size
        )
    else:
        update_train_iters(args)
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        decay_steps = args.lr_decay_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples
        warmup_steps = (
            args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None else args.lr_warmup_samples
        )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def setup_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond=None, scale_lr_cond=None, lr_mult=1.0):
    """Model chunks, optimizer and scheduler; resumes from --load (or --pretrained-checkpoint)."""
    args, timers = get_args(), get_timers()
    model = get_model(model_provider_func, model_type)
    optimizer_config = optimizer_config_from_args(args)
    optimizer_config.timers = timers
    optimizer = get_megatron_optimizer(optimizer_config, model, no_wd_decay_cond, scale_lr_cond, lr_mult)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    if args.load is not None or args.pretrained_checkpoint is not None:
        timers("load-checkpoint", log_level=0).start(barrier=True)
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, opt_param_scheduler
        )
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
    else:
        args.iteration, args.num_floating_point_operations_so_far = 0, 0
    if args.ckpt_convert_format is not None:
        save_in_converted_format(args, model, optimizer, opt_param_scheduler)
    return model, optimizer, opt_param_scheduler


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, bad_step_guard=None,
               forward_backward_func=None):
    """One optimizer step over `num_microbatches` microbatches. Returns (loss dict, skipped, grad norm,
    num zeros); the loss values are exact global token means Σloss / Σtokens over DP x CP. Losses and the
    grad norm may be device tensors: reading them waits for the GPU, which the loop does only to log.

    `bad_step_guard` (bad_step.py) may veto the update (skipped, grad norm NaN when something was
    non-finite) or raise BadStepStop. `forward_backward_func` defaults to the schedule of the parallel
    layout (the loop passes it wrapped in a full-iteration CUDA graph with --cuda-graph-impl full_iteration)."""
    args = get_args()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    set_aux_loss_scale(config, get_num_microbatches())
    losses = (forward_backward_func or get_forward_backward_func())(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=get_num_microbatches(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.decoder_seq_length,
        forward_only=False,
    )
    empty_unused_memory(args, level=1)
    loss_dict = reduce_loss_reports(losses)
    increment = get_current_running_global_batch_size()
    veto = None
    if bad_step_guard is not None and bad_step_guard.enabled:
        veto = partial(bad_step_guard.check, losses, loss_dict, scheduler_increment=increment)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step_with_device_grad_norm(veto=veto)
    empty_unused_memory(args, level=2)
    if not update_successful:
        # A bad step vetoed at once comes back with its norm, an fp16 overflow without one.
        return loss_dict, 1, (bad_step_guard.skipped_grad_norm if grad_norm is not None else None), None
    opt_param_scheduler.step(increment=increment)
    # A verdict left on the device (bad_step.py) is this step's "skipped" flag, counted without reading it.
    device_veto = bad_step_guard.device_veto if bad_step_guard is not None else None
    return loss_dict, (device_veto if device_veto is not None else 0), grad_norm, num_zeros_in_grad


def reduce_loss_reports(reports: list) -> dict:
    """Combines the per-microbatch loss reports of the last stage.

    2-element reports `[loss_sum, num_tokens]` are summed over microbatches and DP x CP ranks, giving the
    exact global token mean; 1-element (legacy, already DP-averaged) values are averaged over microbatches.
    With pipeline parallelism the result is broadcast from the last stage to the others.
    """
    reduced = {}
    if reports and parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for key in reports[0]:
            values = [torch.as_tensor(report[key]).detach().float().view(-1) for report in reports]
            if values[0].numel() == 2:
                total = torch.stack(values).sum(dim=0)
                dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
                reduced[key] = total[0] / total[1].clamp(min=1)
            else:
                reduced[key] = torch.cat(values).mean()
    return broadcast_from_last_stage(reduced)


def _learning_rates(optimizer):
    learning_rate = decoupled = None
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr", False):
            decoupled = group["lr"]
        else:
            learning_rate = group["lr"]
    return learning_rate, decoupled


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_iterator, valid_iterator, config, start_time=None):
    """The loop; returns (last iteration, exit code or None when training ran to --train-iters)."""
    args, timers = get_args(), get_timers()
    for chunk in model:
        chunk.train()
    config.grad_scale_func = optimizer.scale_loss
    config.timers = timers
    config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    exit_conditions = ExitConditions(args, start_time)

    iteration = args.iteration
    bad_step_guard = BadStepGuard(args, iteration, optimizer, opt_param_scheduler)
    progress_log = ProgressLog(args)
    progress_log.job_started()
    config.finalize_model_grads_func = bad_step_guard.wrap_finalize(finalize_model_grads, model)
    # (batch size, FLOPs) of the last iterations, taken back when a verdict settled late stops the run.
    recent = []

    def save():
        # What is saved must be settled: a bad step found now stops the run instead (BadStepStop).
        bad_step_guard.resolve()
        # Checkpoint time is not iteration time: pause the interval timer around it.
        timers("interval-time").stop()
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far)
        # The logs up to a checkpoint survive a crash after it, so a resumed run's curves have no gap.
        if get_tensorboard_writer() is not None:
            get_tensorboard_writer().flush()
        progress_log.checkpoint_saved(iteration, args)
        timers("interval-time", log_level=0).start(barrier=True)

    forward_backward_func = get_forward_backward_func()
    if args.cuda_graph_impl == "full_iteration":
        forward_backward_func = FullCudaGraphWrapper(forward_backward_func, args.cuda_graph_warmup_steps)
    instrumentation = LoopInstrumentation(args)
    timers("interval-time", log_level=0).start(barrier=True)
    try:
        while iteration < args.train_iters:
            update_num_microbatches(args.consumed_train_samples, consistency_check=True)
            instrumentation.before_iteration(iteration + 1)
            try:
                loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
                    forward_step_func, train_iterator, model, optimizer, opt_param_scheduler, config, bad_step_guard,
                    forward_backward_func,
                )
                iteration += 1
                batch_size = get_current_running_global_batch_size()
                flops = num_floating_point_operations(args, batch_size)
                args.consumed_train_samples += batch_size
                args.num_floating_point_operations_so_far += flops
                recent = (recent + [(batch_size, flops)])[-2:]
                learning_rate, decoupled_learning_rate = _learning_rates(optimizer)
                training_log(
                    loss_dict, learning_rate, iteration, optimizer.get_loss_scale(), skipped_iter,
                    grad_norm, num_zeros_in_grad, decoupled_learning_rate=decoupled_learning_rate,
                    params_norm=optimizer.get_params_norm() if args.log_params_norm else None,
                )
                instrumentation.after_iteration(iteration)
                hash_interval = args.check_weight_hash_across_dp_replicas_interval
                if hash_interval and iteration % hash_interval == 0:
                    check_weight_hashes_across_dp_replicas(model, iteration)
                if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
                    bad_step_guard.resolve()
                    timers("interval-time").stop()
                    with instrumentation.evaluation():
                        evaluate_and_print_results(
                            f"iteration {iteration}", forward_step_func, valid_iterator, model, iteration, config
                        )
                    timers("interval-time", log_level=0).start(barrier=True)
                if args.async_save:
                    finalize_async_save(blocking=False)  # a finished background save becomes "latest" now
                exit_code = exit_conditions.checkpoint_and_decide_exit(iteration, save)
                if exit_code is not None or iteration == args.train_iters:
                    bad_step_guard.resolve()  # the last step's verdict, if it is still on the device
                if exit_code is not None:
                    return iteration, exit_code
            except BadStepStop as stop:
                # A verdict settled one step late: the bad iteration (and the one after) were counted.
                for batch_size, flops in recent[len(recent) - (iteration - stop.iteration):]:
                    args.consumed_train_samples -= batch_size
                    args.num_floating_point_operations_so_far -= flops
                iteration = stop.iteration
                return iteration, stop_on_bad_step(stop, save if args.save else None)
        return iteration, None
    finally:
        instrumentation.finish()
