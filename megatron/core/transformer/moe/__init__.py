"""Mixture of experts: router, token dispatchers, experts and the MoE layer that replaces the MLP.

    MoELayer(x [s, b, h]):
        probs, routing_map = router(x)                  [T, E] fp32 weights, [T, E] bool (T = s*b tokens)
        tokens, counts = dispatcher.dispatch(x, ...)    this rank's experts' tokens, grouped by expert
        y = experts(tokens, counts)                     one MLP per local expert
        out = dispatcher.combine(y)                     sum_k probs[t, e_k] * expert_{e_k}(x_t), [s, b, h]
        (+ shared_experts(x) when configured)

Kept import-free so that `TransformerConfig` can use `moe_config_checks` without a cycle.
"""
