"""The model's flags: shape ("network size"), initialisation and kernel fusion, as in Megatron-LM's groups."""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag


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

    norm_epsilon: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""

    apply_layernorm_1p: bool = False
    """Zero-centred LayerNorm gamma: the stored weight is gamma - 1."""

    qk_layernorm: bool = False
    """Normalise queries and keys per head."""

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

    transformer_impl: str = flag("local", choices=("local", "transformer_engine", "inference_optimized"))
    """Layer implementation. Megatron's default is transformer_engine; here the default is local (pure
    PyTorch), which needs no extra package."""

    spec: list[str] | None = flag(None, nargs="*")
    """<module> <function> returning a custom layer spec, or 'local'."""


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

    use_torch_compile: bool = False
    """Compile each transformer layer's training step with torch.compile on CUDA."""

    cuda_graph_impl: str = flag("none", choices=("none", "local", "transformer_engine", "full_iteration"))
    """full_iteration: replay each training iteration's forward and backward passes from one CUDA graph (one
    GPU; see the README's performance section). local and transformer_engine (per-layer graphs) are not built
    yet."""

    cuda_graph_warmup_steps: int = 3
    """Eager iterations before the CUDA graph is captured."""

    cuda_graph_modules: list[str] = flag(default_factory=list, nargs="*")
    """Parts of each layer captured by per-layer CUDA graphs (not built yet; must be empty with
    --cuda-graph-impl full_iteration)."""
