"""The MoE fields of `TransformerConfig`: their checks and derived defaults (one problem list, like the rest).

Megatron-LM accepts some fields as one-element lists (`--moe-router-load-balancing-type aux_loss`,
`--moe-aux-loss-coeff 1e-2` are `nargs="+"`); a one-element list is unwrapped here, several entries (a
combination of balancing losses) are not supported yet.
"""

from megatron.core.transformer.pipeline_layer_split import pipeline_layer_counts

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
LOAD_BALANCING_NOT_YET = ("global_aux_loss", "quantile_balancing")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DISPATCHERS = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")


def _unwrap_single(config, name: str, problems: list) -> None:
    value = getattr(config, name)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            problems.append(f"{name}={list(value)}: combining several load-balancing losses is not supported yet")
            return
        setattr(config, name, value[0])


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _layer_freq_problems(config) -> list:
    freq, layers = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        return [] if freq >= 1 else [f"moe_layer_freq must be a positive integer or a 0/1 list, got {freq}"]
    if isinstance(freq, (list, tuple)):
        if any(entry not in (0, 1) for entry in freq):
            return [f"moe_layer_freq list must hold only 0 (dense) and 1 (MoE), got {list(freq)}"]
        if len(freq) != layers:
            return [f"moe_layer_freq has {len(freq)} entries but the model has num_layers={layers}"]
        return []
    return [f"moe_layer_freq must be an int or a list of 0/1, got {freq!r}"]


def moe_layer_pattern(num_layers: int, moe_layer_freq) -> list:
    """One entry per layer of the model, 1 = MoE: `moe_layer_freq` N makes layers 0, N, 2N, ... MoE."""
    if isinstance(moe_layer_freq, int):
        return [int(index % moe_layer_freq == 0) for index in range(num_layers)]
    return list(moe_layer_freq)


def moe_config_problems(config) -> list:
    """Checks the MoE fields of a TransformerConfig, fills `moe_ffn_hidden_size`; returns the problems."""
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    if experts is None:
        if ep > 1:
            return [f"expert_model_parallel_size={ep} needs num_moe_experts (--num-experts)"]
        return []
    if not isinstance(experts, int) or experts < 1:
        return [f"num_moe_experts must be a positive integer, got {experts!r}"]
    problems = []
    if experts % ep:
        problems.append(
            f"num_moe_experts ({experts}) must be divisible by expert_model_parallel_size ({ep}); "
            f"EP sizes for {experts} experts: {_divisors(experts)}"
        )
    if not 1 <= config.moe_router_topk <= experts:
        problems.append(f"moe_router_topk ({config.moe_router_topk}) must be between 1 and num_moe_experts ({experts})")
    _unwrap_single(config, "moe_router_load_balancing_type", problems)
    _unwrap_single(config, "moe_aux_loss_coeff", problems)
    balancing = config.moe_router_load_balancing_type
    if balancing in LOAD_BALANCING_NOT_YET:
        problems.append(f"moe_router_load_balancing_type {balancing!r} is not supported yet; "
                        f"use {', '.join(LOAD_BALANCING_TYPES)}")
    elif isinstance(balancing, str) and balancing not in LOAD_BALANCING_TYPES:
        problems.append(f"moe_router_load_balancing_type must be one of {', '.join(LOAD_BALANCING_TYPES)}, "
                        f"got {balancing!r}")
    if balancing == "sinkhorn" and config.moe_aux_loss_coeff:
        problems.append(f"moe_router_load_balancing_type 'sinkhorn' has no auxiliary loss (Megatron-LM's rule): set "
                        f"moe_aux_loss_coeff 0, got {config.moe_aux_loss_coeff}")
    if config.moe_router_score_function not in SCORE_FUNCTIONS:
        problems.append(f"moe_router_score_function {config.moe_router_score_function!r} is not supported yet; "
                        f"use {' or '.join(SCORE_FUNCTIONS)}")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        problems.append("moe_router_enable_expert_bias (aux-loss-free balancing) needs "
                        "moe_router_score_function='sigmoid', as in Megatron-LM")
    if config.moe_router_dtype not in (None, "fp32"):
        problems.append(f"moe_router_dtype {config.moe_router_dtype!r} is not supported yet; the router runs in fp32")
    if config.moe_token_dispatcher_type not in DISPATCHERS:
        problems.append(f"moe_token_dispatcher_type {config.moe_token_dispatcher_type!r} is not supported yet; "
                        f"use {' or '.join(DISPATCHERS)}")
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        problems.append(f"moe_expert_capacity_factor must be positive (or None for no token dropping), got {factor}")
    if config.moe_pad_expert_input_to_capacity:
        problems.append("moe_pad_expert_input_to_capacity=True is not supported yet")
    if config.moe_token_drop_policy not in DROP_POLICIES:
        problems.append(f"moe_token_drop_policy must be one of {', '.join(DROP_POLICIES)}, "
                        f"got {config.moe_token_drop_policy!r}")
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    etp = config.expert_tensor_parallel_size
    if config.moe_ffn_hidden_size % etp:
        problems.append(f"moe_ffn_hidden_size ({config.moe_ffn_hidden_size}) must be divisible by "
                        f"expert_tensor_parallel_size ({etp})")
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and shared % config.tensor_model_parallel_size:
        problems.append(f"moe_shared_expert_intermediate_size ({shared}) must be divisible by "
                        f"tensor_model_parallel_size ({config.tensor_model_parallel_size})")
    if config.add_bias_linear and config.moe_grouped_gemm:
        problems.append("moe_grouped_gemm has no expert biases, as in Megatron-LM: set add_bias_linear=False "
                        "(--disable-bias-linear) or run the experts one by one (moe_grouped_gemm=False)")
    if config.add_bias_linear and shared is not None:
        problems.append("shared experts have no biases, as in Megatron-LM: set add_bias_linear=False "
                        "(--disable-bias-linear) with moe_shared_expert_intermediate_size")
    problems += _layer_freq_problems(config)
    problems += _group_routing_problems(config)
    if not problems:
        problems += _pipeline_stage_problems(config)
    return problems


