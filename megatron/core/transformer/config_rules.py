"""Rules of `TransformerConfig` that the training command line checks too, written once.

`TransformerConfig.__post_init__` names a setting by its field, `num_attention_heads (12)`; the argument
validation of megatron/training runs the same functions before any config exists and names it by its flag,
`--num-attention-heads 12`, through the `name` argument:

    name(field)         -> how the message names the setting
    name(field, value)  -> the same, with the value it has
"""

import math
from typing import Callable

from megatron.core.model_parallel_config import divisors, legal_sizes

SettingName = Callable[..., str]


def field_setting(field: str, *value) -> str:
    """A setting named as a config field: `num_layers`, or with its value `num_layers (6)`."""
    return f"{field} ({value[0]})" if value else field


def tensor_parallel_sizes_for_attention(num_attention_heads: int, num_query_groups: int) -> list[int]:
    """The TP sizes p that split `num_attention_heads` query heads in `num_query_groups` key/value groups:
    p divides the heads, and either divides the groups (whole groups per rank) or is a multiple of them
    (p / ng ranks share one key/value head)."""
    return [
        size
        for size in divisors(num_attention_heads)
        if num_query_groups % size == 0 or size % num_query_groups == 0
    ]


def tensor_parallel_split_problems(
    num_attention_heads: int,
    num_query_groups: int | None,
    ffn_hidden_size: int,
    tensor_model_parallel_size: int,
    name: SettingName = field_setting,
) -> list[str]:
    """A layer split over TP ranks: each rank holds heads / TP query heads, whole key/value groups (or
    TP / groups ranks share one), and ffn / TP columns of the MLP. `num_query_groups` None is one group per
    head. Lists the legal TP sizes."""
    heads, tp = num_attention_heads, tensor_model_parallel_size
    groups = heads if num_query_groups is None else num_query_groups
    problems = []
    if tp < 1:
        return problems  # reported with the parallel layout
    if heads % tp:
        problems.append(f"{name('num_attention_heads', heads)} must be divisible by "
                        f"{name('tensor_model_parallel_size', tp)}; valid TP sizes: {legal_sizes(heads)}")
    if groups < 1 or heads % groups:
        problems.append(f"{name('num_query_groups', groups)} must divide {name('num_attention_heads', heads)}; "
                        f"valid: {legal_sizes(heads)}")
    elif groups % tp and tp % groups and groups != heads:  # groups == heads: reported as a heads problem
        legal = ", ".join(map(str, tensor_parallel_sizes_for_attention(heads, groups)))
        problems.append(f"{name('num_query_groups', groups)} must be a multiple or a divisor of "
                        f"{name('tensor_model_parallel_size', tp)}; valid TP sizes: {legal} (each TP rank holds "
                        "whole key/value heads, or several ranks share one)")
    if ffn_hidden_size % tp:
        legal = ", ".join(str(size) for size in divisors(heads) if ffn_hidden_size % size == 0)
        problems.append(f"{name('ffn_hidden_size', ffn_hidden_size)} must be divisible by "
                        f"{name('tensor_model_parallel_size', tp)}; valid TP sizes (dividing it and the heads): "
                        f"{legal}")
    return problems


def recompute_layer_problems(
    recompute_granularity: str | None,
    recompute_method: str | None,
    recompute_num_layers: int | None,
    num_layers: int | None,
    pipeline_model_parallel_size: int,
    name: SettingName = field_setting,
) -> list[str]:
    """Full recompute needs a method and 1 <= recompute_num_layers <= layers per pipeline stage
    (num_layers / PP; not checked while num_layers is unknown); selective recompute takes no layer count."""
    layers = recompute_num_layers
    problems = []
    if recompute_granularity == "full":
        full = name("recompute_granularity", "full")
        if recompute_method is None:
            problems.append(f"{full} needs {name('recompute_method')} uniform or block")
        if layers is None:
            problems.append(f"{full} needs {name('recompute_num_layers')}")
        elif num_layers is not None:
            pp = pipeline_model_parallel_size
            per_stage = num_layers // max(pp, 1)
            if not 1 <= layers <= max(per_stage, 1):
                problems.append(f"{name('recompute_num_layers', layers)} must be between 1 and the {per_stage} "
                                f"layers per pipeline stage (= {name('num_layers', num_layers)} / "
                                f"{name('pipeline_model_parallel_size', pp)})")
    elif recompute_granularity == "selective" and layers is not None:
        problems.append(f"{name('recompute_num_layers')} applies to {name('recompute_granularity', 'full')} only, "
                        "not selective")
    return problems


RECOMPUTE_MODULES_SUPPORTED = ("core_attn", "mlp", "layernorm", "moe_act", "mla_up_proj")
RECOMPUTE_MODULES_NOT_YET = ("moe", "shared_experts", "gdn_norm_out")
# Recomputed into their outputs' storage (tensor_parallel.CheckpointWithoutOutput).
_OUTPUT_DISCARDING = ("layernorm", "moe_act", "mla_up_proj")


