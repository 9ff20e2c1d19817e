"""Dataset, sequence-length and data-loader flags."""

import argparse


def _add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="[weight] prefix ... of .bin/.idx datasets, split by --split. Exclusive with "
                            "--train/valid/test-data-path and --mock-data.")
    group.add_argument("--split", type=str, default=None,
                       help='Train, validation, test proportions, e.g. "949,50,1" (default "969, 30, 1" with '
                            "--data-path).")
    group.add_argument("--train-data-path", nargs="*", default=None, help="[weight] prefix ... for training.")
    group.add_argument("--valid-data-path", nargs="*", default=None, help="[weight] prefix ... for validation.")
    group.add_argument("--test-data-path", nargs="*", default=None, help="[weight] prefix ... for testing.")
    group.add_argument("--data-args-path", type=str, default=None,
                       help="File holding the --data-path list; exclusive with --data-path.")
    group.add_argument("--per-split-data-args-path", type=str, default=None,
                       help='JSON file with "train", "valid", "test" lists; exclusive with --*-data-path.')
    group.add_argument("--data-cache-path", type=str, default=None, help="Directory for the index cache files.")
    group.add_argument("--mock-data", action="store_true", help="Train on generated tokens (no dataset needed).")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Read .bin files with file reads instead of mmap.")
    group.add_argument("--seq-length", type=int, default=None, help="Tokens per training sequence.")
    group.add_argument("--encoder-seq-length", type=int, default=None,
                       help="Encoder sequence length (T5); exclusive with --seq-length.")
    group.add_argument("--decoder-seq-length", type=int, default=None, help="Decoder sequence length (T5).")
    group.add_argument("--mask-prob", type=float, default=0.15, help="Masking probability (BERT, T5).")
    group.add_argument("--short-seq-prob", type=float, default=0.1,
                       help="Probability of a shorter sample (BERT, T5).")
    group.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes.")
    group.add_argument("--dataloader-type", default=None, choices=["single", "cyclic", "external"],
                       help="single: one pass from the consumed-samples position (default); cyclic: random "
                            "epochs; external: the dataset provider returns iterators.")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Restart position ids after each end-of-document token.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Do not attend across end-of-document tokens.")
    group.add_argument("--eod-mask-loss", action="store_true",
                       help="No loss on positions whose input token is end-of-document.")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader",
                       help="Let the attention kernel build the causal mask.")
    group.add_argument("--num-dataset-builder-threads", type=int, default=1,
                       help="Threads per rank that build dataset indices.")
    group.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                       help="Extra fraction of samples built for each blended dataset.")
    return parser
