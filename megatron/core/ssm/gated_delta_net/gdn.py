"""`GatedDeltaNet`: the linear-attention layer of Qwen3-Next (`--experimental-attention-variant gated_delta_net`).

[s, b, h] -> ([s, b, h], None), in Megatron-Core's layout and parameter names:

    in_proj   column-parallel h -> [q; k; v; z; beta; alpha] of sizes (nk dk, nk dk, nv dv, nv dv, nv, nv)
    conv1d    causal depthwise convolution (kernel K) over the q, k, v channels, then the activation
    q, k      per head L2-normalised; each key head serves nv / nk value heads (like grouped-query attention)
    g         -exp(A_log) softplus(alpha + dt_bias)      per value head, the state's log-decay (fp32)
    beta      sigmoid(beta)                             per value head, the write strength
    o         the gated delta rule of q, k, v, g, beta (delta_rule.py), per value head [dv]
    y         out_norm(o) * act(z)                      out_norm over each head's dv channels
    out_proj  row-parallel nv dv -> h

(act is the model's activation function: SiLU with --swiglu, as Qwen3-Next.) Defaults as in Megatron-Core:
no biases, A = exp(A_log) drawn uniformly from [1, 16], dt_bias 1, conv1d as PyTorch initialises a Conv1d
(uniform in +-1/sqrt(K)).

Tensor parallelism splits the heads: rank r of p holds nk/p key and nv/p value heads, so in_proj holds r's
part of each of the six blocks (`stride` = the block sizes: with `use_cpu_initialization` the full weight is
the same whatever p), conv1d r's part of its q, k, v channels, A_log and dt_bias r's nv/p heads. Sequence
parallelism gathers the sequence in in_proj and scatters it in out_proj. out_norm is applied to every
rank's own heads, so its gradient is summed over TP (`sequence_parallel` on its params). The layer ignores
the attention mask (as Megatron-Core's, without packed sequences): it is causal by construction.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.ssm.gated_delta_net.delta_rule import causal_depthwise_conv1d, chunk_gated_delta_rule, l2norm
from megatron.core.tensor_parallel.layers import initialize_affine_weight, parameter_device
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class GatedDeltaNetSubmodules:
    """Module slots of `GatedDeltaNet`: the input projection, the per-head output norm, the output projection."""

    in_proj: Any = IdentityOp
    out_norm: Any = IdentityOp
    out_proj: Any = IdentityOp


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet linear attention (module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: float | None = None,
        use_qk_l2norm: bool = True,
        A_init_range: tuple[float, float] = (1, 16),
        pg_collection=None,
    ):
        super().__init__(config)
        reject_unsupported("GatedDeltaNet", pg_collection=pg_collection is not None)
        if not 0 <= A_init_range[0] <= A_init_range[1]:
            raise ValueError(f"GatedDeltaNet: A_init_range {A_init_range} must be 0 <= low <= high")
        self.layer_number, self.use_qk_l2norm, self.act_fn = layer_number, use_qk_l2norm, config.activation_func
        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        qk_dim, v_dim, nv = self.key_head_dim * self.num_key_heads, self.value_head_dim * self.num_value_heads, self.num_value_heads
        # Global block sizes of the fused projection and of the convolved channels; local = global / tp.
        self.in_proj_sections = (qk_dim, qk_dim, v_dim, v_dim, nv, nv)
        self.conv_sections = (qk_dim, qk_dim, v_dim)
        self.local_in_proj_sections = tuple(size // tp for size in self.in_proj_sections)

        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, sum(self.in_proj_sections), config=config,
            init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            stride=self.in_proj_sections,
        )
        conv_dim, kernel = sum(self.conv_sections) // tp, config.linear_conv_kernel_dim
        bound = conv_init if conv_init is not None else kernel**-0.5  # PyTorch's Conv1d default: 1/sqrt(fan_in)
        # skip_init: drawn below like the split weights (Conv1d's own init would draw from the default
        # generator by the local size, and so make the later draws depend on the TP size).
        self.conv1d = torch.nn.utils.skip_init(
            torch.nn.Conv1d, conv_dim, conv_dim, kernel, groups=conv_dim, padding=kernel - 1, bias=conv_bias,
            device=parameter_device(config), dtype=config.params_dtype,
        )
        initialize_affine_weight(self.conv1d.weight, (sum(self.conv_sections), 1, kernel), 0,
                                 lambda weight: torch.nn.init.uniform_(weight, -bound, bound), self.conv_sections,
                                 config, rank, tp)
        if conv_bias:
            initialize_affine_weight(self.conv1d.bias, (sum(self.conv_sections),), 0,
                                     lambda weight: torch.nn.init.uniform_(weight, -bound, bound),
                                     self.conv_sections, config, rank, tp)
        self.dt_bias = self._head_parameter(lambda weight: torch.nn.init.ones_(weight), rank, tp)
        low, high = A_init_range
        self.A_log = self._head_parameter(lambda weight: weight.copy_(torch.empty_like(weight).uniform_(low, high).log()),
                                          rank, tp)
        self.out_norm = build_module(
            submodules.out_norm, config=config, hidden_size=self.value_head_dim, eps=config.layernorm_epsilon
        )
        for param in self.out_norm.parameters():  # each TP rank normalises its own heads
            param.sequence_parallel = tp > 1
        self.out_proj = build_module(
            submodules.out_proj, v_dim, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=bias, input_is_parallel=True, skip_bias_add=True,
        )

    def _head_parameter(self, init, rank: int, tp: int) -> torch.nn.Parameter:
        """A [nv / tp] parameter of this rank's value heads, drawn like the split weights."""
        param = torch.nn.Parameter(torch.empty(self.num_value_heads // tp, dtype=self.config.params_dtype,
                                               device=parameter_device(self.config)))
        initialize_affine_weight(param, (self.num_value_heads,), 0, init, 1, self.config, rank, tp)
        return param

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, rotary_pos_emb=None,
                inference_context=None, packed_seq_params=None):
        """hidden_states [s, b, h] (or [s/p, b, h] with sequence parallelism) -> (output, out_proj bias).
        The mask and the rotary embedding of the attention layers are not used (module docstring)."""
        reject_unsupported("GatedDeltaNet", inference_context=inference_context is not None,
                           packed_seq_params=packed_seq_params is not None)
        projected, _ = self.in_proj(hidden_states)  # [s, b, in_proj / p]
        projected = projected.transpose(0, 1)  # [b, s, .]
        batch, length = projected.shape[:2]
        q, k, v, gate, beta, alpha = torch.split(projected, self.local_in_proj_sections, dim=-1)
        qkv = causal_depthwise_conv1d(torch.cat([q, k, v], dim=-1), self.conv1d.weight, self.conv1d.bias, self.act_fn)
        q, k, v = torch.split(qkv, self.local_in_proj_sections[:3], dim=-1)
        q, k = (x.reshape(batch, length, -1, self.key_head_dim) for x in (q, k))
        v = v.reshape(batch, length, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        out = chunk_gated_delta_rule(q, k, v, g, beta.sigmoid())  # [b, s, nv / p, dv]
        gate = gate.reshape(batch, length, -1, self.value_head_dim)
        out = (self.out_norm(out) * self.act_fn(gate.float())).to(out.dtype)
        return self.out_proj(out.flatten(2).transpose(0, 1).contiguous())
