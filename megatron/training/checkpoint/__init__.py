"""Torch-format checkpoints (`--ckpt-format torch`), Megatron-LM's layout and state dict.

    layout.py          directory and file names, the `latest_checkpointed_iteration.txt` tracker
    files.py           crash-safe writes (temporary name + rename) and reads with clear errors
    rng.py             python / numpy / torch / CUDA / tensor-parallel tracker RNG states
    state_dict.py      what a checkpoint holds (`generate_state_dict`) and the model chunks
    reading.py         which checkpoint a run loads, and loading its file
    fallback.py        resuming from the latest checkpoint intact on every rank
    checkpoint_args.py `check_checkpoint_args`, `load_args_from_checkpoint` (--use-checkpoint-args)
    saving.py          `save_checkpoint`
    loading.py         `load_checkpoint`

Users import these from `megatron.training.checkpointing`, as in Megatron-LM.
"""
