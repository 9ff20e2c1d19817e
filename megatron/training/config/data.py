"""Dataset, sequence-length and data-loader flags."""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag


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

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built for each blended dataset."""
