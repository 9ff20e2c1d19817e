"""`--ckpt-convert-format F --ckpt-convert-save DIR`: the checkpoint just loaded is saved again in format F
under DIR/F, as Megatron-LM does (torch <-> torch_dist). Like Megatron, the run then goes on saving in F
under DIR/F; with --train-iters equal to the loaded iteration it only converts."""

import os

from megatron.training.checkpointing.saving import save_checkpoint
from megatron.training.console import print_rank_0


def save_in_converted_format(args, model, optimizer, opt_param_scheduler, state) -> None:
    """Saves the loaded state (`state`: the run's TrainState) as `args.ckpt_convert_format` under
    `args.ckpt_convert_save/<format>` (collective); later saves of this run go there too."""
    loaded_format = args.ckpt_format
    args.ckpt_format = args.ckpt_convert_format
    args.save = os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)
    # The converted copy must be complete when this returns, whatever --async-save says.
    async_save, args.async_save = args.async_save, False
    save_checkpoint(state.iteration, model, optimizer, opt_param_scheduler, state.num_floating_point_operations_so_far,
                    args=args)
    args.async_save = async_save if args.ckpt_format == "torch_dist" else False
    print_rank_0(f"> converted checkpoint: {loaded_format} -> {args.ckpt_format}.")
