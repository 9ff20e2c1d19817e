"""Core attention: softmax(Q K^T * scale + mask) V for this rank's heads.

Inputs are sequence-first: query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng <= np key/value
heads; query head i uses group i // (np/ng)). Output [sq, b, np * hn]. `config.attention_backend`
picks the kernel: PyTorch SDPA (`auto`, `flash`, `fused`) or the explicit unfused reference (`unfused`,
`local`), which also honours `attention_softmax_in_fp32` and `apply_query_key_layer_scaling`. With
flash-attn installed, `auto` and `flash` send the calls it can take (CUDA fp16/bf16, causal or unmasked;
extensions/flash_attn.py) to its `flash_attn_func`, the rest to SDPA.

Masks are boolean with True = masked, broadcastable to [b, np, sq, sk]. With `AttnMaskType.causal` and
no mask given, the causal mask is built in (SDPA's `is_causal`, no mask tensor at all); a given mask
replaces it. `config.window_size` (left, right) also masks the keys outside the sliding window of each query
(sliding_window_mask), as an explicit mask. With context parallelism (CP > 1) the sequence dimension holds this CP rank's two chunks and
attention runs over all CP ranks (context_parallel/), causal or unmasked.
"""

import contextlib
import logging
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.extensions.flash_attn import load_flash_attention
from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.tensor_parallel.random import model_parallel_rng_region
from megatron.core.transformer.context_parallel import context_parallel_attention, cp_comm_type_of_layer
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

# SDPA kernels per backend, in priority order: SDPA takes the first that accepts the call. `auto` puts cuDNN
# first: on an H100 its causal forward + backward takes 0.85 ms where flash takes 1.60 (Llama-style 3.6B
# shape, bf16; `tools/bench/attention_backends.py`), computing the same function to bf16 rounding.
_SDPA_KERNELS = {
    AttnBackend.auto: [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH],
    AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
    AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
}
_FLASH_ATTN_BACKENDS = (AttnBackend.auto, AttnBackend.flash)
_LOGGED_BACKENDS: set = set()
_MASKED_SCORE = -10000.0  # Megatron's fill value: exp() underflows to 0 yet fully masked rows stay finite


