"""The arguments saved in a checkpoint: checking them against this run, and `--use-checkpoint-args`."""

import os

# --use-checkpoint-args runs before torch.distributed is initialised: rank 0 is told by the RANK variable.
from megatron.training.arguments.reporting import print_rank_0
from megatron.training.checkpointing.reading import load_base_checkpoint
from megatron.training.global_vars import get_args

# The layout sizes a torch-format checkpoint is tied to, with the convert.py flag that reshards each.
_RESHARD_FLAGS = {
    "tensor_model_parallel_size": "--target-tensor-parallel-size",
    "pipeline_model_parallel_size": "--target-pipeline-parallel-size",
    "expert_model_parallel_size": "--target-expert-parallel-size",
}

# --use-checkpoint-args copies these from the checkpoint (Megatron's list, for the flags this project has).
# Copied only when this run leaves them unset (None):
_ARGS_IF_UNSET = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "kv_channels",
    "max_position_embeddings", "padded_vocab_size",
)
# Always copied (their flags have non-None defaults, so "unset" cannot be told apart):
_ARGS_ALWAYS = (
    "num_query_groups", "group_query_attention", "position_embedding_type", "use_rotary_position_embeddings",
    "rotary_base", "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu",
    "swiglu", "untie_embeddings_and_output_weights", "layernorm_zero_centered_gamma", "normalization",
    "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "spec", "num_experts",
    "moe_layer_freq", "moe_router_topk", "moe_router_pre_softmax", "moe_grouped_gemm",
    "moe_shared_expert_intermediate_size", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_router_score_function", "moe_router_enable_expert_bias", "tiktoken_pattern",
)
_TOKENIZER_ARGS = ("tokenizer_model", "tokenizer_type")
_MODEL_PARALLEL_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
)


def check_checkpoint_args(checkpoint_args, args=None, checkpoint_version=3.0, checkpoint_name="the checkpoint",
                          check_parallel_sizes=True):
    """Raises one ValueError listing every model-shape argument where the checkpoint and this run differ.

    Compared: num_layers, hidden_size, num_attention_heads; with --vocab-file (as Megatron)
    max_position_embeddings, make_vocab_size_divisible_by, padded_vocab_size, tokenizer_type; and, with
    check_parallel_sizes, the TP, PP, EP and expert TP sizes, which a torch-format checkpoint is tied to
    (checkpoints before version 3.0 recorded TP as `model_parallel_size` and no PP; torch_dist checkpoints
    reshard).
    Arguments the checkpoint did not record are not compared. `args`: this run's; without them (Megatron-LM's
    signature, a compatibility entry point) the run's `get_args()`.
    """
    args = args if args is not None else get_args()
    names = ["num_layers", "hidden_size", "num_attention_heads"]
    if args.vocab_file:
        names += ["max_position_embeddings", "make_vocab_size_divisible_by", "tokenizer_type"]
        if check_parallel_sizes:  # the padding depends on TP; a torch_dist checkpoint loads across paddings
            names.append("padded_vocab_size")
    mismatches = []
    for name in names:
        if hasattr(checkpoint_args, name) and getattr(checkpoint_args, name) != getattr(args, name):
            mismatches.append(f"{name}: checkpoint {getattr(checkpoint_args, name)}, this run {getattr(args, name)}")
    sizes = [("tensor_model_parallel_size", "TP", "tensor_model_parallel_size" if checkpoint_version >= 3.0
              else "model_parallel_size")] if check_parallel_sizes else []
    if checkpoint_version >= 3.0 and check_parallel_sizes:
        sizes += [(name, short_name, name) for name, short_name in (
            ("pipeline_model_parallel_size", "PP"), ("expert_model_parallel_size", "EP"),
            ("expert_tensor_parallel_size", "expert TP"))]
    resharded = []
    for name, short_name, saved_name in sizes:
        saved, current = getattr(checkpoint_args, saved_name, None), getattr(args, name, None)
        if None not in (saved, current) and saved != current:
            mismatches.append(f"{name}: checkpoint {saved}, this run {current} ({short_name})")
            resharded.append(name)
    if resharded:
        mismatches.append(_reshard_hint(args, checkpoint_args, resharded))
    if mismatches:
        raise ValueError(
            f"{checkpoint_name} does not match this run's arguments:\n  - " + "\n  - ".join(mismatches)
        )


