"""convert.py loader `core`: a torch-format GPT checkpoint (this project's or Megatron-LM's), any TP x PP.

Sends the metadata and the full, unsharded model (messages.py). The tokenizer's true vocabulary size
comes from --true-vocab-size, else from building the tokenizer the checkpoint's arguments name.
"""

from megatron.training.checkpointing.conversion.gpt_shape import gpt_shape_from_args
from megatron.training.checkpointing.conversion.messages import metadata_from_args, state_to_messages
from megatron.training.checkpointing.conversion.tokenizer_info import tokenizer_info
from megatron.training.checkpointing.conversion.torch_checkpoint import read_torch_checkpoint


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="core loader (torch-format checkpoints)")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="the tokenizer's vocabulary size without padding (default: build the tokenizer the "
                            "checkpoint's arguments name and ask it)")
    group.add_argument("--ckpt-step", type=int, default=None,
                       help="the iteration to convert (default: the one latest_checkpointed_iteration.txt names)")
    group.add_argument("--loader-transformer-impl", default="local", choices=["local"],
                       help="parameter names of the checkpoint (Transformer Engine names are not supported yet)")


def _check_model_type(state: dict, model_type: str, load_dir: str) -> None:
    if model_type != "GPT":
        raise ValueError(f"--model-type {model_type}: the core loader converts GPT checkpoints only so far")
    te_names = sorted(key for key in state if key.endswith((".layer_norm_weight", ".layer_norm_bias")))
    if te_names:
        raise ValueError(f"{load_dir} holds Transformer Engine parameter names ({te_names[0]}, ...: layer norms fused "
                         "into the next linear layer), which the conversion does not read yet")
    if any(key.startswith("encoder.") for key in state) or "lm_head.dense.weight" in state:
        raise ValueError(f"--model-type GPT but {load_dir} holds a BERT checkpoint (encoder.* / lm_head keys); "
                         "export BERT with tools/checkpoint/export_bert_hf.py")


def load_checkpoint(queue, args) -> None:
    state, checkpoint_args, iteration, release = read_torch_checkpoint(args.load_dir, args.ckpt_step)
    _check_model_type(state, args.model_type, args.load_dir)
    tokenizer = tokenizer_info(checkpoint_args, args.true_vocab_size)
    shape = gpt_shape_from_args(checkpoint_args, tokenizer.vocab_size)
    metadata = metadata_from_args(checkpoint_args, shape, iteration, release)
    metadata.tokenizer = tokenizer
    queue.put(metadata)
    for message in state_to_messages(state, shape):
        queue.put(message)
    queue.put("done")