class DotProductAttention(MegatronModule):
    """Core attention of one layer (no projections; those are in `SelfAttention`)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
    ):
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        if softmax_scale is None:
            softmax_scale = config.softmax_scale if config.softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.softmax_scale = softmax_scale
        self.backend = config.attention_backend
        self.use_sdpa = self.backend in _SDPA_KERNELS
        self.flash_attention = load_flash_attention() if self.backend in _FLASH_ATTN_BACKENDS else None
        if self.backend not in _LOGGED_BACKENDS:
            _LOGGED_BACKENDS.add(self.backend)
            kernel = "torch scaled_dot_product_attention" if self.use_sdpa else "unfused matmul-softmax-matmul"
            if self.flash_attention is not None:
                kernel = f"flash-attn {self.flash_attention.version} where it applies, else {kernel}"
            logger.info("core attention: %s (attention_backend=%s)", kernel, self.backend.name)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        reject_unsupported(
            "DotProductAttention",
            attention_bias=attention_bias is not None,
            packed_seq_params=packed_seq_params is not None,
        )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type == AttnMaskType.no_mask:
            attention_mask = None
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        dropout_p = self.dropout_p if self.training else 0.0
        if self.config.window_size is not None:
            window = sliding_window_mask(self.config.window_size, causal, query.size(0), key.size(0), query.device)
            attention_mask = window if attention_mask is None else attention_mask | window
            causal = False
        if self.config.context_parallel_size > 1:
            return self._context_parallel(query, key, value, attention_mask, causal, dropout_p)
        if self._flash_attention_takes(query, key, attention_mask, causal):
            with _dropout_rng(dropout_p):
                return self.flash_attention(query, key, value, dropout_p, self.softmax_scale, causal)
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.use_sdpa:
            context = self._sdpa(q, k, v, attention_mask, causal, dropout_p)
        else:
            context = self._unfused(q, k, v, attention_mask, causal, dropout_p)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        b, heads, sq, hn = context.shape
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _flash_attention_takes(self, query, key, attention_mask, causal) -> bool:
        """True when flash-attn is loaded and can take this call; each reason it cannot is logged once. A layer
        compiled with torch.compile keeps SDPA, which Dynamo traces."""
        if self.flash_attention is None or torch.compiler.is_compiling():
            return False
        reason = self.flash_attention.unsupported_reason(query, key, attention_mask is not None, causal)
        if reason is not None and ("flash-attn", reason) not in _LOGGED_BACKENDS:
            _LOGGED_BACKENDS.add(("flash-attn", reason))
            logger.info("core attention: flash-attn does not take %s; using torch SDPA", reason)
        return reason is None

    def _context_parallel(self, query, key, value, attention_mask, causal, dropout_p):
        """This CP rank's queries against the keys/values of the whole sequence (context_parallel/)."""
        if attention_mask is not None or self.attention_type != "self":
            raise ValueError(
                "context parallelism supports causal or unmasked self-attention only; an explicit attention "
                f"mask or {self.attention_type} attention with context_parallel_size="
                f"{self.config.context_parallel_size} is not supported yet"
            )
        comm_type = cp_comm_type_of_layer(self.config.cp_comm_type, self.layer_number)
        seed = None
        if dropout_p > 0:  # the masks' seed comes from the per-TP-rank stream, like the other dropout here
            with _dropout_rng(dropout_p):
                seed = int(torch.randint(0, 2**62, (1,), device=query.device).item())
        return context_parallel_attention(
            query, key, value, self.softmax_scale, causal, comm_type, dropout_p=dropout_p, dropout_seed=seed,
            use_cudnn=self.backend is not AttnBackend.flash,
        )

    def _sdpa(self, q, k, v, attention_mask, causal, dropout_p):
        kernels = _SDPA_KERNELS[self.backend]
        if q.device.type != "cuda" and self.backend is AttnBackend.auto:
            kernels = None  # SDPA's own choice is `auto` off CUDA
        if kernels and q.device.type != "cuda":
            # The flash / cuDNN / efficient kernels exist on CUDA only; elsewhere SDPA's own choice computes
            # the same function. Say so once instead of failing with "No viable backend".
            if ("cpu-fallback", self.backend) not in _LOGGED_BACKENDS:
                _LOGGED_BACKENDS.add(("cpu-fallback", self.backend))
                logger.warning(
                    "attention_backend=%s needs a CUDA device; using SDPA's default kernel on %s",
                    self.backend.name, q.device.type,
                )
            kernels = None
        pinned = sdpa_kernel(kernels, set_priority=True) if kernels else contextlib.nullcontext()
        with pinned, _dropout_rng(dropout_p):
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if attention_mask is None else ~attention_mask,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=k.size(1) != q.size(1),
            )

    def _unfused(self, q, k, v, attention_mask, causal, dropout_p):
        heads_per_group = q.size(1) // k.size(1)
        if heads_per_group > 1:
            k = k.repeat_interleave(heads_per_group, dim=1)
            v = v.repeat_interleave(heads_per_group, dim=1)
        # Query-key layer scaling divides by the layer number before the (fp16) matmul result is
        # formed and multiplies it back in fp32: the same function with a smaller fp16 range.
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        scores = torch.matmul(q, k.transpose(-2, -1)) * (self.softmax_scale / coeff)  # [b, np, sq, sk]
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if coeff != 1:
            scores = scores * coeff
        if causal:
            sq, sk = scores.shape[-2:]
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, _MASKED_SCORE)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if dropout_p > 0:
            with _dropout_rng(dropout_p):
                probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, v)


def sliding_window_mask(window_size, causal: bool, sq: int, sk: int, device) -> torch.Tensor:
    """[sq, sk] bool, True outside the window: query i attends keys j with i' - left <= j <= i' + right,
    i' = i + sk - sq (the queries are the last sq positions); -1 leaves a side unbounded; `causal` also masks
    j > i'."""
    left, right = window_size
    position = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    keys = torch.arange(sk, device=device).unsqueeze(0)
    outside = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        outside |= keys < position - left
    if right >= 0 or causal:
        outside |= keys > position + (0 if causal else right)
    return outside


def _dropout_rng(dropout_p: float):
    """Heads are split over TP, so their dropout masks come from the per-rank stream."""
    return model_parallel_rng_region() if dropout_p > 0 else contextlib.nullcontext()
