"""What pretrain_bert.py and pretrain_t5.py share: both train on sentence-level WordPiece data (the masked
datasets of megatron/core/datasets), read on tensor-parallel rank 0 and broadcast to its TP group."""

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.training.batch_broadcast import get_batch_on_this_tp_rank
from megatron.training.console import print_rank_0
from megatron.training.datasets.blend import get_blend_and_blend_per_split
from megatron.training.global_vars import get_tokenizer


def check_layer_spec_flag(args, model_name: str) -> None:
    """`--spec` may only name the built-in local spec: custom spec modules are not supported yet."""
    if args.spec not in (None, ["local"]):
        raise ValueError(f"--spec {' '.join(args.spec)}: custom layer specs are not supported yet for {model_name}; "
                         "leave --spec out (or give --spec local)")


def refuse_pipeline_parallelism(args, model_name: str) -> None:
    """BERT and T5 run on one pipeline stage only (their encoder/decoder split is not built yet)."""
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: pipeline parallelism "
                         f"is not supported yet for {model_name}; use 1 (pipeline parallelism works for GPT)")


def is_dataset_built_on_rank() -> bool:
    """Data is read on tensor-parallel rank 0 (Megatron's rule for BERT and T5); the other TP ranks get
    each batch by broadcast."""
    return parallel_state.get_tensor_model_parallel_rank() == 0


def masked_dataset_config_args(args, script: str) -> dict:
    """The config fields BERT's and T5's datasets share (Megatron's values: whole-word masking, no
    permutation); each task adds its sequence lengths, n-gram rule and heads. Refuses mock data."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    if args.mock_data or (blend is None and blend_per_split is None):
        raise ValueError(
            f"{script} needs sentence-split data: give --data-path PREFIX_text_sentence (made by "
            "tools/preprocess_data.py --split-sentences with a WordPiece --vocab-file); --mock-data exists for GPT only"
        )
    return dict(
        random_seed=args.seed,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def build_masked_datasets(dataset_class, train_val_test_num_samples, config, model_name: str):
    """(train, valid, test) datasets of `dataset_class`, built on tensor-parallel rank 0 (None elsewhere)."""
    print_rank_0(f"> building train, validation, and test datasets for {model_name} ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_class, train_val_test_num_samples, is_dataset_built_on_rank, config
    ).build()
    print_rank_0(f"> finished creating {model_name} datasets ...")
    return datasets


def next_batch(data_iterator, keys) -> dict:
    """The next microbatch's tensors named in `keys`, on this rank's device (read on TP rank 0)."""
    tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)  # None: one process alone
    batch = get_batch_on_this_tp_rank(data_iterator, keys, tp_group=tp_group)
    missing = [key for key in keys if batch[key] is None]
    if missing:
        raise ValueError(f"the dataset's samples lack the keys {missing}; expected {list(keys)}")
    return batch