def _follows_tp(namespace) -> bool:
    return getattr(namespace, "expert_tensor_parallel_size", None) == getattr(namespace, "tensor_model_parallel_size", 0)


def _reshard_hint(args, checkpoint_args, names: list) -> str:
    """The convert.py command that reshards the checkpoint under --load to this run's layout."""
    if _follows_tp(args) and _follows_tp(checkpoint_args):
        # The expert TP size follows the TP size on both sides (the default, any dense model): resharding TP
        # does both.
        names = [name for name in names if name != "expert_tensor_parallel_size"]
    if any(name not in _RESHARD_FLAGS for name in names):
        return ("a torch-format checkpoint is tied to its parallel layout and tools/checkpoint/convert.py cannot "
                "change the expert tensor-parallel size yet: run with the checkpoint's")
    load = os.path.normpath(args.load) if getattr(args, "load", None) else "CHECKPOINT_DIR"
    suffix = "-".join(f"{short}{getattr(args, name)}" for name, short in (
        ("tensor_model_parallel_size", "tp"), ("pipeline_model_parallel_size", "pp"),
        ("expert_model_parallel_size", "ep")) if name in names)
    targets = " ".join(f"{_RESHARD_FLAGS[name]} {getattr(args, name)}" for name in names)
    step = f" --ckpt-step {args.ckpt_step}" if getattr(args, "ckpt_step", None) is not None else ""
    return (f"a torch-format checkpoint is tied to its parallel layout; reshard it with: python "
            f"tools/checkpoint/convert.py --model-type GPT --loader core --saver core --load-dir {load}{step} "
            f"--save-dir {load}-{suffix} {targets}, then --load {load}-{suffix} (convert.py copies the weights only: "
            "add --no-load-optim --no-load-rng)")


def load_args_from_checkpoint(args, load_arg="load"):
    """--use-checkpoint-args: copies the model-shape arguments from the checkpoint under `args.<load_arg>`
    into `args`; returns (args, checkpoint_args), checkpoint_args None when there is nothing to copy from.

    Runs before the parallel groups exist (it reads the file of rank 0, whatever the layout), between
    `parse_args` and `validate_args`. With --use-tokenizer-model-from-checkpoint-args (the default) the
    tokenizer comes from the checkpoint too; with --use-mp-args-from-checkpoint-args the parallel sizes.
    """
    load_dir = getattr(args, load_arg)
    if load_dir is None:
        print_rank_0("No load directory specified, using provided arguments.")
        return args, None
    state_dict, checkpoint_name, _ = load_base_checkpoint(load_dir, args, rank0=True)
    if state_dict is None:
        print_rank_0("Checkpoint not found to provide arguments, using provided arguments.")
        return args, None
    if "args" not in state_dict:
        print_rank_0(f"Checkpoint {checkpoint_name} does not have arguments saved, using provided arguments.")
        return args, None
    checkpoint_args = state_dict["args"]

    def copy(name, force):
        if not force and getattr(args, name, None) is not None:
            return
        value = getattr(checkpoint_args, name, None)
        if value is None:
            print_rank_0(f"Checkpoint did not provide arguments {name}")
            return
        print_rank_0(f"Setting {name} to {value} from checkpoint")
        setattr(args, name, value)

    for name in _ARGS_IF_UNSET:
        copy(name, force=False)
    for name in _ARGS_ALWAYS:
        copy(name, force=True)
    if args.use_tokenizer_model_from_checkpoint_args:
        for name in _TOKENIZER_ARGS:
            copy(name, force=True)
    if args.use_mp_args_from_checkpoint_args:
        for name in _MODEL_PARALLEL_ARGS:
            copy(name, force=True)
    return args, checkpoint_args
