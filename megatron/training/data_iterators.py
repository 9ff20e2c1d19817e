"""Train/valid/test data iterators of a run (Megatron's `build_train_valid_test_data_iterators`).

The datasets are built for the sizes of the batch plan (`BatchPlan.dataset_sizes`) on tensor-parallel rank 0
(every rank for a provider marked `is_distributed`); the other TP ranks receive their batches by broadcast.
Loaders start at the run's consumed-sample counters, so a resumed run continues the exact sample order.
Whether there is anything to train, validate and test on is agreed by all ranks (`DataIterators.do_*`).
"""

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.training.batch_plan import BatchPlan
from megatron.training.console import print_rank_0
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.global_vars import get_args
from megatron.training.parallel_layout import ParallelLayout
from megatron.training.run_callbacks import bind_args
from megatron.training.train_state import TrainState


@dataclass
class DataIterators:
    """The three iterators (None where this rank reads no data), and whether each split has data anywhere."""

    train: object
    valid: object
    test: object
    do_train: bool
    do_valid: bool
    do_test: bool


def _loader(dataset, consumed_samples: int, micro_batch_size: int, args, layout: ParallelLayout):
    return build_pretraining_data_loader(
        dataset,
        consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=layout.data_parallel_rank,
        data_parallel_size=layout.data_parallel_size,
        dataloader_type=args.dataloader_type,
        num_workers=args.num_workers,
        full_validation=getattr(args, "full_validation", False),
    )


def _iterator(loader, dataloader_type: str):
    """"single" runs through the loader once, "cyclic" repeats it, "external" is an iterator already."""
    if loader is None:
        return None
    if dataloader_type == "cyclic":
        return iter(itertools.chain.from_iterable(itertools.repeat(loader)))
    if dataloader_type == "external":
        return loader
    return iter(loader)


def build_data_iterators(provider, args, plan: BatchPlan, layout: ParallelLayout, state: TrainState,
                         train_iters: int) -> DataIterators:
    """Builds the datasets with `provider(sizes)` (with `args` bound, if it takes them: run_callbacks.py) and
    their iterators (module docstring). Collective."""
    provider = bind_args(provider, args)
    loaders = [None, None, None]
    print_rank_0("> building train, validation, and test datasets ...")
    if getattr(provider, "is_distributed", False) or layout.tensor_parallel_rank == 0:
        sizes = plan.dataset_sizes(train_iters, args.train_samples, args.eval_interval, args.eval_iters)
        print_rank_0(" > datasets target sizes (minimum size):")
        for name, size in zip(("train", "validation", "test"), sizes):
            print_rank_0(f"    {name}: {size}")
        train_ds, valid_ds, test_ds = provider(sizes)
        loaders = [
            _loader(train_ds, state.consumed_train_samples, plan.micro_batch_size, args, layout),
            _loader(valid_ds, 0 if args.skip_train else state.consumed_valid_samples, plan.eval_micro, args, layout),
            _loader(test_ds, 0, plan.eval_micro, args, layout),
        ]
        flags = [loaders[0] is not None and train_iters > 0, loaders[1] is not None and args.eval_iters > 0,
                 loaders[2] is not None and args.eval_iters > 0]
    else:
        flags = [False, False, False]
    # Ranks that built no dataset learn from the others whether there is anything to train on.
    flags = torch.tensor(flags, dtype=torch.int64, device=layout.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    do_train, do_valid, do_test = (bool(flag) for flag in flags.tolist())
    train, valid, test = (_iterator(loader, args.dataloader_type) for loader in loaders)
    return DataIterators(train, valid, test, do_train, do_valid, do_test)


def build_train_valid_test_data_iterators(provider):
    """Megatron-LM's name and signature, for code outside the Trainer (a compatibility entry point: the
    arguments are the run's `get_args()`): the iterators of the run set up by `initialize_megatron` (and
    `setup_model_and_optimizer`, for a resumed run's counters), as a tuple; sets `args.do_train`,
    `args.do_valid` and `args.do_test` as Megatron-LM does."""
    args = get_args()
    state = TrainState()
    state.load_state_dict({name: getattr(args, name, 0) for name in state.state_dict()})
    layout = ParallelLayout.from_parallel_state()
    iterators = build_data_iterators(provider, args, BatchPlan.from_args(args, layout.data_parallel_size), layout,
                                     state, args.train_iters)
    args.do_train, args.do_valid, args.do_test = iterators.do_train, iterators.do_valid, iterators.do_test
    return iterators.train, iterators.valid, iterators.test
