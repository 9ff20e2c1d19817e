"""Split a full GPTModel state dict over pipeline stages and merge the stages back (reference 8.2, 12 item 12).

Stage p of PP holds layers p*L/PP .. (p+1)*L/PP - 1 (the even split of `get_num_layers_to_build`),
saved under LOCAL indices `decoder.layers.0 .. L/PP - 1`; the first stage holds the embeddings, the
last the final norm, `output_layer.weight` and the multi-token-prediction layers (`mtp.`). With tied
embeddings and PP > 1 the last stage keeps its own copy of the word embeddings as `output_layer.weight` (a
PP=1 model has no such key); with multi-token prediction and PP > 1 its copy is
`embedding.word_embeddings.weight` (and a tied output layer has no weight).
"""

import re

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_FIRST_STAGE = ("embedding.",)
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.", "mtp.")


def check_pipeline_parallel_size(num_layers: int, pp: int) -> None:
    if pp < 1 or num_layers % pp:
        legal = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(f"--target-pipeline-parallel-size {pp} must divide the {num_layers} layers: legal sizes "
                         f"{', '.join(map(str, legal))}")


def split_pipeline(state: dict, pp: int, num_layers: int, tied_embeddings: bool) -> list[dict]:
    """Per-stage state dicts with local layer indices (see the module docstring)."""
    check_pipeline_parallel_size(num_layers, pp)
    per_stage = num_layers // pp
    stages = [{} for _ in range(pp)]
    for name, tensor in state.items():
        layer = _LAYER.fullmatch(name)
        if layer:
            index = int(layer.group(1))
            stages[index // per_stage][f"decoder.layers.{index % per_stage}.{layer.group(2)}"] = tensor
        elif name.startswith(_FIRST_STAGE):
            stages[0][name] = tensor
        elif name.startswith(_LAST_STAGE):
            stages[-1][name] = tensor
        else:
            raise ValueError(f"{name}: not a GPTModel parameter the pipeline split knows")
    if pp > 1 and any(name.startswith("mtp.") for name in state):  # multi-token prediction embeds there too
        stages[-1]["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"]
    elif tied_embeddings and pp > 1:
        stages[-1]["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return stages


def merge_pipeline(stages: list[dict], num_layers: int, tied_embeddings: bool) -> dict:
    """The full state dict with global layer indices (inverse of `split_pipeline`; a tied model's
    last-stage `output_layer.weight` copy is dropped, as PP=1 has none)."""
    pp = len(stages)
    check_pipeline_parallel_size(num_layers, pp)
    per_stage = num_layers // pp
    merged = {}
    for stage_index, stage in enumerate(stages):
        for name, tensor in stage.items():
            layer = _LAYER.fullmatch(name)
            if layer:
                merged[f"decoder.layers.{stage_index * per_stage + int(layer.group(1))}.{layer.group(2)}"] = tensor
            elif stage_index == 0 or not (name == "embedding.word_embeddings.weight" or (
                    tied_embeddings and name == "output_layer.weight")):
                merged[name] = tensor
    return merged
