"""`python -m megatron doctor`: what this installation will run on, in one screen.

Versions of Python, torch, CUDA, NCCL and Triton; the GPUs; which optional packages are installed (looked
up in the package metadata); the kernels a run will use for attention (flash-attn, or the SDPA kernels torch
has enabled), norms (apex or torch) and the optimizer step, and whether Transformer Engine is there (each
found by its extension's guarded import, megatron/core/extensions/, so a broken install is reported, never
raised); and the environment variables that change how distributed runs behave.
"""

import importlib.metadata
import importlib.util
import os
import platform
import sys

OPTIONAL_BACKENDS = {
    "transformer_engine": "transformer-engine",
    "apex": "apex",
    "flash_attn": "flash-attn",
    "torchao": "torchao",
    "triton": "triton",
    "nltk": "nltk",
    "sentencepiece": "sentencepiece",
    "tiktoken": "tiktoken",
    "transformers": "transformers",
    "wandb": "wandb",
}

ENVIRONMENT_VARIABLES = [
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "TORCH_DISTRIBUTED_DEBUG", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "NLTK_DATA",
]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _backend_lines(sdpa: str, device_type: str) -> list[str]:
    from megatron.core.extensions import apex, flash_attn, transformer_engine
    from megatron.core.optimizer import adam_step_kernel

    mixed, fp32 = (adam_step_kernel(device_type, mixed_precision) for mixed_precision in (True, False))
    adam = mixed if mixed == fp32 else f"bf16/fp16: {mixed}; fp32: {fp32}"
    return [
        f"attention       {flash_attn.describe(sdpa)}",
        f"norms           {apex.describe_norms()}",
        f"optimizer       {adam}; apex FusedAdam is not used",
        f"TE              {transformer_engine.describe()}",
    ]


def report() -> list[str]:
    """The lines `doctor` prints."""
    import torch

    import megatron

    lines = [
        f"megatron        {megatron.__version__} ({os.path.dirname(megatron.__file__)})",
        f"python          {platform.python_version()} ({sys.executable})",
        f"torch           {torch.__version__}",
    ]
    if torch.cuda.is_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
        lines.append(f"cuda            {torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} GPU(s)")
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            lines.append(
                f"  gpu {index}         {properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
                f"compute capability {properties.major}.{properties.minor}, FP8 GEMMs (--fp8-format): "
                f"{'yes' if (properties.major, properties.minor) >= (8, 9) else 'no, they need 8.9+'}"
            )
        kernels = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
        enabled = ", ".join(name for name, on in kernels.items() if on)
        sdpa = f"torch SDPA (kernels enabled: {enabled})"
        lines.append("distributed     nccl")
    else:
        lines.append("cuda            not available: CPU only (gloo backend, fp32/bf16)")
        sdpa = "torch SDPA (CPU kernels)"
        lines.append("distributed     gloo")
    lines.extend(_backend_lines(sdpa, "cuda" if torch.cuda.is_available() else "cpu"))
    lines.append("optional packages:")
    for module, distribution in OPTIONAL_BACKENDS.items():
        version = _version(distribution) if importlib.util.find_spec(module) is not None else None
        lines.append(f"  {module:<20}{version or 'not installed'}")
    lines.append("environment:")
    lines.extend(f"  {name}={os.environ[name]}" for name in ENVIRONMENT_VARIABLES if name in os.environ)
    unset = [name for name in ENVIRONMENT_VARIABLES if name not in os.environ]
    if unset:
        lines.append(f"  not set: {', '.join(unset)}")
    return lines


def main(argv=None) -> int:
    print("\n".join(report()))
    return 0
