"""`TransformerConfig`: the architecture of a Megatron-Core transformer, validated up front.

Field names and defaults are Megatron-Core's. `__post_init__` fills the derived defaults
(`ffn_hidden_size = 4h`, `kv_channels = h / heads`, `num_query_groups = heads`, the init methods) and
reports every problem it finds in one `ValueError` with the numbers involved.

Activation functions and Megatron's flags: `activation_func=F.gelu` is exact (erf) GELU, but with
`bias_activation_fusion=True` (what `--bias-gelu-fusion`, on by default in Megatron-LM, sets) Megatron's
fused bias-GELU uses the tanh approximation, and so do we; that is Hugging Face GPT-2's `gelu_new`.
`--swiglu` is `gated_linear_unit=True, activation_func=F.silu`; `--squared-relu` is
`activation_func=megatron.core.activations.squared_relu`.
"""

import math
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch.nn.functional as F

from megatron.core.fp8.recipe import fp8_config_problems
from megatron.core.model_parallel_config import ModelParallelConfig, raise_config_problems
from megatron.core.transformer.config_rules import (
    linear_attention_problems,
    recompute_layer_problems,
    recompute_module_problems,
    tensor_parallel_split_problems,
)
from megatron.core.transformer.context_parallel.context_parallel_attention import cp_comm_type_problems
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.activation_offload import offload_module_problems
from megatron.core.transformer.init_methods import (
    init_method_normal,
    mup_scaled_init_method_normal,
    scaled_init_method_normal,
)
from megatron.core.transformer.moe.moe_config_checks import moe_config_problems
from megatron.core.transformer.mup import apply_mup, mup_problems
from megatron.core.transformer.pipeline_layer_split import pipeline_layer_split_problems
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout, as_layout



