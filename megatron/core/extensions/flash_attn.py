"""The only module that imports flash-attn (Dao-AILab/flash-attention 2.x). Optional: without it, and for the
calls it does not take, core attention runs in torch's scaled_dot_product_attention (SDPA), whose flash
backend is the same FlashAttention-2 algorithm.

    flash_attn_func(q, k, v, dropout_p, softmax_scale, causal) -> out
    q [b, sq, np, hn], k and v [b, sk, ng, hn], out [b, sq, np, hn]

ng divides np and query head i attends to key/value head i // (np / ng), the grouping of core attention, so
GQA needs no copies. flash-attn (>= 2.1) aligns its causal mask to the bottom-right corner of the [sq, sk]
scores (query i sees keys 0 .. i + sk - sq), SDPA's `is_causal` to the top-left (keys 0 .. i): the two agree
only when sq == sk, so causal attention goes to flash-attn only then. Its dropout draws from torch's CUDA
generator (philox seed and offset), so the model-parallel RNG region around the call applies as for SDPA.

A call can go to flash-attn when `unsupported_reason` finds nothing: no explicit mask, fp16 or bf16, head
dim a multiple of 8 up to 256, a CUDA device of compute capability 8.0 or newer (flash-attn 2 runs on
Ampere and later). A layer compiled with torch.compile keeps SDPA, which Dynamo traces.
"""

import functools
import logging

import torch

from megatron.core.extensions import import_optional

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_MIN_CAPABILITY = (8, 0)


class FlashAttention:
    """flash-attn's `flash_attn_func` on core attention's sequence-first tensors."""

    def __init__(self, module):
        self.flash_attn_func = module.flash_attn_func
        self.version = module.__version__

    def unsupported_reason(self, query: torch.Tensor, key: torch.Tensor, masked: bool, causal: bool) -> str | None:
        """Why flash-attn cannot take this call (None: it can). query [sq, b, np, hn], key [sk, b, ng, hn]."""
        if masked:
            return "an explicit attention mask"
        if causal and query.size(0) != key.size(0):
            return (f"causal attention of {query.size(0)} queries over {key.size(0)} keys (flash-attn aligns the "
                    "causal mask to the bottom-right corner)")
        if query.dtype not in _DTYPES:
            return f"{query.dtype} inputs (needs float16 or bfloat16)"
        head_dim = query.size(-1)
        if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
            return f"head dim {head_dim} (needs a multiple of 8 up to {_MAX_HEAD_DIM})"
        if query.device.type != "cuda":
            return f"a {query.device.type} device (needs CUDA)"
        capability = torch.cuda.get_device_capability(query.device)
        if capability < _MIN_CAPABILITY:
            return f"compute capability {capability[0]}.{capability[1]} (needs 8.0 or newer)"
        return None

    def __call__(self, query, key, value, dropout_p: float, softmax_scale: float, causal: bool) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        # [s, b, heads, hn] -> [b, s, heads, hn]: views; flash-attn needs only the last dimension contiguous.
        q, k, v = (tensor.transpose(0, 1) for tensor in (query, key, value))
        # Its backward accumulates dq with atomics unless asked for the deterministic one (--deterministic-mode).
        deterministic = {"deterministic": True} if torch.are_deterministic_algorithms_enabled() else {}
        out = self.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                   **deterministic)
        # [b, sq, np, hn] -> [sq, b, np * hn]
        sq, b, heads, head_dim = query.shape
        return out.transpose(0, 1).reshape(sq, b, heads * head_dim)


@functools.cache
def load_flash_attention() -> FlashAttention | None:
    """flash-attn's kernel when `flash_attn` 2.x or newer imports, else None (a broken install says why)."""
    module = import_optional("flash_attn", instead="attention uses torch SDPA")
    if module is None:
        return None
    version = getattr(module, "__version__", "0")
    if not hasattr(module, "flash_attn_func") or int(version.split(".")[0]) < 2:
        logger.warning("flash_attn %s has no flash-attn 2 `flash_attn_func`; attention uses torch SDPA", version)
        return None
    return FlashAttention(module)


def describe(sdpa: str) -> str:
    """One line for the banner and `doctor`: the kernels of core attention (auto or flash), `sdpa` naming SDPA's."""
    flash = load_flash_attention()
    if flash is None:
        return f"{sdpa}; flash-attn not installed"
    return f"flash-attn {flash.version} for fp16/bf16 on CUDA, causal or unmasked; {sdpa} for the rest"
