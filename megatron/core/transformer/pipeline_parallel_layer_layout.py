"""An explicit placement of the model's layers on the (virtual) pipeline stages: `--pipeline-model-parallel-layout`.

The layout is a string of stages separated by `|`, one character per layer:

    E  the input embedding       t  a transformer (decoder) layer
    L  the output layer and loss m  a multi-token-prediction depth

`(...)*n` repeats a group and `x*n` a character; commas are cosmetic. "Et*3|(tt|)*6tmL" unrolls to
"Ettt|tt|tt|tt|tt|tt|tt|tmL": 8 stages. With PP ranks and S stages (S a multiple of PP) each rank holds
S / PP virtual stages, taken in execution order as the implicit splits are: stage k of the string is
virtual stage k // PP of pipeline rank k % PP. The transformer layers are numbered along the string, so
the layers of stage (v, p) are the `t`s of that stage, offset by the `t`s of every stage before it.

Rules (Megatron-LM's): the string starts with E and ends with L, each exactly once; the count of `t` is
num_layers and of `m` the MTP depth, every `m` after the last `t`; a stage may hold no transformer layer.
Here the MTP depths must sit in the last stage, with the loss and a transformer layer (Megatron-LM also
allows them on an earlier rank's last virtual stage, "standalone" MTP, which is not supported yet), and
encoder layers are refused as in Megatron-LM.
"""

import re
from functools import lru_cache

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType

_CHARACTERS = {"E": LayerType.embedding, "L": LayerType.loss, "t": LayerType.decoder, "m": LayerType.mtp}


class PipelineParallelLayerLayout:
    """A parsed layout: `layout[pp_rank][vp_stage]` is the list of `LayerType`s of that stage."""

    def __init__(self, layout: str | list, pipeline_model_parallel_size: int):
        """`layout`: the string, or a list of stages, each a list of `LayerType`s or their names / characters."""
        self.input_data = layout
        stages = parse_layout_string(layout) if isinstance(layout, str) else [
            [_layer_type(layer) for layer in stage] for stage in layout
        ]
        pp = pipeline_model_parallel_size
        if not stages or len(stages) % pp:
            raise ValueError(f"pipeline layout {layout!r} has {len(stages)} stage(s), which must be a positive "
                             f"multiple of pipeline_model_parallel_size ({pp})")
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = len(stages) // pp
        self.layout = [[stages[v * pp + p] for v in range(self.virtual_pipeline_model_parallel_size)]
                       for p in range(pp)]
        self.flatten_layout = [layer for stage in stages for layer in stage]

    def __repr__(self) -> str:
        return str(self.input_data)

    @staticmethod
    @lru_cache
    def from_str(layout: str, pipeline_model_parallel_size: int) -> "PipelineParallelLayerLayout":
        return PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """Stages (PP x VPP) of a layout string."""
        return len(parse_layout_string(layout))

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None) -> bool:
        """Raises ValueError naming the broken rule; returns False (MTP is never standalone here)."""
        problems = self.problems(num_layers, mtp_num_layers)
        if problems:
            raise ValueError("; ".join(problems))
        return False

    def problems(self, num_layers: int, mtp_num_layers: int | None) -> list[str]:
        """What is wrong with this layout for `num_layers` transformer layers and `mtp_num_layers` depths."""
        flat, name = self.flatten_layout, f"pipeline layout {self.input_data!r}"
        counts = {layer_type: flat.count(layer_type) for layer_type in LayerType}
        problems = []
        if not flat or flat[0] != LayerType.embedding or flat[-1] != LayerType.loss:
            problems.append(f"{name} must start with the embedding E and end with the loss L")
        if counts[LayerType.embedding] != 1 or counts[LayerType.loss] != 1:
            problems.append(f"{name} must hold the embedding E and the loss L exactly once each")
        if counts[LayerType.decoder] != num_layers:
            problems.append(f"{name} holds {counts[LayerType.decoder]} transformer layer(s) t, but --num-layers is "
                            f"{num_layers}")
        if counts[LayerType.mtp] != (mtp_num_layers or 0):
            problems.append(f"{name} holds {counts[LayerType.mtp]} MTP layer(s) m, but --mtp-num-layers is "
                            f"{mtp_num_layers}")
        if counts[LayerType.encoder]:
            problems.append(f"{name}: encoder layers are not supported in a pipeline layout (as in Megatron-LM)")
        if counts[LayerType.mtp]:
            if LayerType.decoder in flat[flat.index(LayerType.mtp):]:
                problems.append(f"{name}: every MTP layer m must come after the last transformer layer t")
            elif self.layout[-1][-1].count(LayerType.mtp) != counts[LayerType.mtp]:
                problems.append(f"{name}: MTP layers on a stage other than the last one (with the loss L, "
                                "Megatron-LM's standalone MTP) are not supported yet")
            elif LayerType.decoder not in self.layout[-1][-1]:
                problems.append(f"{name}: MTP layers on a last stage without a transformer layer t are not "
                                "supported yet (each depth is built like that stage's last transformer layer)")
        return problems

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                                pp_rank: int | None = None) -> int:
        """Layers of `layer_type` on virtual stage `vp_stage` (default 0) of pipeline rank `pp_rank` (default:
        this rank's)."""
        vp_stage, pp_rank = _position(vp_stage, pp_rank)
        return self.layout[pp_rank][vp_stage].count(layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                         pp_rank: int | None = None) -> int:
        """Layers of `layer_type` on the stages before (`vp_stage`, `pp_rank`) in execution order."""
        vp_stage, pp_rank = _position(vp_stage, pp_rank)
        before = [self.layout[p][v] for v in range(vp_stage + 1)
                  for p in range(self.pipeline_model_parallel_size if v < vp_stage else pp_rank)]
        return sum(stage.count(layer_type) for stage in before)

    def get_layer_id_list(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                          pp_rank: int | None = None) -> list[int]:
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def decoder_counts(self) -> list[list[int]]:
        """counts[v][p]: transformer layers of virtual stage v of pipeline rank p."""
        return [[self.get_num_layers_to_build(LayerType.decoder, v, p) for p in range(self.pipeline_model_parallel_size)]
                for v in range(self.virtual_pipeline_model_parallel_size)]


