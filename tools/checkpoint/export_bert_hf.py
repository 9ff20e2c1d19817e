"""Export a pretrain_bert.py checkpoint (TP=1, PP=1) to a Hugging Face BERT directory.

    python tools/checkpoint/export_bert_hf.py --load checkpoints/bert --save-dir bert-hf

Post-norm models (--apply-residual-connection-post-layernorm) become BertForPreTraining, Megatron's
default pre-norm ones MegatronBertForPreTraining (...ForMaskedLM without the binary head). The logic
lives in megatron/training/checkpointing/conversion/export_bert_hf.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.training.checkpointing.conversion.export_bert_hf import main  # noqa: E402
from megatron.training.errors import run_entry_point  # noqa: E402

if __name__ == "__main__":
    run_entry_point(main)
