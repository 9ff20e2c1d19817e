"""Flags that Megatron-LM removed or renamed but old tutorials still pass.

Each is accepted by the parser. Validation then translates it to today's flags and prints one
"deprecated" line for it (rank 0, stderr), or, where no translation exists, reports a problem that names
the replacement. The old dests are removed from the namespace afterwards, as Megatron does.

History of the recompute names in Megatron-LM: `--checkpoint-activations` (+ `--checkpoint-num-layers`)
until Aug 2021, then `--activations-checkpoint-method/-num-layers` (num-layers defaulting to 1) until
2022, now `--recompute-granularity/-method/-num-layers`.
"""

import argparse
from dataclasses import dataclass, field
from typing import Callable

from megatron.training.arguments.reporting import warn_rank_0

# translate(args, flag, value, problems) -> what the flag now means, or None after adding a problem.
Translator = Callable[[argparse.Namespace, str, object, list], str | None]


@dataclass(frozen=True)
class _Deprecated:
    flags: tuple
    dest: str
    translate: Translator
    parser_kwargs: dict = field(default_factory=lambda: {"action": "store_true"})


def _assign(args, problems, old_flag, dest, value, new_flag, unset=None) -> bool:
    """Sets `dest` to `value` unless the new flag was given with a different value (then a problem)."""
    current = getattr(args, dest)
    if current not in (unset, value):
        problems.append(f"{old_flag} means {new_flag} {value}, but {new_flag} {current} was also given; "
                        f"drop {old_flag}")
        return False
    setattr(args, dest, value)
    return True


def _maps_to(new_flag: str, dest: str, value=None, unset=None) -> Translator:
    """The old flag is a renamed new flag; `value` None means "the old flag's own value"."""
    def translate(args, flag, given, problems):
        new_value = given if value is None else value
        if not _assign(args, problems, flag, dest, new_value, new_flag, unset):
            return None
        return f"use {new_flag}" if new_value is True else f"use {new_flag} {new_value}"
    return translate


def _ignored(reason: str) -> Translator:
    def translate(args, flag, given, problems):
        return f"ignored: {reason}"
    return translate


def _cuda_graph_scope(args, flag, given, problems):
    """Megatron-LM's migration: the scope `full_iteration` (with --cuda-graph-impl local or --enable-cuda-graph)
    is --cuda-graph-impl full_iteration; the other scopes are --cuda-graph-modules."""
    scopes = list(given or [])
    if "full_iteration" in scopes:
        scopes.remove("full_iteration")
        if args.cuda_graph_impl not in ("none", "local", "full_iteration"):
            problems.append(f"{flag} full_iteration cannot go with --cuda-graph-impl {args.cuda_graph_impl}")
            return None
        args.cuda_graph_impl = "full_iteration"
    modules = [scope for scope in scopes if scope != "full"]  # "full": the whole layer, i.e. no module list
    if modules:
        args.cuda_graph_modules = modules
    return "use --cuda-graph-impl full_iteration" if args.cuda_graph_impl == "full_iteration" else \
        "use --cuda-graph-modules"


def _removed(replacement: str) -> Translator:
    def translate(args, flag, given, problems):
        problems.append(f"{flag} was removed from Megatron-LM: {replacement}")
        return None
    return translate


def _full_recompute(implied_method: str | None) -> Translator:
    """Old full-layer recompute. The method is the flag's value, or `implied_method` unless a method was
    given separately; the old num-layers default was 1."""
    def translate(args, flag, given, problems):
        method = given if implied_method is None else (args.recompute_method or implied_method)
        if not (_assign(args, problems, flag, "recompute_granularity", "full", "--recompute-granularity")
                and _assign(args, problems, flag, "recompute_method", method, "--recompute-method")):
            return None
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
        return (f"using --recompute-granularity full --recompute-method {method} "
                f"--recompute-num-layers {args.recompute_num_layers}")
    return translate


def _no_position_embedding(args, flag, given, problems):
    if args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"
    return f"use --position-embedding-type (now {args.position_embedding_type})"


def _data_impl(args, flag, given, problems):
    if given in ("lazy", "cached"):
        problems.append(f"{flag} {given} selects the pre-mmap index format, which is not supported: re-run "
                        "tools/preprocess_data.py to write mmap .bin/.idx files")
        return None
    return "ignored: mmap .bin/.idx is the only dataset format"


_SPLIT_PATH = "preprocess with tools/preprocess_data.py and pass --{}-data-path (or --data-path with --split)"

