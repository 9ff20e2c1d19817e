"""Train/valid/test data iterators for `pretrain()` (Megatron's `build_train_valid_test_data_iterators`).

Dataset sizes (Megatron-LM's `get_train_valid_test_num_samples`): train = `--train-samples` or iterations
x global batch; valid = (train_iters // eval_interval + 1) x eval_iters x evaluation global batch; test =
eval_iters x evaluation global batch. The validation and test loaders read evaluation micro-batches. Loaders
start at the consumed-sample counters, so a resumed run continues the exact sample order.
"""

import itertools

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training.console import print_rank_0
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.global_vars import get_args


def get_train_valid_test_num_samples() -> tuple[int, int, int]:
    args = get_args()
    train_samples = args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
    return (
        train_samples,
        evaluations * args.eval_iters * args.eval_global_batch_size,
        args.eval_iters * args.eval_global_batch_size,
    )


def _loader(dataset, consumed_samples: int, micro_batch_size: int):
    args = get_args()
    return build_pretraining_data_loader(
        dataset,
        consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        dataloader_type=args.dataloader_type,
        num_workers=args.num_workers,
        full_validation=getattr(args, "full_validation", False),
    )


def build_train_valid_test_data_loaders(provider):
    args = get_args()
    if args.iteration > 0 and args.consumed_train_samples == 0:
        args.consumed_train_samples = args.iteration * args.global_batch_size  # pre-counter checkpoints
    train_loader = valid_loader = test_loader = None
    print_rank_0("> building train, validation, and test datasets ...")
    if getattr(provider, "is_distributed", False) or parallel_state.get_tensor_model_parallel_rank() == 0:
        sizes = get_train_valid_test_num_samples()
        print_rank_0(" > datasets target sizes (minimum size):")
        for name, size in zip(("train", "validation", "test"), sizes):
            print_rank_0(f"    {name}: {size}")
        train_ds, valid_ds, test_ds = provider(sizes)
        train_loader = _loader(train_ds, args.consumed_train_samples, args.micro_batch_size)
        valid_loader = _loader(valid_ds, 0 if args.skip_train else args.consumed_valid_samples,
                               args.eval_micro_batch_size)
        test_loader = _loader(test_ds, 0, args.eval_micro_batch_size)
        flags = [train_loader is not None and args.train_iters > 0, valid_loader is not None and args.eval_iters > 0,
                 test_loader is not None and args.eval_iters > 0]
    else:
        flags = [False, False, False]
    # Ranks that built no dataset learn from the others whether there is anything to train on.
    flags = torch.tensor(flags, dtype=torch.int64, device=parallel_state.collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    args.do_train, args.do_valid, args.do_test = (bool(flag) for flag in flags.tolist())
    return train_loader, valid_loader, test_loader


def build_train_valid_test_data_iterators(provider):
    """Iterators over the three loaders: "single" runs through once, "cyclic" repeats."""
    args = get_args()
    loaders = build_train_valid_test_data_loaders(provider)

    def iterator(loader):
        if loader is None:
            return None
        if args.dataloader_type == "cyclic":
            return iter(itertools.chain.from_iterable(itertools.repeat(loader)))
        if args.dataloader_type == "external":
            return loader
        return iter(loader)

    return tuple(iterator(loader) for loader in loaders)