def _position(vp_stage: int | None, pp_rank: int | None) -> tuple[int, int]:
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return vp_stage or 0, pp_rank


def _layer_type(layer) -> LayerType:
    if isinstance(layer, LayerType):
        return layer
    text = str(layer).strip()
    if text in _CHARACTERS:
        return _CHARACTERS[text]
    if text.lower() in LayerType.__members__:
        return LayerType[text.lower()]
    raise ValueError(f"{layer!r} is not a layer of a pipeline layout: use {', '.join(LayerType.__members__)} or "
                     f"the characters {', '.join(_CHARACTERS)}")


def parse_layout_string(layout: str) -> list[list[LayerType]]:
    """The stages of a layout string (module docstring): "E|(tt|)*2L" -> [[E], [t, t], [t, t, L]]."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda found: found.group(1) * int(found.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda found: found.group(1) * int(found.group(2)), text)
    stages = []
    for stage in text.split("|"):
        unknown = sorted(set(stage) - set(_CHARACTERS))
        if unknown:
            raise ValueError(f"pipeline layout {layout!r}: unknown character(s) {' '.join(unknown)} in stage "
                             f"{stage!r}; a stage holds {', '.join(f'{c} ({t.name})' for c, t in _CHARACTERS.items())}")
        stages.append([_CHARACTERS[character] for character in stage])
    return stages


def as_layout(layout, pipeline_model_parallel_size: int) -> PipelineParallelLayerLayout | None:
    """`layout` (a string, a list of stages, a parsed layout or None) as a parsed layout."""
    if layout is None or isinstance(layout, PipelineParallelLayerLayout):
        return layout
    if isinstance(layout, str):
        return PipelineParallelLayerLayout.from_str(layout, pipeline_model_parallel_size)
    return PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)