# Processed in this order: the num-layers flags come before the method flags that default them to 1.
DEPRECATED_FLAGS = (
    _Deprecated(("--activations-checkpoint-num-layers",), "activations_checkpoint_num_layers",
                _maps_to("--recompute-num-layers", "recompute_num_layers"), {"type": int}),
    _Deprecated(("--checkpoint-num-layers",), "checkpoint_num_layers",
                _maps_to("--recompute-num-layers", "recompute_num_layers"), {"type": int}),
    _Deprecated(("--activations-checkpoint-method",), "activations_checkpoint_method", _full_recompute(None),
                {"choices": ["uniform", "block"]}),
    _Deprecated(("--checkpoint-activations",), "checkpoint_activations", _full_recompute("uniform")),
    _Deprecated(("--distribute-checkpointed-activations",), "distribute_checkpointed_activations",
                _maps_to("--distribute-saved-activations", "distribute_saved_activations", True, unset=False)),
    _Deprecated(("--data-impl", "--dataset-impl"), "data_impl", _data_impl,
                {"choices": ["mmap", "infer", "lazy", "cached"]}),
    _Deprecated(("--use-flash-attn",), "use_flash_attn",
                _maps_to("--attention-backend", "attention_backend", "flash", unset="auto")),
    _Deprecated(("--use-rotary-position-embeddings",), "use_rotary_position_embeddings",
                _maps_to("--position-embedding-type", "position_embedding_type", "rope", unset="learned_absolute")),
    _Deprecated(("--no-position-embedding",), "no_position_embedding", _no_position_embedding),
    _Deprecated(("--layernorm-epsilon",), "layernorm_epsilon_deprecated",
                _maps_to("--norm-epsilon", "layernorm_epsilon", unset=1e-5), {"type": float}),
    _Deprecated(("--override-lr-scheduler",), "override_lr_scheduler",
                _maps_to("--override-opt-param-scheduler", "override_opt_param_scheduler", True, unset=False)),
    _Deprecated(("--use-checkpoint-lr-scheduler",), "use_checkpoint_lr_scheduler",
                _maps_to("--use-checkpoint-opt-param-scheduler", "use_checkpoint_opt_param_scheduler", True,
                         unset=False)),
    _Deprecated(("--fp8-e4m3",), "fp8_e4m3", _maps_to("--fp8-format", "fp8", "e4m3")),
    _Deprecated(("--fp8-hybrid",), "fp8_hybrid", _maps_to("--fp8-format", "fp8", "hybrid")),
    _Deprecated(("--enable-cuda-graph",), "enable_cuda_graph",
                _maps_to("--cuda-graph-impl", "cuda_graph_impl", "local", unset="none")),
    _Deprecated(("--cuda-graph-scope",), "cuda_graph_scope", _cuda_graph_scope, {"nargs": "*"}),
    _Deprecated(("--use-dist-ckpt",), "use_dist_ckpt",
                _maps_to("--ckpt-format", "ckpt_format", "torch_dist", unset="torch_dist")),
    _Deprecated(("--dist-ckpt-format",), "dist_ckpt_format", _ignored("use --ckpt-format"), {}),
    _Deprecated(("--ckpt-fully-parallel-save",), "ckpt_fully_parallel_save_deprecated",
                _ignored("parallel save is the default; --no-ckpt-fully-parallel-save turns it off")),
    _Deprecated(("--use-mcore-models",), "deprecated_use_mcore_models",
                _ignored("Megatron-Core models are the only models")),
    _Deprecated(("--DDP-impl",), "DDP_impl", _ignored("gradients are reduced by Megatron-Core's bucketed DDP"),
                {"choices": ["local", "torch"]}),
    _Deprecated(("--no-contiguous-buffers-in-local-ddp",), "no_contiguous_buffers_in_local_ddp",
                _ignored("gradients always live in contiguous buffers")),
    _Deprecated(("--use-contiguous-buffers-in-local-ddp",), "use_contiguous_buffers_in_local_ddp",
                _ignored("gradients always live in contiguous buffers")),
    _Deprecated(("--no-async-tensor-model-parallel-allreduce",), "no_async_tensor_model_parallel_allreduce",
                _ignored("Megatron ignores it too")),
    _Deprecated(("--no-query-key-layer-scaling",), "no_query_key_layer_scaling",
                _ignored("query-key layer scaling is off unless --apply-query-key-layer-scaling")),
    _Deprecated(("--log-batch-size-to-tensorboard",), "log_batch_size_to_tensorboard",
                _ignored("the batch size is always written")),
    _Deprecated(("--no-log-learnig-rate-to-tensorboard",), "no_log_learning_rate_to_tensorboard",
                _ignored("the learning rate is always written")),
    _Deprecated(("--no-scatter-gather-tensors-in-pipeline",), "no_scatter_gather_tensors_in_pipeline",
                _ignored("Megatron-LM removed it; pipeline stages always send whole activations here")),
    _Deprecated(("--use-legacy-models",), "use_legacy_models",
                _removed("legacy (non-core) models do not exist here; drop the flag")),
    _Deprecated(("--batch-size",), "batch_size", _removed("use --micro-batch-size (and --global-batch-size)"),
                {"type": int}),
    _Deprecated(("--model-parallel-size",), "model_parallel_size", _removed("use --tensor-model-parallel-size"),
                {"type": int}),
    _Deprecated(("--warmup",), "warmup",
                _removed("use --lr-warmup-fraction, --lr-warmup-iters or --lr-warmup-samples"), {"type": float}),
    _Deprecated(("--train-data",), "train_data", _removed(_SPLIT_PATH.format("train")), {"nargs": "*"}),
    _Deprecated(("--valid-data",), "valid_data", _removed(_SPLIT_PATH.format("valid")), {"nargs": "*"}),
    _Deprecated(("--test-data",), "test_data", _removed(_SPLIT_PATH.format("test")), {"nargs": "*"}),
)


def _add_deprecated_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="deprecated (translated with a warning, or refused with the "
                                            "replacement)")
    for entry in DEPRECATED_FLAGS:
        # default None marks "not given" for every kind of flag, store_true included.
        group.add_argument(*entry.flags, dest=entry.dest, default=None, help=argparse.SUPPRESS,
                           **entry.parser_kwargs)
    return parser


def translate_deprecated_args(args: argparse.Namespace, problems: list) -> None:
    """Maps every deprecated flag that was given onto today's flags, warning once per flag; refused ones
    become entries of `problems`. Removes the deprecated dests from `args`."""
    for entry in DEPRECATED_FLAGS:
        given = getattr(args, entry.dest, None)
        if given is not None:
            name = "/".join(entry.flags)
            meaning = entry.translate(args, name, given, problems)
            if meaning is not None:
                warn_rank_0(f"{name} is deprecated; {meaning}")
        if hasattr(args, entry.dest):
            delattr(args, entry.dest)
