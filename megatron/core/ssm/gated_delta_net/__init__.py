"""Gated DeltaNet linear attention (Qwen3-Next): the layer (gdn.py) and the chunked delta rule (delta_rule.py)."""

from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet, GatedDeltaNetSubmodules

__all__ = ["GatedDeltaNet", "GatedDeltaNetSubmodules"]