def _pipeline_stage_problems(config) -> list:
    """Every pipeline rank must hold a MoE layer: the expert optimizer reduces its statistics over all of them."""
    pp = config.pipeline_model_parallel_size
    if not isinstance(pp, int) or pp < 2:
        return []
    try:
        counts = pipeline_layer_counts(config)
    except ValueError:  # reported by the pipeline split's own check
        return []
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    has_experts, offset = [False] * pp, 0
    for chunk in counts:  # virtual stages in execution order, each over the pipeline ranks
        for rank, count in enumerate(chunk):
            has_experts[rank] |= any(pattern[offset:offset + count])
            offset += count
    has_experts[-1] |= bool(config.mtp_num_layers and pattern[-1])  # its MTP layers are of the last layer's kind
    dense = [rank for rank, moe in enumerate(has_experts) if not moe]
    if not dense:
        return []
    return [f"pipeline rank(s) {dense} would hold only dense layers of this MoE model: a pipeline stage without "
            "experts is not supported yet (the expert optimizer reduces its statistics over every stage); change "
            "moe_layer_freq or the pipeline split"]


def _group_routing_problems(config) -> list:
    """Group-limited routing: both sizes or neither; groups divide the experts; the top-k fits the chosen groups."""
    groups, group_topk, experts = config.moe_router_num_groups, config.moe_router_group_topk, config.num_moe_experts
    if groups is None and group_topk is None:
        return []
    if groups is None or group_topk is None:
        return ["group-limited routing needs both moe_router_num_groups and moe_router_group_topk "
                f"(got {groups} and {group_topk})"]
    if groups < 1 or experts % groups:
        return [f"moe_router_num_groups ({groups}) must divide num_moe_experts ({experts}): {_divisors(experts)}"]
    topk = config.moe_router_topk
    if not 1 <= group_topk <= groups:
        return [f"moe_router_group_topk ({group_topk}) must be between 1 and moe_router_num_groups ({groups})"]
    if topk < group_topk or topk > group_topk * (experts // groups):
        return [f"moe_router_topk ({topk}) must be between moe_router_group_topk ({group_topk}) and the "
                f"{group_topk * (experts // groups)} experts of the chosen groups"]
    return []
