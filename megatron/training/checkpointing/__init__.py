"""A run's checkpoints: saving and resuming them in either format, under Megatron-LM's names
(`from megatron.training.checkpointing import load_checkpoint, save_checkpoint`).

The formats, side by side (Megatron-LM's directory layouts, readable by it and back):

    --ckpt-format torch       iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt (+ distrib_optim.pt),
                              tied to the saving layout
    --ckpt-format torch_dist  iter_0000100/metadata.json + DCP files of global tensors, loads under any
                              layout (the sharding and the files are megatron.core.dist_checkpointing's)

The modules, one concept each:

    both formats
        layout.py           directory and file names, the `latest_checkpointed_iteration.txt` tracker
        files.py            crash-safe writes (temporary name + rename) and reads with clear errors
        latest.py           naming a finished checkpoint "latest", --save-retain-interval
        save_lock.py        one run at a time per --save directory
        save_failures.py    what a failed or interrupted save tells the user
        rng.py              python / numpy / torch / CUDA / tensor-parallel tracker RNG states
        state_dict.py       what a checkpoint holds (`generate_state_dict`) and the model chunks
        saved_args.py       the saved arguments as this version reads them (renamed ones, defaults)
        checkpoint_args.py  checking them against this run, `load_args_from_checkpoint`
        reading.py          which checkpoint a run loads, and reading it
        fallback.py         resuming from the latest checkpoint intact on every rank
        saving.py           `save_checkpoint`
        loading.py          `load_checkpoint`, `load_train_state`
        format_conversion.py  --ckpt-convert-format: the loaded checkpoint saved again in the other format
    torch
        distrib_optim.py    the distributed optimizer's distrib_optim.pt
    torch_dist
        dist_saving.py      the sharded state dict written by every rank, --async-save
        dist_loading.py     reading it back under this run's layout
    conversion/             the engine of tools/checkpoint/ (convert.py: resharding, Hugging Face export and
                            import; inspect_checkpoint.py; export_bert_hf.py)

Megatron-LM's names below are resolved on first use: the checkpoint tools (tools/checkpoint/) import
modules of this package to read and write checkpoint files on a CPU, and must not load the model code,
the optimizers or a GPU library that saving and loading a training run need.
"""

from megatron.core.lazy_names import lazy_names

_PUBLIC = {
    "check_checkpoint_args": ".checkpoint_args",
    "load_args_from_checkpoint": ".checkpoint_args",
    "load_checkpoint_file": ".files",
    "checkpoint_exists": ".layout",
    "ensure_directory_exists": ".layout",
    "find_checkpoint_rank_0": ".layout",
    "get_checkpoint_name": ".layout",
    "get_checkpoint_tracker_filename": ".layout",
    "read_metadata": ".layout",
    "load_checkpoint": ".loading",
    "get_rng_state": ".rng",
    "save_checkpoint": ".saving",
    "generate_state_dict": ".state_dict",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_names(__name__, _PUBLIC)
