"""Checkpoint conversion, the engine of tools/checkpoint/: whole checkpoints read and written on a CPU,
resharded, and exported to / imported from Hugging Face `transformers`.

    convert.py                 tools/checkpoint/convert.py: Megatron's converter, a loader and a saver plugin
                               exchanging messages (messages.py)
    loader_core.py, saver_core.py   torch-format checkpoints (torch_dist ones are read too), any TP x PP x EP
    loader_hf.py, saver_hf.py  Hugging Face model directories (hf_directory.py, tokenizer_info.py)
    gpt2_hf.py, llama_hf.py, qwen3_moe_hf.py, deepseek_v3_hf.py, bert_hf.py   the weight maps per model family
    torch_checkpoint.py, dist_checkpoint.py   a whole checkpoint as one full state dict, and back
    tensor_parallel_sharding.py, pipeline_stages.py, expert_sharding.py, vocab_padding.py   resharding
    gpt_shape.py               the model's shape, read once from the training arguments
    inspect_checkpoint.py      tools/checkpoint/inspect_checkpoint.py
    export_bert_hf.py          tools/checkpoint/export_bert_hf.py
"""
