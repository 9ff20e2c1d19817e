"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2), as Megatron-Core builds it.

With D = mtp_num_layers depths on the last stage, h_0 [s, b, h] the decoder's output (after its final norm)
and t the input tokens, depth k = 1 .. D computes

    t_k  = t shifted left by k (the last k positions hold 0)
    h_k  = final_layernorm_k(layer_k(eh_proj_k([enorm_k(embedding(t_k)); hnorm_k(h_{k-1})])))

where embedding and output layer are the model's own and layer_k is a transformer layer of the decoder's
last layer's kind (MoE in DeepSeek-V3). Position i of h_k predicts token i + k + 1: its loss is the cross
entropy of output_layer(h_k) against the labels shifted left by k, with the loss mask shifted alike. The
language-model loss is unchanged; each depth's token-mean loss, times mtp_loss_scaling_factor / D, adds its
gradient through `MoEAuxLossAutoScaler` (the backward scale of the main loss), and is logged as "mtp_k loss"
("mtp_1 loss" ...), Megatron-LM's names.

State-dict keys: `mtp.layers.{k-1}.enorm.weight`, `.hnorm.weight`, `.eh_proj.weight` [h, 2h] (column-parallel:
split over TP by output rows), `.mtp_model_layer.<transformer layer keys>`, `.final_layernorm.weight`.
Sequence parallelism: the concatenation is [s/p, b, 2h]; eh_proj gathers the sequence, its output is gathered
over the TP ranks and split along the sequence again.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.pipeline_layer_split import get_transformer_layer_offset
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

_LOSSES: dict = {}  # "mtp_k loss" -> this step's sum over microbatches of the token-mean loss of depth k


def roll_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """[..., s] -> the same shifted left by one along the last dimension, 0 in the last position."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled


@dataclass
class MultiTokenPredictionLayerSubmodules:
    """Module slots of one depth (Megatron-Core's names)."""

    enorm: Any = None
    hnorm: Any = None
    eh_proj: Any = None
    mtp_model_layer: Any = None
    layer_norm: Any = None


class MultiTokenPredictionLayer(MegatronModule):
    """Depth k: (h_{k-1} [s(/p), b, h], shifted tokens) -> h_k (module docstring)."""

    def __init__(self, config: TransformerConfig, submodules: MultiTokenPredictionLayerSubmodules, layer_number: int,
                 vp_stage: int | None = None):
        super().__init__(config)
        norm = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.enorm = build_module(submodules.enorm, **norm)
        self.hnorm = build_module(submodules.hnorm, **norm)
        self.eh_proj = build_module(
            submodules.eh_proj, 2 * config.hidden_size, config.hidden_size, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
        )
        # Global 1-based number L + k (the slot of its router losses, after the decoder's L layers);
        # TransformerLayer adds this stage's layer offset itself.
        global_number = config.num_layers + layer_number
        self.mtp_model_layer = build_module(
            submodules.mtp_model_layer, config=config, vp_stage=vp_stage,
            layer_number=global_number - get_transformer_layer_offset(config, vp_stage),
        )
        self.final_layernorm = build_module(submodules.layer_norm, **norm)

    def forward(self, hidden_states, decoder_input, attention_mask, rotary_pos_emb=None):
        """hidden_states h_{k-1} and decoder_input embedding(t_k), both [s(/p), b, h] -> h_k."""
        combined = torch.cat([self.enorm(decoder_input), self.hnorm(hidden_states)], dim=-1)
        hidden_states, _ = self.eh_proj(combined)  # [s, b, h/p]
        hidden_states = gather_from_tensor_model_parallel_region(hidden_states)
        if self.config.sequence_parallel:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states)
        hidden_states, _ = self.mtp_model_layer(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb)
        return self.final_layernorm(hidden_states)


class MultiTokenPredictionBlock(MegatronModule):
    """The D depths (`layers.0 ...`): returns [h_0; h_1; ...; h_D] concatenated along the sequence."""

    def __init__(self, config: TransformerConfig, spec: ModuleSpec, vp_stage: int | None = None):
        super().__init__(config)
        self.layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=depth + 1, vp_stage=vp_stage)
            for depth in range(config.mtp_num_layers)
        )

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, embedding, rotary_pos_emb=None):
        outputs = [hidden_states]
        for layer in self.layers:
            input_ids, position_ids = roll_tensor(input_ids), roll_tensor(position_ids)
            hidden_states = layer(hidden_states, embedding(input_ids=input_ids, position_ids=position_ids),
                                  attention_mask, rotary_pos_emb)
            outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)


def get_mtp_layer_spec(transformer_layer_spec: ModuleSpec, norm: Any) -> ModuleSpec:
    """One depth: norms `norm`, a column-parallel eh_proj, and a transformer layer of `transformer_layer_spec`."""
    return ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=transformer_layer_spec,
            layer_norm=norm,
        ),
    )


def process_mtp_loss(hidden_states, labels, loss_mask, output_logits, compute_loss, config, training: bool):
    """[h_0; ...; h_D] -> h_0 with each depth's loss attached (module docstring).

    `output_logits(h)` is the output layer, `compute_loss(labels, logits)` the per-token loss [b, s];
    labels and loss_mask are [b, s] (a missing mask counts every token). With `calculate_per_token_loss` the
    loss is the masked sum, rescaled by (loss tokens / this depth's loss tokens), as Megatron-LM does; the
    schedule then divides every gradient by the global token count."""
    chunks = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    main = chunks[0]
    if labels is None:
        return main
    loss_mask = torch.ones_like(labels, dtype=torch.float) if loss_mask is None else loss_mask.float()
    all_tokens = loss_mask.sum()
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for depth, chunk in enumerate(chunks[1:], start=1):
        labels, loss_mask = roll_tensor(labels), roll_tensor(loss_mask)
        num_tokens = loss_mask.sum().clamp(min=1)
        loss_sum = (compute_loss(labels, output_logits(chunk)) * loss_mask).sum()
        if training:
            name = f"mtp_{depth} loss"
            _LOSSES[name] = _LOSSES.get(name, 0.0) + (loss_sum / num_tokens).detach()
        if config.calculate_per_token_loss:
            main = MoEAuxLossAutoScaler.apply(main, scale * loss_sum * (all_tokens / num_tokens))
        else:
            main = MoEAuxLossAutoScaler.apply(main, scale * loss_sum / num_tokens)
    return main


def mtp_losses_for_logging(num_depths: int, loss_scale: float) -> dict:
    """{"mtp_k loss": this step's loss of depth k * loss_scale}, summed over the pipeline stages (only the last
    computes them) and averaged over the data x context parallel ranks; clears the sums. Collective: every
    rank calls it after the step. `loss_scale` is 1 / num_microbatches."""
    device = parallel_state.collective_device()
    values = torch.stack([torch.as_tensor(_LOSSES.get(f"mtp_{depth} loss", 0.0), dtype=torch.float, device=device)
                          for depth in range(1, num_depths + 1)])
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(values, group=group)
        values /= dist.get_world_size(group)
    _LOSSES.clear()
    return {f"mtp_{depth} loss": values[depth - 1] * loss_scale for depth in range(1, num_depths + 1)}
