"""The start-up banner (rank 0): what this run is about to do, in one place, before the first iteration.

    layout       world size = TP x PP x CP x DP (EP), and for every rank its host, coordinates and parameters
    model        parameters in total (of the built model: every rank counts its share once); tokens and
                 FLOPs per iteration
    kernels      transformer implementation; the kernels of attention (flash-attn, or SDPA and its enabled
                 kernels), norms (apex or torch) and the optimizer step; Transformer Engine; fusions; and with
                 --fp8-format the FP8 recipe and which layers run in FP8
    environment  the NCCL / CUDA / torch variables that are set (and CUDA_DEVICE_MAX_CONNECTIONS either way)
    signals      what --exit-signal does, and what torchrun passes on and how long it waits
    data         each dataset of the blend with its weight and how many epochs of it the run will draw
    memory       the estimated memory per GPU (memory_estimate.py), for the recompute setting in use

Collective: every rank calls `print_startup_banner` with its place in the layout (one all-gather of each
rank's coordinates).
"""

import os
import socket

import torch
import torch.distributed as dist

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import shards_params
from megatron.core.extensions import apex, flash_attn, transformer_engine
from megatron.core.fp8 import Fp8Recipe
from megatron.core.optimizer import adam_step_kernel
from megatron.core.transformer.context_parallel import block_attention
from megatron.doctor import ENVIRONMENT_VARIABLES
from megatron.training.arguments.core_configs import ddp_config_from_args
from megatron.training.batch_plan import BatchPlan
from megatron.training.datasets.blend import get_blend_and_blend_per_split
from megatron.training.memory_estimate import estimate_memory, format_bytes, total_parameters
from megatron.training.parallel_layout import ParallelLayout
from megatron.training.training_log import num_floating_point_operations

# Set or not, these change how a run behaves; the banner names them either way.
_ALWAYS_SHOWN = ("CUDA_DEVICE_MAX_CONNECTIONS",)
_PREFIXES = ("NCCL_", "TORCH_NCCL_", "NVTE_", "FI_", "CUDA_")
# Ranks listed one per line; a larger world is summarised.
_MAX_LISTED_RANKS = 32


def _counted_here(param, layout: ParallelLayout) -> bool:
    """Whether this rank (at `layout`) counts `param` in the model's total: each weight once over TP, DP x CP
    and EP.

    A weight is split over TP (or expert-TP) or replicated on every TP rank (norms, row-parallel biases);
    dense weights repeat over DP x CP, expert weights over expert-DP; the last pipeline stage's copy of
    tied embeddings (`shared`) repeats the first stage's.
    """
    if getattr(param, "shared", False):
        return False
    split = getattr(param, "tensor_model_parallel", False)
    if not getattr(param, "allreduce", True):  # a routed expert's weight
        return layout.expert_data_parallel_rank == 0 and (split or layout.expert_tensor_parallel_rank == 0)
    return layout.data_context_parallel_rank == 0 and (split or layout.tensor_parallel_rank == 0)


def _rank_coordinates(model, layout: ParallelLayout) -> dict:
    return {
        "counted": sum(param.numel() for chunk in model for param in chunk.parameters()
                       if _counted_here(param, layout)),
        "rank": layout.rank,
        "host": socket.gethostname(),
        "tp": layout.tensor_parallel_rank,
        "pp": layout.pipeline_parallel_rank,
        "dp": layout.data_parallel_rank,
        "cp": layout.context_parallel_rank,
        "ep": layout.expert_parallel_rank,
        "parameters": sum(param.numel() for chunk in model for param in chunk.parameters()),
    }