@dataclass
class TransformerConfig(ModelParallelConfig):
    """Architecture, initialisation, precision and recompute settings of a transformer."""

    # --- architecture ------------------------------------------------------------------------------------
    num_layers: int = 0
    """Transformer layers in the whole model (all pipeline stages)."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first pipeline stage when it differs from the rest (uneven split)."""

    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pipeline stage when it differs from the rest (uneven split)."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the input embedding as one layer of the first stage when splitting layers over stages."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer of the last stage when splitting layers over stages."""

    pipeline_model_parallel_layout: Optional[Union[str, list, PipelineParallelLayerLayout]] = None
    """Explicit placement of the layers on the (virtual) pipeline stages, e.g. "Et*3|(tt|)*6tmL"
    (pipeline_parallel_layer_layout.py); parsed in `__post_init__`, where it also sets
    `virtual_pipeline_model_parallel_size`."""

    hidden_size: int = 0
    """Width h of the residual stream."""

    num_attention_heads: int = 0
    """Query heads np."""

    num_query_groups: Optional[int] = None
    """Key/value heads ng (grouped-query attention); defaults to `num_attention_heads` (plain MHA)."""

    ffn_hidden_size: Optional[int] = None
    """MLP width f; defaults to 4h (the `--swiglu` 8h/3 rule belongs to the argument parser)."""

    kv_channels: Optional[int] = None
    """Per-head width hn; defaults to h // np."""

    hidden_dropout: float = 0.1
    """Dropout on the embedding output and on each residual branch."""

    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""

    softmax_scale: Optional[float] = None
    """Scale of QK^T; defaults to 1/sqrt(hn)."""

    attention_backend: AttnBackend = AttnBackend.auto
    """Core-attention implementation (see `AttnBackend`); a name such as "flash" is accepted too."""

    cp_comm_type: Optional[str | list] = None
    """How context-parallel attention reaches the other CP ranks' keys/values: "p2p" (ring, the default) or
    "all_gather", for all layers or as a list of one per layer ("a2a", "a2a+p2p" are not supported yet)."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual after the layer norm instead of before it (original BERT ordering)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm (`--norm-epsilon`)."""

    layernorm_zero_centered_gamma: bool = False
    """Store norm weights as w - 1 so they start at 0 (`--apply-layernorm-1p`)."""

    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm"."""

    qk_layernorm: bool = False
    """Normalise each query and key head (with `normalization`) before RoPE."""

    test_mode: bool = False
    """Megatron-LM's real-time self-test (`--test-mode`): every self-attention forward checks that its QK
    norms' params are identical on all data-parallel and tensor-parallel ranks (silent corruption of a
    replica would break that)."""

    add_bias_linear: bool = True
    """Biases on every linear layer (`--disable-bias-linear` turns them off)."""

    add_qkv_bias: bool = False
    """Bias on the QKV projection even when `add_bias_linear` is False (Qwen)."""

    gated_linear_unit: bool = False
    """fc1 produces [gate, up] (2f wide) and the MLP computes act(gate) * up (SwiGLU with F.silu)."""

    activation_func: Callable = F.gelu
    """MLP non-linearity."""

    bias_activation_fusion: bool = False
    """Megatron's fused bias+activation; with F.gelu it computes the tanh-approximated GELU."""

    rotary_interleaved: bool = False
    """Rotate (even, odd) dimension pairs (RoFormer) instead of the two halves (Llama, the default)."""

    apply_query_key_layer_scaling: bool = False
    """Divide QK^T by the layer number before the softmax and multiply back inside it (fp16 range)."""

    attention_softmax_in_fp32: bool = True
    """Compute the unfused attention softmax in fp32 when activations are fp16/bf16."""

    calculate_per_token_loss: bool = False
    """Normalise the loss by the number of tokens in the global batch (read by the schedules)."""

    # --- initialisation ----------------------------------------------------------------------------------
    init_method: Optional[Callable] = None
    """Initialiser of the weights; defaults to N(0, init_method_std^2). Biases start at 0."""

    output_layer_init_method: Optional[Callable] = None
    """Initialiser of `linear_proj` and `linear_fc2`; defaults to N(0, (init_method_std/sqrt(2L))^2)."""

    init_method_std: float = 0.02
    """Standard deviation of the default initialisers."""

    embedding_init_method: Optional[Callable] = None
    """Initialiser of the word, position and token-type embeddings; defaults to N(0, embedding_init_method_std^2)
    when that differs from `init_method_std` (or `init_method` is unset), else to `init_method`."""

    embedding_init_method_std: Optional[float] = None
    """Standard deviation of the default embedding initialiser (default `init_method_std`)."""

    # --- muP, maximal update parametrization (mup.py has the maths) ----------------------------------------
    use_mup: bool = False
    """Scale the init, the attention, the embedding output, the logits and (megatron/core/optimizer) the
    per-parameter learning rates with the width multiplier m = hidden_size / mup_base_hidden_size."""

    mup_width_mult: float = 1.0
    """m; computed from the sizes when `use_mup` is set."""

    mup_base_hidden_size: Optional[int] = None
    """Hidden size of the proxy model the hyperparameters were tuned on (default `hidden_size`: m = 1)."""

    mup_embedding_mult: float = 1.0
    """Multiplier of the embedding output under muP."""

    mup_output_mult: float = 1.0
    """Multiplier of the output logits under muP; left at 1.0 it becomes 1/m."""

    mup_base_head_dim: Optional[float] = None
    """With it, the muP attention scale is sqrt(mup_base_head_dim) / kv_channels^mup_attn_scale_power, which
    equals 1/sqrt(kv_channels) at that head width; without it 1 / kv_channels^mup_attn_scale_power."""

    mup_attn_scale_power: float = 1.0
    """Power of kv_channels in the muP attention scale: 1.0 is muP's 1/d, 0.5 the standard 1/sqrt(d)."""

    # --- kernel choices (same maths either way) ----------------------------------------------------------
    masked_softmax_fusion: bool = False
    """Accepted for compatibility: our attention always uses PyTorch's fused kernels."""

    bias_dropout_fusion: bool = False
    """bias + dropout + residual add as one generated kernel on CUDA (megatron/core/fusions); the same
    function, with dropout masks drawn differently from eager PyTorch's."""

    persist_layer_norm: bool = False
    """Accepted for compatibility: the layer norms are PyTorch's."""

    apply_rope_fusion: bool = False
    """RoPE as one generated kernel on CUDA (megatron/core/fusions/fused_rope.py); the same function."""

    use_torch_compile: bool = False
    """Compile each transformer layer's training forward/backward with `torch.compile` on CUDA
    (`--use-torch-compile`): norms, bias-activations, residual adds and layout copies become generated
    kernels and the per-layer Python overhead goes. The same function as eager."""

    # --- activation recomputation ------------------------------------------------------------------------
    recompute_granularity: Optional[str] = None
    """"full" (recompute whole layers) or "selective" (recompute `recompute_modules` only)."""

    recompute_method: Optional[str] = None
    """For "full": "uniform" (chunks of `recompute_num_layers` layers) or "block" (the first
    `recompute_num_layers` layers of each pipeline stage)."""

    recompute_num_layers: Optional[int] = None
    """Layers per recompute chunk ("uniform") or recomputed layers per stage ("block")."""

    distribute_saved_activations: Optional[bool] = None
    """Split the saved layer inputs over the TP ranks during full recompute."""

    recompute_modules: Optional[list] = None
    """Selective-recompute targets; defaults to ["core_attn"]. Supported: core_attn, mlp (recomputed with
    their activations), layernorm, moe_act, mla_up_proj (outputs dropped after use and recomputed)."""

    # --- fine-grained activation offloading (activation_offload.py) -----------------------------------------
    fine_grained_activation_offloading: bool = False
    """Keep the tensors that the `offload_modules` save for backward in host memory between forward and
    backward (pinned, copied on a side stream on CUDA) instead of device memory."""

    offload_modules: Optional[list] = None
    """Which: attn_norm, qkv_linear, core_attn, attn_proj (needs core_attn), mlp_norm, expert_fc1, moe_act."""

    min_offloaded_tensor_size: int = 1024 * 1024
    """Saved tensors of fewer elements stay on the device."""

    fine_grained_offloading_max_inflight_offloads: Optional[int] = None
    """At most this many of a module's offloads (one per forward call) in flight: the compute stream waits
    for the oldest beyond it; None never waits."""

    activation_offload_fraction: float = 1.0
    """Fraction of the offload groups offloaded (only 1.0 is supported)."""

    delta_offload_bytes_across_pp_ranks: int = 0
    """Bytes fewer offloaded per later pipeline rank (only 0 is supported)."""

    # --- mixture of experts (megatron/core/transformer/moe) ------------------------------------------------
    num_moe_experts: Optional[int] = None
    """Experts per MoE layer; None builds dense MLPs."""

    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE: every N-th layer (N = int, layer 0 included), or one 0/1 entry per layer."""

    moe_ffn_hidden_size: Optional[int] = None
    """Width of each expert's MLP; defaults to `ffn_hidden_size`."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared-expert MLP that every token also goes through (None: no shared expert)."""

    moe_router_topk: int = 2
    """Experts each token is sent to."""

    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    """"aux_loss" (over the micro-batch), "seq_aux_loss" (per sequence) or "none"."""

    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    """Weight of the load-balancing loss coeff * E * sum_i f_i * P_i."""

    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss mean(logsumexp(logits)^2) (None: off)."""

    moe_router_score_function: str = "softmax"
    """"softmax" or "sigmoid" scores of the router logits."""

    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (else softmax over the k chosen logits)."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only, moved by
    `moe_router_bias_update_rate` towards balance after every step (needs the sigmoid score function)."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update: bias_i += rate * sign(mean load - load_i)."""

    moe_router_dtype: Optional[str] = None
    """Accepted for compatibility: the router always computes its logits and scores in fp32."""

    moe_router_num_groups: Optional[int] = None
    """Group-limited routing (DeepSeek-V2/V3): the experts form this many equal groups; each token first picks
    `moe_router_group_topk` groups by the sum of their top-(k / group_topk) scores, then its k experts in them."""

    moe_router_group_topk: Optional[int] = None
    """Groups each token may route to with group-limited routing."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the routing weights of the chosen experts (DeepSeek-V3's routed_scaling_factor, 2.5)."""

    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach the expert-parallel ranks: "allgather" or "alltoall"."""

    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM (`torch._grouped_mm` on GPU), else one GEMM per expert."""

    moe_expert_capacity_factor: Optional[float] = None
    """Token dropping: each expert takes at most ceil(k * tokens / E * factor) of a rank's tokens."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to the capacity (not supported yet)."""

    moe_token_drop_policy: str = "probs"
    """Which tokens an expert over capacity keeps: the highest "probs", or the first by "position"."""

    moe_permute_fusion: bool = False
    """Accepted for compatibility: the token permutation is the same function either way."""

    moe_shared_expert_gate: bool = False
    """Multiply the shared experts' output by sigmoid(x . w) per token, w [1, h] (`shared_experts.gate_weight`)."""

    # --- FP8 training (megatron/core/fp8): the transformer layers' linears through torch._scaled_mm --------
    fp8: Optional[str] = None
    """FP8 GEMMs: "e4m3" (every operand E4M3) or "hybrid" (E4M3 forward, E5M2 output gradients); None: off."""

    fp8_recipe: str = "delayed"
    """"delayed" (scales from an amax history of earlier steps) or "tensorwise" (each tensor's own amax)."""

    fp8_margin: int = 0
    """scale = fp8_max / amax / 2^margin."""

    fp8_interval: int = 1
    """Accepted for compatibility (deprecated in Megatron-Core): scales are updated after every step."""

    fp8_amax_history_len: int = 1
    """Steps of amax history per operand (delayed recipe)."""

    fp8_amax_compute_algo: str = "most_recent"
    """The amax a scale comes from: "most_recent" or the "max" of the history (delayed recipe)."""

    fp8_wgrad: bool = True
    """Weight gradients as FP8 GEMMs too; False computes them in bf16 (`--no-fp8-wgrad`)."""

    fp8_param: bool = False
    """Store the weights of the FP8 GEMMs in FP8, one byte each (`--fp8-param-gather`): the optimizer casts its
    fp32 main params into them and the distributed optimizer all-gathers the bytes (megatron/core/fp8/params.py).
    The model must be trained wrapped in DistributedDataParallel (the weight gradients go into its main_grad)."""

    first_last_layers_bf16: bool = False
    """Keep the first `num_layers_at_start_in_bf16` and last `num_layers_at_end_in_bf16` layers out of FP8."""

    num_layers_at_start_in_bf16: int = 1
    """Leading layers kept in bf16 with `first_last_layers_bf16`."""

    num_layers_at_end_in_bf16: int = 1
    """Trailing layers kept in bf16 with `first_last_layers_bf16`."""

    # --- multi-latent attention and multi-token prediction ---------------------------------------------------
    multi_latent_attention: bool = False
    """DeepSeek multi-latent attention; its dimensions are the fields of `MLATransformerConfig`."""

    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depth D (DeepSeek-V3): D extra layers on the last stage, layer k predicting the
    token k + 1 positions ahead (multi_token_prediction.py)."""

    mtp_loss_scaling_factor: float = 0.1
    """Weight of the mean of the D multi-token-prediction losses added to the language-model loss."""

    # --- linear attention (Gated DeltaNet, megatron/core/ssm) and the attention output gate -----------------
    experimental_attention_variant: Optional[str] = None
    """"gdn" (or Megatron-Core's older name "gated_delta_net", turned into "gdn"): Gated DeltaNet linear
    attention on the layers `linear_attention_freq` picks; "gdn2" and "dsa" are not supported yet."""

    linear_attention_freq: Optional[Union[int, List[int]]] = None
    """N: every N-th layer (N, 2N, ... counting from 1) keeps softmax attention, the others are linear; or one
    entry per layer, 1 = linear attention, 0 = softmax attention."""

    linear_conv_kernel_dim: int = 4
    """Width of Gated DeltaNet's causal convolution over q, k, v."""

    linear_key_head_dim: int = 128
    """Gated DeltaNet query/key head width."""

    linear_value_head_dim: int = 128
    """Gated DeltaNet value (and output gate) head width."""

    linear_num_key_heads: int = 16
    """Gated DeltaNet query/key heads."""

    linear_num_value_heads: int = 32
    """Gated DeltaNet value heads (a multiple of the key heads)."""

    attention_output_gate: bool = False
    """Softmax attention's output is multiplied by sigmoid(gate) per channel, the gate a second query-sized
    projection of the layer input (Qwen3-Next); linear_qkv then holds per group [q, gate, k, v]."""

    # --- features that exist in Megatron-Core but not here yet (error when set) ----------------------------

    window_size: Optional[tuple] = None
    """Sliding-window attention (left, right): query i attends keys i + sk - sq - left .. i + sk - sq + right
    (Transformer Engine's convention; -1 is unbounded, and a causal mask also bounds the right side)."""

    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32."""

    def __post_init__(self):
        self._parse_layout()
        problems = self.parallelism_problems()
        size_problems = self._size_problems()
        problems += size_problems
        if not size_problems:  # the GEMM sizes are known
            problems += fp8_config_problems(self)
        problems += self._recompute_problems()
        problems += self._feature_problems()
        problems += self._attention_variant_problems()
        problems += moe_config_problems(self)
        problems += mup_problems(self)
        problems += offload_module_problems(self)
        raise_config_problems("TransformerConfig", problems)
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        if self.use_mup:
            apply_mup(self)
        self._set_init_methods()

    def _set_init_methods(self) -> None:
        """The default initialisers (the embeddings' first: they keep the unscaled std under muP)."""
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None:
            if self.init_method is None or self.embedding_init_method_std != self.init_method_std:
                self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
            else:
                self.embedding_init_method = self.init_method
        width = self.mup_width_mult if self.use_mup else 1.0
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std / math.sqrt(width))
        if self.output_layer_init_method is None:
            self.output_layer_init_method = (
                mup_scaled_init_method_normal(self.init_method_std, self.num_layers, width) if self.use_mup
                else scaled_init_method_normal(self.init_method_std, self.num_layers)
            )

    def _parse_layout(self) -> None:
        """Parses `pipeline_model_parallel_layout`; an unset VPP takes the layout's. A layout that does not
        parse stays as given: the layer split check reports why."""
        try:
            layout = as_layout(self.pipeline_model_parallel_layout, self.pipeline_model_parallel_size)
        except (ValueError, ZeroDivisionError):
            return
        self.pipeline_model_parallel_layout = layout
        if layout is not None and self.virtual_pipeline_model_parallel_size is None:
            vpp = layout.virtual_pipeline_model_parallel_size
            self.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None

    def _size_problems(self) -> list[str]:
        problems = []
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if problems:
            return problems
        heads = self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // heads
        if self.kv_channels < 1:
            problems.append(f"kv_channels must be positive, got {self.kv_channels}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        problems += tensor_parallel_split_problems(
            heads, self.num_query_groups, self.ffn_hidden_size, self.tensor_model_parallel_size
        )
        problems += pipeline_layer_split_problems(self)
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                problems.append(f"{name} must be in [0, 1), got {value}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            problems.append(f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}")
        if isinstance(self.attention_backend, str):
            if self.attention_backend not in AttnBackend.__members__:
                problems.append(
                    f"attention_backend {self.attention_backend!r} is not one of {', '.join(AttnBackend.__members__)}"
                )
            else:
                self.attention_backend = AttnBackend[self.attention_backend]
        if self.bias_activation_fusion:
            if self.activation_func not in (F.gelu, F.silu):
                problems.append("bias_activation_fusion=True needs activation_func F.gelu or F.silu (SwiGLU)")
            elif self.activation_func is F.silu and not self.gated_linear_unit:
                problems.append("bias_activation_fusion=True with F.silu needs gated_linear_unit=True (SwiGLU)")
            elif self.activation_func is F.gelu and not self.gated_linear_unit and not self.add_bias_linear:
                problems.append("bias_activation_fusion=True with GELU needs add_bias_linear=True (bias-GELU fusion)")
        return problems

    def _recompute_problems(self) -> list[str]:
        problems = []
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        granularity, method, num = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity is None:
            return problems
        if granularity not in ("full", "selective"):
            return [f"recompute_granularity must be 'full' or 'selective', got {granularity!r}"]
        if method is not None and method not in ("uniform", "block"):
            problems.append(f"recompute_method must be 'uniform' or 'block', got {method!r}")
        problems += recompute_layer_problems(
            granularity, method, num, self.num_layers, self.pipeline_model_parallel_size
        )
        problems += recompute_module_problems(granularity, self.recompute_modules, self)
        if self.distribute_saved_activations:
            problems.append("distribute_saved_activations=True is not supported yet")
        return problems

    def _attention_variant_problems(self) -> list[str]:
        if self.experimental_attention_variant == "gated_delta_net":
            warnings.warn("experimental_attention_variant 'gated_delta_net' is Megatron-Core's deprecated name of "
                          "'gdn'", DeprecationWarning, stacklevel=3)
            self.experimental_attention_variant = "gdn"
        problems = linear_attention_problems(self)
        if self.attention_output_gate and self.multi_latent_attention:
            problems.append("attention_output_gate with multi_latent_attention is not supported yet")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            problems.append("moe_shared_expert_gate needs shared experts (moe_shared_expert_intermediate_size)")
        return problems

    def _feature_problems(self) -> list[str]:
        not_yet = {
            "fp32_residual_connection": self.fp32_residual_connection,
        }
        problems = [f"{name} is not supported yet" for name, is_set in not_yet.items() if is_set]
        if self.multi_latent_attention and not isinstance(self, MLATransformerConfig):
            problems.append("multi_latent_attention=True needs MLATransformerConfig (the latent and head dimensions)")
        if self.window_size is not None:
            if len(self.window_size) != 2 or min(self.window_size) < -1:
                problems.append(f"window_size must be (left, right) with -1 for unbounded, got {self.window_size}")
            if self.context_parallel_size > 1:
                problems.append("window_size (sliding-window attention) with context_parallel_size > 1 is not "
                                "supported yet")
        if self.mtp_num_layers is not None:
            if self.mtp_num_layers < 1:
                problems.append(f"mtp_num_layers must be a positive integer (or None: no multi-token prediction), "
                                f"got {self.mtp_num_layers}")
            if self.context_parallel_size > 1:
                problems.append(f"mtp_num_layers with context_parallel_size={self.context_parallel_size} is not "
                                "supported yet")
        if self.context_parallel_size > 1:
            problems += cp_comm_type_problems(self.cp_comm_type or "p2p", self.num_layers)
        return problems



@dataclass
class MLATransformerConfig(TransformerConfig):
    """TransformerConfig of a multi-latent-attention model (DeepSeek-V2/V3; multi_latent_attention.py has the
    maths). Defaults are Megatron-Core's."""

    multi_latent_attention: bool = True
    q_lora_rank: Optional[int] = 512
    """Rank of the query compression (linear_q_down_proj width); None projects queries directly (linear_q_proj)."""

    kv_lora_rank: int = 512
    """Rank of the joint key/value compression (the latent every head's keys and values come from)."""

    qk_head_dim: int = 128
    """Per-head width of the query/key part without position information."""

    qk_pos_emb_head_dim: int = 64
    """Per-head width of the rotated query/key part (the key's is shared by all heads)."""

    v_head_dim: int = 128
    """Per-head width of the values."""

    normalization: str = "RMSNorm"
    rope_type: str = "yarn"
    """"rope" (plain RoPE with rotary_base / rotary_percent) or "yarn" (YaRN with the fields below)."""

    rotary_base: float = 10000
    rotary_percent: float = 1.0
    rotary_scaling_factor: float = 40
    """YaRN's context-extension factor s (also in the softmax scale, through mscale_all_dim)."""

    original_max_position_embeddings: int = 4096
    """YaRN: the context length the frequencies were trained for."""

    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    correction_range_round_to_int: bool = True
    """YaRN: round the frequency-blend range to whole indices (Hugging Face's `truncate`)."""

    cache_mla_latents: bool = False
    """Cache the compressed latents instead of keys/values in generation (not supported yet)."""

    mla_down_proj_fusion: bool = False
    """Accepted for compatibility: the q/kv down projections compute the same function either way."""

    def __post_init__(self):
        super().__post_init__()
        problems = []
        positive = {"kv_lora_rank": self.kv_lora_rank, "qk_head_dim": self.qk_head_dim,
                    "qk_pos_emb_head_dim": self.qk_pos_emb_head_dim, "v_head_dim": self.v_head_dim}
        if self.q_lora_rank is not None:
            positive["q_lora_rank"] = self.q_lora_rank
        problems += [f"{name} must be a positive integer, got {value!r}" for name, value in positive.items()
                     if not isinstance(value, int) or value < 1]
        if isinstance(self.qk_pos_emb_head_dim, int) and self.qk_pos_emb_head_dim % 2:
            problems.append(f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be even: RoPE rotates pairs")
        if self.rope_type not in ("rope", "yarn"):
            problems.append(f"rope_type must be 'rope' or 'yarn' for multi-latent attention, got {self.rope_type!r}")
        if self.num_query_groups != self.num_attention_heads:
            problems.append(f"multi-latent attention has one key/value head per query head: num_query_groups "
                            f"({self.num_query_groups}) must equal num_attention_heads ({self.num_attention_heads})")
        if self.cache_mla_latents:
            problems.append("cache_mla_latents (latent caching in generation) is not supported yet")
        raise_config_problems("MLATransformerConfig", problems)
