"""The engine of `tools/preprocess_data.py`: loose JSON in, Megatron `.bin/.idx` token datasets out.

    inputs.py      which files, split into tasks (byte ranges of plain files, line blocks of compressed ones)
    encoder.py     what a worker does with a task: parse, check, split sentences, tokenize
    sentences.py   nltk punkt, checked in the parent before any work starts
    pipeline.py    the worker pool, the single ordered writer, progress and the bad-input summary

Imports neither torch nor model code.
"""