def _layout_lines(args, ranks: list) -> list:
    lines = [
        f"layout: world size {args.world_size} = TP {args.tensor_model_parallel_size} x PP "
        f"{args.pipeline_model_parallel_size} x CP {args.context_parallel_size} x DP {args.data_parallel_size}"
        f" (EP {args.expert_model_parallel_size})"
    ]
    for entry in ranks[:_MAX_LISTED_RANKS]:
        lines.append(
            f"  rank {entry['rank']:4d} on {entry['host']}: tp {entry['tp']} pp {entry['pp']} dp {entry['dp']} "
            f"cp {entry['cp']} ep {entry['ep']}, {entry['parameters']:,} parameters"
        )
    if len(ranks) > _MAX_LISTED_RANKS:
        counts = [entry["parameters"] for entry in ranks]
        lines.append(f"  ... {len(ranks) - _MAX_LISTED_RANKS} more ranks; parameters per rank from {min(counts):,} "
                     f"to {max(counts):,}")
    return lines


def _attention_kernels(args) -> str:
    if args.context_parallel_size > 1:  # DotProductAttention hands every backend's attention to the blocks
        return (f"context-parallel blocks ({', '.join(dict.fromkeys(args.cp_comm_type))}): "
                f"{block_attention.describe_kernels(use_cudnn=args.attention_backend != 'flash')}")
    if args.attention_backend in ("unfused", "local"):
        return "unfused matmul-softmax-matmul (the explicit reference)"
    if torch.cuda.is_available():
        enabled = [name for name, on in (("flash", torch.backends.cuda.flash_sdp_enabled()),
                                         ("cudnn", torch.backends.cuda.cudnn_sdp_enabled()),
                                         ("efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                                         ("math", torch.backends.cuda.math_sdp_enabled())) if on]
        sdpa = f"torch SDPA on {torch.cuda.get_device_name()} (kernels enabled: {', '.join(enabled)})"
    else:
        sdpa = "torch SDPA, CPU kernels (flash, or math when attention dropout is on)"
    return sdpa if args.attention_backend == "fused" else flash_attn.describe(sdpa)


def _optimizer_kernels(args) -> str:
    if args.optimizer == "muon":
        precision = "bf16" if args.muon_fp32_matmul_prec == "medium" else "fp32"
        return (f"Muon (Newton-Schulz in {precision} torch matmuls) for the weight matrices, torch Adam(W) for the "
                "other params")
    if args.optimizer != "adam":
        return f"torch {args.optimizer.upper()}"
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # FSDP's fp32 shards are updated by torch's Adam(W) itself (fully_sharded_optimizer.py).
    fully_sharded = shards_params(ddp_config_from_args(args))
    mixed_precision = (args.bf16 or args.fp16 or args.use_distributed_optimizer) and not fully_sharded
    bf16_moments = torch.bfloat16 in (args.exp_avg_dtype, args.exp_avg_sq_dtype)
    return f"{adam_step_kernel(device_type, mixed_precision, bf16_moments)}; apex FusedAdam is not used"


def _kernel_lines(args) -> list:
    fusions = [name for name in ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion",
                                 "masked_softmax_fusion", "gradient_accumulation_fusion") if getattr(args, name, False)]
    return [
        f"kernels: --transformer-impl {args.transformer_impl} (this framework's PyTorch layers), --attention-backend "
        f"{args.attention_backend}",
        f"  attention: {_attention_kernels(args)}",
        f"  norms: {apex.describe_norms()}",
        f"  optimizer: {_optimizer_kernels(args)}",
        f"  Transformer Engine: {transformer_engine.describe()}",
        f"  fusions asked for: {', '.join(fusions) or 'none'}",
    ] + _fp8_lines(args)


def _fp8_lines(args) -> list:
    if args.fp8 is None:
        return []
    recipe = Fp8Recipe(args.fp8, args.fp8_recipe, args.fp8_margin, args.fp8_amax_history_len,
                       args.fp8_amax_compute_algo, args.fp8_wgrad)
    layers = f"all {args.num_layers} layers"
    if args.first_last_layers_bf16:
        start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
        layers = f"layers {start + 1} to {args.num_layers - end} (the first {start} and last {end} in bf16)"
    stored = ("; their weights stored in FP8, cast from the fp32 main params and all-gathered as FP8 bytes "
              "(--fp8-param-gather)") if args.fp8_param_gather else ""
    return [f"  {recipe.describe()}; {layers} (embedding and output layer in bf16){stored}"]


def _environment_lines() -> list:
    names = sorted({*ENVIRONMENT_VARIABLES, *(name for name in os.environ if name.startswith(_PREFIXES))})
    shown = [f"{name}={os.environ[name]}" for name in names if name in os.environ]
    shown += [f"{name} unset" for name in _ALWAYS_SHOWN if name not in os.environ]
    return ["environment: " + (", ".join(shown) or "no NCCL/CUDA/torch variables set")]


def _signal_lines(args) -> list:
    if not args.exit_signal_handler:
        return ["signals: --exit-signal-handler is off (a preemption signal kills the run; resume from the last "
                "checkpoint)"]
    name = getattr(args.exit_signal, "name", args.exit_signal)
    return [f"signals: {name} saves a checkpoint at the end of the iteration and exits 0; under torchrun the "
            f"launcher passes on only the signals of --signals-to-handle (default SIGTERM,SIGINT,SIGHUP,SIGQUIT) "
            "and kills the ranks after --shutdown-timeout (default 30 s)"]


def _data_lines(args) -> list:
    """Each dataset's weight and the epochs of it that `--train-iters` x global batch will draw."""
    if args.mock_data:
        return ["data: --mock-data"]
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    if blend is None and not blend_per_split:
        return ["data: provided by the entry script"]
    prefixes, weights = blend if blend is not None else blend_per_split[0]
    weights = weights or [1.0] * len(prefixes)
    split = [float(part) for part in (args.split or "1").replace("/", ",").split(",") if part.strip()]
    train_fraction = split[0] / sum(split) if blend is not None else 1.0
    train_tokens = BatchPlan.from_args(args).samples(args.train_iters) * args.seq_length
    lines = [f"data (train): {train_tokens:,} tokens over {len(prefixes)} dataset(s)"]
    for prefix, weight in zip(prefixes, weights):
        share = weight / sum(weights)
        available = int(IndexedDataset(prefix).index.sequence_lengths.sum()) * train_fraction
        epochs = share * train_tokens / available if available else float("inf")
        lines.append(f"  weight {share:.3f}  {epochs:8.3f} epochs of {available:,.0f} tokens  {prefix}")
    return lines


def banner_lines(args, ranks: list, num_microbatches: int, parameters: int | None = None) -> list:
    """The banner's lines, from validated args and every rank's coordinates; `parameters` is the built
    model's count (each weight once), else the arguments' (memory_estimate.py)."""
    parameters = total_parameters(args) if parameters is None else parameters
    tokens = args.global_batch_size * args.seq_length
    estimate = estimate_memory(args, num_microbatches)
    recompute = args.recompute_granularity == "full"
    memory = estimate.total_full_recompute if recompute else estimate.total
    return [
        "-------------------- start-up banner --------------------",
        *_layout_lines(args, ranks),
        f"model: {parameters:,} parameters; {tokens:,} tokens per iteration "
        f"({args.global_batch_size} sequences of {args.seq_length}); "
        f"{num_floating_point_operations(args, args.global_batch_size):.3e} FLOPs per iteration",
        *_kernel_lines(args),
        *_environment_lines(),
        *_signal_lines(args),
        *_data_lines(args),
        f"memory per GPU (estimate, first pipeline stage{', full recompute' if recompute else ''}): "
        f"{format_bytes(memory)} = weights {format_bytes(estimate.weights)} + gradients "
        f"{format_bytes(estimate.gradients)} + optimizer {format_bytes(estimate.optimizer)} + activations "
        f"{format_bytes(estimate.activations_full_recompute if recompute else estimate.activations)}",
        "---------------------------------------------------------",
    ]


def print_startup_banner(args, model: list, num_microbatches: int, layout: ParallelLayout) -> None:
    """Gathers every rank's coordinates (this one's from `layout`) and prints the banner on rank 0 (collective)."""
    ranks = [None] * layout.world_size
    dist.all_gather_object(ranks, _rank_coordinates(model, layout))
    if layout.rank == 0:
        parameters = sum(entry["counted"] for entry in ranks)
        print("\n".join(banner_lines(args, ranks, num_microbatches, parameters)), flush=True)
