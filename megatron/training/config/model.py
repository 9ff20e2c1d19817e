"""The model's flags: shape ("network size"), initialisation and kernel fusion, as in Megatron-LM's groups.

Megatron's defaults for the widths left unset:

    ffn_hidden_size = 4h, or int(4h * 2/3 / 64) * 64 with SwiGLU (two fc1 halves, about the same params)
    kv_channels     = h / heads
"""

import argparse
from dataclasses import dataclass

from megatron.core.model_parallel_config import legal_sizes
from megatron.training.config.fields import Section, flag


def parse_int_tuple(text):
    """Megatron-LM's tuple flags: "(4096, 0)" or "4096,0" -> (4096, 0)."""
    if text is None or isinstance(text, tuple):
        return text
    try:
        return tuple(int(part) for part in str(text).strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tuple of integers such as \"(4096, 0)\"") from None


@dataclass(kw_only=True)
class NetworkSizeConfig(Section):
    """Shape of the transformer: layers, widths, heads, positions, norms, activations and biases."""

    TITLE = "network size"

    num_layers: int | None = None
    """Number of transformer layers."""

    encoder_num_layers: int | None = None
    """Number of encoder layers (T5); exclusive with --num-layers."""

    decoder_num_layers: int | None = None
    """Number of decoder layers (T5)."""

    hidden_size: int | None = None
    """Transformer hidden size."""

    ffn_hidden_size: int | None = None
    """MLP hidden size. Default 4 * hidden-size, or int(8 * hidden-size / 3 / 64) * 64 with --swiglu."""

    num_attention_heads: int | None = None
    """Number of attention heads."""

    attention_backend: str = flag("auto", choices=("flash", "fused", "unfused", "local", "auto"))
    """Attention kernel: flash, fused (cuDNN/efficient), unfused (plain PyTorch), local, or auto (fastest
    available)."""

    kv_channels: int | None = None
    """Per-head projection size. Default hidden-size / num-attention-heads."""

    group_query_attention: bool = False
    """Use grouped-query attention. --num-query-groups is ignored without this flag."""

    num_query_groups: int = 1
    """Number of key/value heads with --group-query-attention."""

    max_position_embeddings: int | None = None
    """Size of the position-embedding table; must be >= --seq-length."""

    position_embedding_type: str = flag("learned_absolute",
                                        choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none"))
    """Position embedding type."""

    rotary_base: int = 10000
    """Base of the rotary embedding frequencies."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that is rotated (partial rotary)."""

    rotary_interleaved: bool = False
    """Rotate interleaved channel pairs instead of the two halves (rotate-half, HF Llama)."""

    rotary_seq_len_interpolation_factor: int | None = None
    """Divide rotary positions by this factor (linear position interpolation)."""

    use_rope_scaling: bool = False
    """Apply Llama-3.1 style RoPE scaling."""

    rope_scaling_factor: float = 8.0
    """Llama-3.1 RoPE scaling factor."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this value times the tensor-parallel size."""

    normalization: str = flag("LayerNorm", choices=("LayerNorm", "RMSNorm"))
    """Normalisation layer."""

    layernorm_epsilon: float = flag(1e-5, names=("--norm-epsilon",))
    """Epsilon of LayerNorm / RMSNorm."""

    layernorm_zero_centered_gamma: bool = flag(False, names=("--apply-layernorm-1p",))
    """Zero-centred LayerNorm gamma: the stored weight is gamma - 1."""

    qk_layernorm: bool = False
    """Normalise queries and keys per head."""

    attention_output_gate: bool = False
    """Multiply softmax attention's output by sigmoid of a learned per-head gate (a second query-sized
    projection of the layer input), as Qwen3-Next."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual after the layer norm (original BERT ordering)."""

    openai_gelu: bool = False
    """Use the tanh approximation of GeLU."""

    squared_relu: bool = False
    """Use squared ReLU instead of GeLU."""

    swiglu: bool = False
    """Use a SiLU gated linear unit (fc1 is doubled)."""

    quick_geglu: bool = False
    """Use a quick-GeLU gated linear unit."""

    add_bias_linear: bool = flag(True, names=("--disable-bias-linear",))
    """Remove the bias of every linear layer."""

    add_qkv_bias: bool = False
    """Keep a bias on the QKV projection only."""

    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of the input embedding."""

    bert_binary_head: bool = flag(True, names=("--bert-no-binary-head",))
    """Disable the BERT next-sentence (binary) head."""

    window_size: tuple | None = flag(None, type=parse_int_tuple)
    """Sliding-window attention "(left, right)": each query attends the left keys before it and the right
    keys after it (-1: unbounded; causal attention has none after), e.g. "(4096, 0)"."""

    transformer_impl: str = flag("transformer_engine", choices=("local", "transformer_engine", "inference_optimized"))
    """Layer implementation (Megatron-LM's default, transformer_engine). Both run this framework's own PyTorch
    layers, the same model; with transformer_engine one line says so."""

    spec: list[str] | None = flag(None, nargs="*")
    """<module> <function> returning a custom layer spec, or 'local'."""

    @property
    def layers(self) -> int | None:
        """--num-layers, or --encoder-num-layers when only that is given (T5)."""
        return self.num_layers if self.num_layers is not None else self.encoder_num_layers

    def layer_flags_conflict(self) -> bool:
        return None not in (self.num_layers, self.encoder_num_layers) and self.num_layers != self.encoder_num_layers

    def size_problems(self) -> list[str]:
        """The required sizes that are missing or not positive (the widths are derived only without these)."""
        problems = []
        for flag_name, value in (("--num-layers", self.layers), ("--hidden-size", self.hidden_size),
                                 ("--num-attention-heads", self.num_attention_heads),
                                 ("--max-position-embeddings", self.max_position_embeddings)):
            if value is None:
                problems.append(f"{flag_name} is required")
            elif value < 1:
                problems.append(f"{flag_name} {value} must be positive")
        return problems

    def default_ffn_hidden_size(self) -> int:
        """Megatron's MLP width for an unset --ffn-hidden-size (module docstring)."""
        h = self.hidden_size
        return int((4 * h * 2 / 3) / 64) * 64 if self.swiglu else 4 * h

    def default_kv_channels(self) -> int | None:
        """h / heads for an unset --kv-channels; None when the heads do not divide h."""
        h, heads = self.hidden_size, self.num_attention_heads
        return None if h % heads else h // heads

    def derived(self) -> dict:
        values = {}
        if not self.layer_flags_conflict():
            values["num_layers"] = values["encoder_num_layers"] = self.layers
        if not self.size_problems():
            if self.ffn_hidden_size is None:
                values["ffn_hidden_size"] = self.default_ffn_hidden_size()
            if self.kv_channels is None and self.default_kv_channels() is not None:
                values["kv_channels"] = self.default_kv_channels()
        if self.add_bias_linear:
            values["add_qkv_bias"] = True  # with biases on, the QKV bias is on too (Megatron keeps them in sync)
        return values

    def validate(self) -> list[str]:
        problems = []
        if self.layer_flags_conflict():
            problems.append(f"give --num-layers or --encoder-num-layers, not both (got {self.num_layers} and "
                            f"{self.encoder_num_layers})")
        size_problems = self.size_problems()
        problems += size_problems
        h, heads = self.hidden_size, self.num_attention_heads
        if not size_problems and self.ffn_hidden_size is None and self.swiglu and self.default_ffn_hidden_size() == 0:
            problems.append(f"--swiglu's default --ffn-hidden-size int(8 x {h} / 3 / 64) x 64 is 0 for "
                            f"--hidden-size {h}; pass --ffn-hidden-size")
        if not size_problems and self.kv_channels is None and self.default_kv_channels() is None:
            problems.append(f"--hidden-size {h} is not divisible by --num-attention-heads {heads} "
                            f"({h / heads:.2f} per head); pass --kv-channels or use a head count in "
                            f"{legal_sizes(h)}")
        activations = [flag_name for flag_name, on in (("--swiglu", self.swiglu), ("--squared-relu", self.squared_relu),
                                                       ("--quick-geglu", self.quick_geglu)) if on]
        if len(activations) > 1:
            problems.append(f"choose one activation: {' and '.join(activations)} were both given")
        if self.window_size is not None and (len(self.window_size) != 2 or min(self.window_size) < -1):
            problems.append(f"--window-size {self.window_size} must be two numbers (left, right), -1 for unbounded")
        if not 0.0 < self.rotary_percent <= 1.0:
            problems.append(f"--rotary-percent {self.rotary_percent} must be in (0, 1]")
        return problems


@dataclass(kw_only=True)
class InitializationConfig(Section):
    """Seeds and the weight initialisation."""

    TITLE = "initialization"

    seed: int = 1234
    """Seed for python, numpy and torch."""

    data_parallel_random_init: bool = False
    """Initialise parameters differently on each data-parallel rank."""

    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 * num-layers)."""

    embedding_init_method_std: float | None = None
    """Std of the embedding init (default: --init-method-std)."""

    init_method_xavier_uniform: bool = False
    """Use Xavier-uniform init."""


@dataclass(kw_only=True)
class MupConfig(Section):
    """muP, maximal update parametrization (megatron/core/transformer/mup.py): hyperparameters tuned on a proxy
    of width --mup-base-hidden-size transfer to this width, m = --hidden-size / --mup-base-hidden-size."""

    TITLE = "mup"

    use_mup: bool = False
    """Hidden weights init with std / sqrt(m), output projections std / sqrt(2 L m); attention scores scaled
    1/d_head (see --mup-attn-scale-power); logits times --mup-output-mult; Adam: the weight matrices' LR and
    epsilon / m (SGD: the vector-like params' LR x m)."""

    mup_width_mult: float = 1.0
    """Megatron-LM: m itself, which --use-mup computes from the sizes instead."""

    mup_base_hidden_size: int | None = None
    """Hidden size of the proxy model (default --hidden-size: m = 1)."""

    mup_embedding_mult: float = 1.0
    """Multiplier of the embedding output under --use-mup."""

    mup_output_mult: float = 1.0
    """Multiplier of the logits under --use-mup; 1.0 means 1/m."""

    mup_base_head_dim: float | None = None
    """Attention scale sqrt(this) / kv-channels^power under --use-mup (the standard scale at this head width);
    default 1 / kv-channels^power."""

    mup_attn_scale_power: float = 1.0
    """The power of kv-channels in the --use-mup attention scale: 1.0 (muP), 0.5 (standard)."""


@dataclass(kw_only=True)
class KernelFusionConfig(Section):
    """Fused kernels, torch.compile and CUDA graphs: the same function computed faster."""

    TITLE = "kernel fusion"

    masked_softmax_fusion: bool = flag(True, names=("--no-masked-softmax-fusion",))
    """Disable the fused scale + mask + softmax kernel."""

    bias_gelu_fusion: bool = flag(True, names=("--no-bias-gelu-fusion",))
    """Disable the fused bias + GeLU kernel."""

    bias_swiglu_fusion: bool = flag(True, names=("--no-bias-swiglu-fusion",))
    """Disable the fused bias + SwiGLU kernel."""

    bias_dropout_fusion: bool = flag(True, names=("--no-bias-dropout-fusion",))
    """Disable the fused bias + dropout + add kernel."""

    apply_rope_fusion: bool = flag(True, names=("--no-rope-fusion",))
    """Disable the fused rotary-embedding kernel."""

    no_persist_layer_norm: bool = False
    """Disable the persistent fused layer-norm kernel."""

    cross_entropy_loss_fusion: bool = False
    """Use the fused cross-entropy kernel."""

    cross_entropy_fusion_impl: str = flag("native", choices=("native", "te"))
    """Fused cross entropy of --cross-entropy-loss-fusion: native (Megatron-Core's) or te (Transformer
    Engine's); both are this framework's fused kernel here."""

    deterministic_mode: bool = False
    """Bit-exact reproducible runs: deterministic kernels only (torch.use_deterministic_algorithms), the
    library variables NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG=:4096:8
    unless set; slower."""

    use_transformer_engine_op_fuser: bool = False
    """Megatron-LM: build the layers with Transformer Engine's operation fuser. Transformer Engine is not
    used here."""

    use_torch_compile: bool = False
    """Compile each transformer layer's training step with torch.compile on CUDA."""

    cuda_graph_impl: str = flag("none", choices=("none", "local", "transformer_engine", "full_iteration"))
    """full_iteration: replay each training iteration's forward and backward passes from one CUDA graph (one
    GPU; see the README's performance section). local and transformer_engine (per-layer graphs) are not built
    yet."""

    cuda_graph_warmup_steps: int = 3
    """Eager iterations before the CUDA graph is captured."""

    cuda_graph_modules: list[str] = flag(default_factory=list, nargs="+")
    """Parts of each layer captured by per-layer CUDA graphs (not built yet; must be empty with
    --cuda-graph-impl full_iteration)."""

    def validate(self) -> list[str]:
        problems = []
        if self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "te":
            problems.append("Transformer Engine's cross entropy (--cross-entropy-fusion-impl te) is disabled in "
                            "Megatron-LM for stability issues: use --cross-entropy-fusion-impl native, or drop "
                            "--cross-entropy-loss-fusion")
        return problems + self._cuda_graph_problems()

    def _cuda_graph_problems(self) -> list[str]:
        if self.cuda_graph_impl in ("local", "transformer_engine"):
            return [f"--cuda-graph-impl {self.cuda_graph_impl}: per-layer CUDA graphs are not supported yet; use "
                    "--cuda-graph-impl full_iteration (one graph for the whole forward and backward pass)"]
        if self.cuda_graph_impl == "none" and self.cuda_graph_modules:
            return [f"--cuda-graph-modules {' '.join(self.cuda_graph_modules)}: per-layer CUDA graphs (--cuda-graph-impl "
                    "local or transformer_engine) are not supported yet"]
        if self.cuda_graph_impl != "full_iteration":
            return []
        problems = []
        if self.cuda_graph_modules:
            problems.append(f"--cuda-graph-modules {' '.join(self.cuda_graph_modules)} must be empty with "
                            "--cuda-graph-impl full_iteration (it captures the whole iteration)")
        if self.cuda_graph_warmup_steps < 1:
            problems.append(f"--cuda-graph-warmup-steps {self.cuda_graph_warmup_steps} must be at least 1")
        return problems
