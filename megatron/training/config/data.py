"""Dataset, sequence-length and data-loader flags."""

import re
from dataclasses import dataclass

from megatron.training.config.fields import Section, flag

# Megatron's split when --data-path comes without --split.
LEGACY_DEFAULT_SPLIT = "969, 30, 1"


@dataclass(kw_only=True)
class DataConfig(Section):
    """Where the tokens come from, how long a sample is, and how the loader reads it."""

    TITLE = "data and dataloader"

    data_path: list[str] | None = flag(None, nargs="*")
    """[weight] prefix ... of .bin/.idx datasets, split by --split. Exclusive with --train/valid/test-data-path
    and --mock-data."""

    split: str | None = None
    """Train, validation, test proportions, e.g. "949,50,1" (default "969, 30, 1" with --data-path)."""

    train_data_path: list[str] | None = flag(None, nargs="*")
    """[weight] prefix ... for training."""

    valid_data_path: list[str] | None = flag(None, nargs="*")
    """[weight] prefix ... for validation."""

    test_data_path: list[str] | None = flag(None, nargs="*")
    """[weight] prefix ... for testing."""

    data_args_path: str | None = None
    """File holding the --data-path list; exclusive with --data-path."""

    per_split_data_args_path: str | None = None
    """JSON file with "train", "valid", "test" lists; exclusive with --*-data-path."""

    data_cache_path: str | None = None
    """Directory for the index cache files."""

    mock_data: bool = False
    """Train on generated tokens (no dataset needed)."""

    mmap_bin_files: bool = flag(True, names=("--no-mmap-bin-files",))
    """Read .bin files with file reads instead of mmap."""

    seq_length: int | None = None
    """Tokens per training sequence."""

    encoder_seq_length: int | None = None
    """Encoder sequence length (T5); exclusive with --seq-length."""

    decoder_seq_length: int | None = None
    """Decoder sequence length (T5)."""

    mask_prob: float = 0.15
    """Masking probability (BERT, T5)."""

    short_seq_prob: float = 0.1
    """Probability of a shorter sample (BERT, T5)."""

    num_workers: int = 2
    """DataLoader worker processes."""

    dataloader_type: str | None = flag(None, choices=("single", "cyclic", "external"))
    """single: one pass from the consumed-samples position (default); cyclic: random epochs; external: the
    dataset provider returns iterators."""

    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""

    reset_attention_mask: bool = False
    """Do not attend across end-of-document tokens."""

    eod_mask_loss: bool = False
    """No loss on positions whose input token is end-of-document."""

    create_attention_mask_in_dataloader: bool = flag(True, names=("--no-create-attention-mask-in-dataloader",))
    """Let the attention kernel build the causal mask."""

    num_dataset_builder_threads: int = 1
    """Threads per rank that build dataset indices."""

    fim_data: bool = False
    """Fill-in-the-middle samples (Megatron-LM's FIM dataset, megatron/training/datasets/fim_dataset.py)."""

    fim_rate: float = 0.5
    """Probability that a sample becomes a fill-in-the-middle sample (with --fim-data)."""

    fim_spm_rate: float = 0.5
    """Probability that a fill-in-the-middle sample is in suffix-prefix-middle order (with --fim-data)."""

    fim_split_sample: str | None = None
    """A token at which samples are cut into fragments, each rearranged on its own (with --fim-data)."""

    fim_fragment_rate: float | None = None
    """Probability that a fragment is rearranged (with --fim-split-sample)."""

    fim_no_prefix: str | None = None
    """Leave sequences whose text starts with this string as they are (with --fim-data)."""

    fim_prefix_token: str = "<fim_prefix>"
    """The token before the prefix (with --fim-data; outside the vocabulary: the unknown token)."""

    fim_middle_token: str = "<fim_middle>"
    """The token before the middle (with --fim-data)."""

    fim_suffix_token: str = "<fim_suffix>"
    """The token before the suffix (with --fim-data)."""

    fim_pad_token: str = "<fim_pad>"
    """The token that pads a rearranged sample back to its length (with --fim-data)."""

    fim_eod_token: str = "<|endoftext|>"
    """The end-of-document token at which samples are cut into segments (with --fim-data)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built for each blended dataset."""

    @property
    def sequence_length(self) -> int | None:
        """--seq-length, or --encoder-seq-length when only that is given (T5)."""
        return self.seq_length if self.seq_length is not None else self.encoder_seq_length

    def sequence_flags_conflict(self) -> bool:
        return None not in (self.seq_length, self.encoder_seq_length) and self.seq_length != self.encoder_seq_length

    def derived(self) -> dict:
        """The sequence length under both names, the default loader, and Megatron's legacy --split with
        --data-path."""
        values = {"dataloader_type": self.dataloader_type or "single"}
        if not self.sequence_flags_conflict():
            values["seq_length"] = values["encoder_seq_length"] = self.sequence_length
        if self.data_path is not None and self.split is None:
            values["split"] = LEGACY_DEFAULT_SPLIT
        return values

    def validate(self) -> list[str]:
        problems = []
        if self.sequence_flags_conflict():
            problems.append(f"give --seq-length or --encoder-seq-length, not both (got {self.seq_length} and "
                            f"{self.encoder_seq_length})")
        elif self.sequence_length is None:
            problems.append("--seq-length is required")
        if self.split is not None:
            problems += _split_problems(self.split)
        problems += self._source_problems()
        if self.num_dataset_builder_threads < 1:
            problems.append(f"--num-dataset-builder-threads {self.num_dataset_builder_threads} must be positive")
        if self.num_workers < 0:
            problems.append(f"--num-workers {self.num_workers} must be >= 0")
        for flag_name, probability in (("--mask-prob", self.mask_prob), ("--short-seq-prob", self.short_seq_prob)):
            if not 0.0 <= probability <= 1.0:
                problems.append(f"{flag_name} {probability} must be in [0, 1]")
        return problems + (self._fim_problems() if self.fim_data else [])

    def _fim_problems(self) -> list[str]:
        """Megatron-LM's rules for --fim-data (its rates must be non-zero), and rates that are probabilities."""
        problems = []
        if self.mock_data:
            problems.append("--fim-data reads documents: it cannot go with --mock-data (as in Megatron-LM)")
        for flag_name, rate in (("--fim-rate", self.fim_rate), ("--fim-spm-rate", self.fim_spm_rate),
                                ("--fim-fragment-rate", self.fim_fragment_rate)):
            if rate is not None and not 0.0 <= rate <= 1.0:
                problems.append(f"{flag_name} {rate} must be in [0, 1]")
            elif rate == 0.0 and flag_name != "--fim-fragment-rate":
                problems.append(f"{flag_name} must be non-zero with --fim-data (Megatron-LM's rule)")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            problems.append("--fim-split-sample needs --fim-fragment-rate")
        return problems

    def _source_problems(self) -> list[str]:
        """One data source: generated tokens, one blend split by --split, or one blend per split."""
        problems = []
        per_split = [flag_name for flag_name, value in (("--train-data-path", self.train_data_path),
                                                        ("--valid-data-path", self.valid_data_path),
                                                        ("--test-data-path", self.test_data_path)) if value is not None]
        if self.data_path is not None and self.data_args_path is not None:
            problems.append("give --data-path or --data-args-path, not both")
        if per_split and self.per_split_data_args_path is not None:
            problems.append(f"give {', '.join(per_split)} or --per-split-data-args-path, not both")
        sources = [name for name, used in (
            ("--mock-data", self.mock_data),
            ("--data-path", self.data_path is not None or self.data_args_path is not None),
            ("per-split paths", bool(per_split) or self.per_split_data_args_path is not None),
        ) if used]
        if len(sources) > 1:
            problems.append(f"choose one data source: {' and '.join(sources)} were both given")
        return problems


def _split_problems(split: str) -> list[str]:
    """Megatron reads up to three non-negative numbers ("949,50,1", "98/2"); missing ones are 0."""
    parts = [part for part in re.split(r"[,/]", split) if part.strip()]
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        return [f"--split {split!r} must be up to three comma-separated numbers, e.g. 949,50,1"]
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        return [f"--split {split!r} must be 1 to 3 non-negative numbers with a positive sum, e.g. 949,50,1"]
    return []
