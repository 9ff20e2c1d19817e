"""FP8 recipes: the formats, how scales are chosen, which layers run in FP8, and the checks of the fields.

    fp8="e4m3"     every GEMM operand in E4M3 (max 448, 3 mantissa bits)
    fp8="hybrid"   forward operands X and W in E4M3, the output gradient dY in E5M2 (max 57344, 2 mantissa
                   bits: range for gradients); Transformer Engine's Format.HYBRID
    fp8_recipe="delayed"      one scale per operand from an amax history of earlier steps (scaling.py)
    fp8_recipe="tensorwise"   one scale per operand from that tensor's own amax at each use ("current scaling")

A tensor x becomes q = saturate(x * scale) in FP8 and stands for q * scale_inv, scale_inv = 1 / scale, with
scale = fp8_max / amax / 2^margin: the largest magnitude maps to fp8_max (2^margin leaves headroom).

The GEMMs in FP8 are those of the transformer layers (linear_qkv, linear_proj, linear_fc1, linear_fc2, and
a decoder's cross-attention linears), as Megatron-LM's Transformer Engine spec does: the embedding and the
output layer stay in bf16. `first_last_layers_bf16` keeps the first `num_layers_at_start_in_bf16` and the
last `num_layers_at_end_in_bf16` layers in bf16 too.
"""

from dataclasses import dataclass

import torch

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise")
FP8_RECIPES_NOT_YET = ("mxfp8", "blockwise", "custom")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
# torch._scaled_mm needs both dimensions of its second operand and the inner dimension to be multiples of 16.
GEMM_ALIGNMENT = 16


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings of one model (TransformerConfig's fp8_* fields)."""

    format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True
    """Weight gradients as FP8 GEMMs too; False computes dW = dY^T X in bf16 (`--no-fp8-wgrad`)."""

    @classmethod
    def from_config(cls, config) -> "Fp8Recipe":
        return cls(config.fp8, config.fp8_recipe, config.fp8_margin, config.fp8_amax_history_len,
                   config.fp8_amax_compute_algo, config.fp8_wgrad)

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed"

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """dtype of the output gradient dY."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    def describe(self) -> str:
        """One line for the start-up banner."""
        grads = "E5M2" if self.format == "hybrid" else "E4M3"
        if self.delayed:
            scaling = (f"delayed scaling (amax history {self.amax_history_len}, {self.amax_compute_algo}, "
                       f"margin {self.margin})")
        else:
            scaling = f"tensorwise (current) scaling, margin {self.margin}"
        wgrad = "FP8" if self.wgrad else "bf16"
        return (f"fp8 {self.format}: E4M3 inputs and weights, {grads} output gradients, {scaling}, weight "
                f"gradients in {wgrad}; the transformer layers' linears through torch._scaled_mm")


def layer_runs_in_fp8(config, layer_number: int) -> bool:
    """Whether the layer with global 1-based `layer_number` runs its linears in FP8."""
    if config.fp8 is None:
        return False
    if not config.first_last_layers_bf16:
        return True
    index = layer_number - 1
    return config.num_layers_at_start_in_bf16 <= index < config.num_layers - config.num_layers_at_end_in_bf16


def fp8_gemm_sizes(hidden: int, ffn: int, glu: bool, heads: int, groups: int, kv_channels: int, tp: int) -> dict:
    """{what: size} of every GEMM dimension of a transformer layer on one tensor-parallel rank (the token
    dimension aside: a dW GEMM pads it to a multiple of 16)."""
    return {
        "hidden size h": hidden,
        f"linear_qkv output (np + 2 ng) * hn / TP = ({heads} + 2*{groups}) * {kv_channels} / {tp}":
            (heads + 2 * groups) * kv_channels // tp,
        f"linear_proj input np * hn / TP = {heads} * {kv_channels} / {tp}": heads * kv_channels // tp,
        f"linear_fc1 output {'2 * ' if glu else ''}ffn / TP = {'2 * ' if glu else ''}{ffn} / {tp}":
            (2 if glu else 1) * ffn // tp,
        f"linear_fc2 input ffn / TP = {ffn} / {tp}": ffn // tp,
    }


def fp8_gemm_size_problems(hidden: int, ffn: int, glu: bool, heads: int, groups: int, kv_channels: int,
                           tp: int) -> list:
    """One message per GEMM dimension that torch._scaled_mm cannot take (not a multiple of 16)."""
    sizes = fp8_gemm_sizes(hidden, ffn, glu, heads, groups, kv_channels, tp)
    wrong = [f"{what} = {size}" for what, size in sizes.items() if size % GEMM_ALIGNMENT]
    if not wrong:
        return []
    return [f"FP8 GEMMs (torch._scaled_mm) need sizes that are multiples of {GEMM_ALIGNMENT}: " + "; ".join(wrong)]


def fp8_config_problems(config) -> list:
    """Checks the fp8 fields of a TransformerConfig (after its derived sizes are filled); returns the problems."""
    if config.fp8 is None:
        problems = []
        if config.first_last_layers_bf16:
            problems.append("first_last_layers_bf16=True needs fp8 (it keeps layers out of FP8 training)")
        if config.fp8_param:
            problems.append("fp8_param must be used together with fp8 mode (it stores the weights of the FP8 GEMMs)")
        return problems
    problems = []
    if config.fp8 not in FP8_FORMATS:
        problems.append(f"fp8 must be one of {', '.join(FP8_FORMATS)}, got {config.fp8!r}")
    if config.fp8_recipe in FP8_RECIPES_NOT_YET:
        problems.append(f"fp8_recipe {config.fp8_recipe!r} is not supported yet; use delayed or tensorwise")
    elif config.fp8_recipe not in FP8_RECIPES:
        problems.append(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {config.fp8_recipe!r}")
    if config.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        problems.append(f"fp8_amax_compute_algo must be one of {', '.join(AMAX_COMPUTE_ALGOS)}, got "
                        f"{config.fp8_amax_compute_algo!r}")
    if not isinstance(config.fp8_amax_history_len, int) or config.fp8_amax_history_len < 1:
        problems.append(f"fp8_amax_history_len must be a positive integer, got {config.fp8_amax_history_len!r}")
    if config.fp8_recipe == "tensorwise" and (config.fp8_amax_history_len, config.fp8_amax_compute_algo) != (
            1, "most_recent"):
        problems.append(f"fp8_amax_history_len={config.fp8_amax_history_len} and fp8_amax_compute_algo="
                        f"{config.fp8_amax_compute_algo!r} belong to the delayed recipe: tensorwise scales each "
                        "tensor by its own amax (leave them at 1 and 'most_recent')")
    if not (config.bf16 or config.fp16):
        problems.append("fp8 needs bf16=True or fp16=True (the FP8 GEMMs read and write bf16/fp16 activations)")
    if config.num_moe_experts is not None:
        problems.append("fp8 with num_moe_experts (FP8 expert GEMMs) is not supported yet")
    if config.first_last_layers_bf16:
        start, end = config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16
        if start < 0 or end < 0 or start + end >= config.num_layers:
            problems.append(f"first_last_layers_bf16: num_layers_at_start_in_bf16 ({start}) + "
                            f"num_layers_at_end_in_bf16 ({end}) must be >= 0 each and leave at least one of the "
                            f"{config.num_layers} layers in FP8")
    problems += fp8_gemm_size_problems(config.hidden_size, config.ffn_hidden_size, config.gated_linear_unit,
                                       config.num_attention_heads, config.num_query_groups, config.kv_channels,
                                       config.tensor_model_parallel_size)
    return problems
