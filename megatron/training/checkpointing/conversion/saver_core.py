"""convert.py saver `core`: writes a torch-format checkpoint for --target-tensor-parallel-size x
--target-pipeline-parallel-size x --target-expert-parallel-size (Megatron's `saver_core`).

Vocabulary rows are padded (repeating the last row) or trimmed to the padded size of the target TP,
vocab_size_with_padding(true vocab, make_vocab_size_divisible_by, TP); without a known true vocabulary
size they are kept and must divide by the target TP. Optimizer, scheduler and RNG state are not
written: resume with --no-load-optim --no-load-rng, or --finetune.
"""

from megatron.training.checkpointing.conversion.expert_sharding import check_expert_parallel_size
from megatron.training.checkpointing.conversion.messages import messages_to_state
from megatron.training.checkpointing.conversion.pipeline_stages import check_pipeline_parallel_size
from megatron.training.checkpointing.conversion.tensor_parallel_sharding import check_tensor_parallel_size
from megatron.training.checkpointing.conversion.torch_checkpoint import write_torch_checkpoint
from megatron.training.checkpointing.conversion.vocab_padding import resize_vocab_rows
from megatron.core.tokenizers import vocab_size_with_padding

_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="core saver (torch-format checkpoints)")
    group.add_argument("--target-tensor-parallel-size", type=int, default=None,
                       help="TP size of the written checkpoint (default: the source's)")
    group.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                       help="PP size of the written checkpoint (default: the source's)")
    group.add_argument("--target-expert-parallel-size", type=int, default=None,
                       help="EP size of the written checkpoint, a divisor of the experts (default: the source's)")
    group.add_argument("--saver-transformer-impl", default="local", choices=["local"],
                       help="parameter names to write (Transformer Engine names are not supported yet)")


def padded_rows(rows: int, true_vocab_size: int | None, divisible_by: int, tp: int) -> int:
    """The vocabulary rows of the target layout (see the module docstring)."""
    if true_vocab_size is None:
        if rows % tp:
            raise ValueError(f"the checkpoint has {rows} vocabulary rows, which TP {tp} does not divide, and the "
                             "tokenizer's size is unknown: give --true-vocab-size to re-pad the vocabulary")
        return rows
    return vocab_size_with_padding(true_vocab_size, divisible_by, tp)


def save_checkpoint(queue, args) -> None:
    metadata = queue.get()
    if metadata == "exit":
        raise RuntimeError("the loader failed before sending metadata")
    tp = args.target_tensor_parallel_size or metadata.previous_tensor_parallel_size
    pp = args.target_pipeline_parallel_size or metadata.previous_pipeline_parallel_size
    ep = args.target_expert_parallel_size or metadata.previous_expert_parallel_size
    check_tensor_parallel_size(metadata.shape, tp)  # before the weights arrive: fail fast
    check_pipeline_parallel_size(metadata.num_layers, pp)
    check_expert_parallel_size(metadata.num_experts, ep)
    state = messages_to_state(queue.get, metadata, args.checking)
    rows = padded_rows(state[_VOCAB_TENSORS[0]].shape[0], metadata.true_vocab_size,
                       metadata.make_vocab_size_divisible_by, tp)
    for name in _VOCAB_TENSORS:
        if name in state:
            state[name] = resize_vocab_rows(state[name], rows)
    write_torch_checkpoint(args.save_dir, state, metadata.checkpoint_args, metadata.iteration, tp, pp, metadata.release,
                           ep)
    print(f" saved a TP={tp}, PP={pp}, EP={ep} torch-format checkpoint ({rows} vocabulary rows) to {args.save_dir}",
          flush=True)
