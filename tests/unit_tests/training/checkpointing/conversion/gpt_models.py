"""Tiny GPT-2-, Llama-, Mixtral-, Qwen3-MoE- and DeepSeek-V3-shaped GPTModels built from Megatron command
lines, and torch-format checkpoints of them, for the conversion tests."""

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.checkpointing.conversion.torch_checkpoint import write_torch_checkpoint

TRUE_VOCAB, PADDED_VOCAB, SEQ = 100, 128, 32
COMMON = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
          "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--make-vocab-size-divisible-by", "64"]
GPT2_FLAGS = ["--ffn-hidden-size", "128"]
LLAMA_FLAGS = ["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu",
               "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--rotary-base", "500000"]
# Mixtral-shaped: Llama's attention, 4 SwiGLU experts of width 96 in every layer, top-2 routing.
MIXTRAL_FLAGS = LLAMA_FLAGS + ["--num-experts", "4", "--moe-router-topk", "2"]
# Multi-latent attention (kv latent 16, heads of 12 + 8 rotated query/key and 10 value channels).
_MLA_FLAGS = [
    "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "12", "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "10", "--qk-layernorm",
]
# DeepSeek-V3-shaped: MLA with a query latent and YaRN, one dense layer then MoE layers of 8 sigmoid-routed
# experts in 4 groups (2 groups per token, top-4, x2.5) with an expert bias and a shared expert.
DEEPSEEK_V3_FLAGS = _MLA_FLAGS + [
    "--q-lora-rank", "24", "--rotary-scaling-factor", "4", "--mscale", "0.9", "--mscale-all-dim", "0.7",
    "--yarn-original-max-position-embeddings", "8", "--num-experts", "8", "--moe-layer-freq", "[0]+[1]*3",
    "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "4",
    "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32",
]
# MLA with queries projected directly and plain RoPE, dense MLPs.
DEEPSEEK_V3_DENSE_FLAGS = _MLA_FLAGS + ["--rope-type", "rope"]
# Qwen3-MoE-shaped: Llama's GQA with a head width of 24 (not h / heads) and per-head q/k norms, one dense
# layer then layers of 4 experts, top-2.
QWEN3_MOE_FLAGS = LLAMA_FLAGS + [
    "--kv-channels", "24", "--qk-layernorm", "--norm-epsilon", "1e-6", "--num-experts", "4", "--moe-router-topk",
    "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0]+[1]*3",
]
SHAPES = {"gpt2": GPT2_FLAGS, "llama": LLAMA_FLAGS, "mixtral": MIXTRAL_FLAGS, "deepseek_v3": DEEPSEEK_V3_FLAGS,
          "deepseek_v3_dense": DEEPSEEK_V3_DENSE_FLAGS, "qwen3_moe": QWEN3_MOE_FLAGS}


def model_args(name: str, *flags):
    args = validate_args(parse_args(args_list=[*COMMON, *SHAPES[name], *flags]))
    args.padded_vocab_size = PADDED_VOCAB
    return args


def gpt_model(args, **kwargs) -> GPTModel:
    """The GPTModel of `args` as pretrain_gpt.py's model_provider builds it, for this process's TP (and EP)
    rank; MoE models need torch.distributed and the parallel state (the `single_rank` fixture)."""
    config = core_transformer_config_from_args(args)
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                                        multi_latent_attention=args.multi_latent_attention)
    return GPTModel(
        config, spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base, **kwargs,
    )


def build_model(args, seed: int = 3) -> GPTModel:
    """The GPT of `args` with every weight random and O(1) (norms and biases too), expert biases random and
    positive, in eval mode."""
    torch.manual_seed(seed)
    model = gpt_model(args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm_scale = "layernorm" in name and name.endswith("weight")
            param.copy_(0.2 * torch.randn_like(param) + (1.0 if norm_scale else 0.0))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.05 * torch.rand_like(buffer))
    return model.eval()


def save_model(model: GPTModel, args, save_dir: str, iteration: int = 7) -> None:
    state = {name: tensor for name, tensor in model.state_dict().items() if not name.endswith("_extra_state")}
    write_torch_checkpoint(save_dir, state, args, iteration, tp=1, pp=1)


def logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)