def recompute_module_problems(recompute_granularity: str | None, recompute_modules: list | None,
                              settings=None, name: SettingName = field_setting) -> list[str]:
    """Selective recompute: each of `recompute_modules` is one built here, or one of Megatron-Core's that is not
    built yet (refused so), or unknown; "moe_act" needs `moe_grouped_gemm` and "mla_up_proj"
    `multi_latent_attention` (Megatron-Core's rules), and the output-discarding ones are not combined with
    `use_torch_compile` yet. `settings` (a TransformerConfig or the arguments) holds those three."""
    if recompute_granularity != "selective":
        return []
    problems = []
    modules = recompute_modules or ()
    if "moe_act" in modules and not getattr(settings, "moe_grouped_gemm", False):
        problems.append(f"{name('recompute_modules')} entry 'moe_act' needs {name('moe_grouped_gemm')} (as in "
                        "Megatron-LM)")
    if "mla_up_proj" in modules and not getattr(settings, "multi_latent_attention", False):
        problems.append(f"{name('recompute_modules')} entry 'mla_up_proj' needs {name('multi_latent_attention')} "
                        "(as in Megatron-LM)")
    discarding = [module for module in modules if module in _OUTPUT_DISCARDING]
    if discarding and getattr(settings, "use_torch_compile", False):
        problems.append(f"{name('recompute_modules')} {' '.join(discarding)} with {name('use_torch_compile')} is "
                        "not supported yet")
    for module in modules:
        if module in RECOMPUTE_MODULES_NOT_YET:
            problems.append(f"{name('recompute_modules')} entry {module!r} is not supported yet; supported: "
                            f"{', '.join(RECOMPUTE_MODULES_SUPPORTED)}")
        elif module not in RECOMPUTE_MODULES_SUPPORTED:
            problems.append(f"unknown {name('recompute_modules')} entry {module!r}; valid: "
                            f"{', '.join(RECOMPUTE_MODULES_SUPPORTED + RECOMPUTE_MODULES_NOT_YET)}")
    return problems


GATED_DELTA_NET_VARIANTS = ("gdn", "gated_delta_net")  # "gated_delta_net": Megatron-Core's older name


def linear_attention_pattern(num_layers: int, experimental_attention_variant: str | None,
                             linear_attention_freq) -> list[int]:
    """One entry per layer, 1 = Gated DeltaNet, 0 = softmax attention: with `linear_attention_freq` N, layer i
    (from 0) is softmax attention when (i + 1) % N == 0; a list is the pattern itself; all 0 without linear
    attention."""
    if experimental_attention_variant not in GATED_DELTA_NET_VARIANTS:
        return [0] * num_layers
    if isinstance(linear_attention_freq, int):
        return [0 if (index + 1) % linear_attention_freq == 0 else 1 for index in range(num_layers)]
    return list(linear_attention_freq)


def linear_attention_problems(settings, name: SettingName = field_setting) -> list[str]:
    """Gated DeltaNet layers (`experimental_attention_variant` gdn / gated_delta_net; megatron/core/ssm):
    `linear_attention_freq` N >= 1 (every N-th layer keeps softmax attention) or one 0/1 entry per layer
    (1 = linear attention); positive head sizes; value heads a multiple of key heads; both head counts
    divisible by TP x CP (Megatron-Core's rule; CP > 1 is not supported yet); with FP8 an in_proj width that
    is a multiple of 16. `settings` has those names (a TransformerConfig, or the parsed arguments)."""
    variant = settings.experimental_attention_variant
    if variant is None:
        return []
    if variant not in GATED_DELTA_NET_VARIANTS:
        return [f"{name('experimental_attention_variant', variant)} is not supported yet; use gated_delta_net (gdn)"]
    problems = []
    freq, num_layers = settings.linear_attention_freq, settings.num_layers
    if freq is None:
        problems.append(f"{name('experimental_attention_variant', variant)} needs {name('linear_attention_freq')}")
    elif isinstance(freq, int) and freq < 1:
        problems.append(f"{name('linear_attention_freq', freq)} must be at least 1")
    elif isinstance(freq, list) and num_layers is not None and (len(freq) != num_layers or set(freq) - {0, 1}):
        problems.append(f"{name('linear_attention_freq')} {freq} must hold one 0 or 1 per layer ({num_layers})")
    sizes = {field: getattr(settings, field) for field in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                          "linear_value_head_dim", "linear_num_key_heads",
                                                          "linear_num_value_heads")}
    bad = [name(field, value) for field, value in sizes.items() if value is None or value < 1]
    if bad:
        return problems + [f"{', '.join(bad)} must be positive"]
    key_heads, value_heads = sizes["linear_num_key_heads"], sizes["linear_num_value_heads"]
    if value_heads % key_heads:
        problems.append(f"{name('linear_num_value_heads', value_heads)} must be a multiple of "
                        f"{name('linear_num_key_heads', key_heads)} (each key head serves a group of value heads)")
    in_proj = 2 * key_heads * sizes["linear_key_head_dim"] + 2 * value_heads * (sizes["linear_value_head_dim"] + 1)
    if getattr(settings, "fp8", None) and in_proj % 16:
        problems.append(f"FP8 GEMMs need Gated DeltaNet's in_proj width 2 nk dk + 2 nv (dv + 1) = {in_proj} to be a "
                        f"multiple of 16 (as in Megatron-LM)")
    tp, cp = settings.tensor_model_parallel_size, settings.context_parallel_size
    if cp > 1:
        problems.append(f"Gated DeltaNet with {name('context_parallel_size', cp)} is not supported yet")
    if tp >= 1 and (key_heads % tp or value_heads % tp):
        problems.append(f"{name('linear_num_key_heads', key_heads)} and {name('linear_num_value_heads', value_heads)} "
                        f"must be divisible by {name('tensor_model_parallel_size', tp)}; valid TP sizes: "
                        f"{legal_sizes(math.gcd(key_heads, value_heads))}")
    return problems
