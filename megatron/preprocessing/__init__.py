"""The engine of `tools/preprocess_data.py`: loose JSON in, Megatron `.bin/.idx` token datasets out.

    inputs.py      which files, split into tasks (byte ranges of plain files, line blocks of compressed ones)
    encoder.py     what a worker does with a task: parse, check, split sentences, tokenize
    sentences.py   nltk punkt, checked in the parent before any work starts
    pipeline.py    the worker pool, the single ordered writer, progress and the bad-input summary
    tokenizer_arguments.py   the tokenizer flags, shared with the training parser

Imports neither torch nor model code: only `megatron.core.tokenizers` and the `.bin/.idx` writer of
`megatron.core.datasets`. It sits beside `megatron/training` rather than inside it, because importing
`megatron.training` loads torch and the training loop.
"""
