"""convert.py saver `hf`: a Hugging Face model directory that `transformers` loads.

LayerNorm + learned positions -> GPT2LMHeadModel (gpt2_hf.py); RMSNorm + RoPE + SwiGLU ->
LlamaForCausalLM, Qwen2ForCausalLM or MixtralForCausalLM (llama_hf.py), with --qk-layernorm and experts
Qwen3MoeForCausalLM (qwen3_moe_hf.py), with --multi-latent-attention DeepseekV3ForCausalLM
(deepseek_v3_hf.py): the first family that can express the model. config.json's vocab_size is the
tokenizer's, the padded rows are dropped, and the tokenizer files the checkpoint's arguments name are copied
under the names `transformers` looks for.
"""

from megatron.training.checkpointing.conversion.deepseek_v3_hf import (
    deepseek_v3_config,
    deepseek_v3_export_problems,
    megatron_to_deepseek_v3,
)
from megatron.training.checkpointing.conversion.gpt2_hf import gpt2_config, gpt2_export_problems, megatron_to_gpt2
from megatron.training.checkpointing.conversion.hf_directory import DEFAULT_MAX_SHARD_BYTES, write_hf_directory
from megatron.training.checkpointing.conversion.llama_hf import llama_config, llama_export_problems, megatron_to_llama
from megatron.training.checkpointing.conversion.messages import messages_to_state
from megatron.training.checkpointing.conversion.qwen3_moe_hf import (
    megatron_to_qwen3_moe,
    qwen3_moe_config,
    qwen3_moe_export_problems,
)

# (class, what it cannot express, state dict map, config.json), tried in order.
_FAMILIES = (
    ("GPT2LMHeadModel", gpt2_export_problems, megatron_to_gpt2, gpt2_config),
    ("LlamaForCausalLM", llama_export_problems, megatron_to_llama, llama_config),
    ("Qwen3MoeForCausalLM", qwen3_moe_export_problems, megatron_to_qwen3_moe, qwen3_moe_config),
    ("DeepseekV3ForCausalLM", deepseek_v3_export_problems, megatron_to_deepseek_v3, deepseek_v3_config),
)


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="hf saver (Hugging Face directories)")
    group.add_argument("--max-shard-size", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                       help="bytes per safetensors file; larger models are sharded with model.safetensors.index.json")


def export_hf(save_dir: str, state: dict, metadata, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Writes the Hugging Face directory of a full GPTModel state dict; returns its config.json."""
    shape, tokenizer = metadata.shape, metadata.tokenizer
    refusals = []
    for name, problems_of, to_hf, config_of in _FAMILIES:
        problems = problems_of(shape)
        if not problems:
            hf_state, config = to_hf(state, shape), config_of(shape, tokenizer.bos_token_id, tokenizer.eos_token_id)
            break
        refusals.append(f"as {name}: " + "; ".join(problems))
    else:
        raise ValueError("this GPT has no Hugging Face counterpart here:\n  " + "\n  ".join(refusals))
    tokenizer_config = None
    if tokenizer.tokenizer_class and tokenizer.files:
        tokenizer_config = {"tokenizer_class": tokenizer.tokenizer_class,
                            "model_max_length": shape.max_position_embeddings}
    write_hf_directory(save_dir, hf_state, config, tokenizer.files, tokenizer_config, max_shard_bytes)
    return config


def save_checkpoint(queue, args) -> None:
    metadata = queue.get()
    if metadata == "exit":
        raise RuntimeError("the loader failed before sending metadata")
    state = messages_to_state(queue.get, metadata, args.checking)
    config = export_hf(args.save_dir, state, metadata, args.max_shard_size)
    print(f" exported {config['architectures'][0]} to {args.save_dir}", flush=True)
