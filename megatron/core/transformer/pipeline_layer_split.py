"""Which transformer layers each pipeline stage builds (reference 9.3).

The model's L layers are cut into PP x VPP chunks, taken in execution order: virtual stage 0 of PP
ranks 0 .. PP-1, then virtual stage 1 of ranks 0 .. PP-1, and so on. Chunk (v, p) - virtual stage v
of pipeline rank p - holds the consecutive global layers

    offset(v, p) .. offset(v, p) + count(v, p) - 1,   offset(v, p) = sum of the counts of earlier chunks

Counts per pipeline rank (then split evenly over its VPP chunks):

    even:      L / PP                                            (L % PP == 0)
    uneven:    F on the first rank, T on the last (either may be unset), the rest split evenly
               (L - F - T) / (ranks left)                       (--decoder-first/last-pipeline-num-layers)
    embedding/loss counted as layers: (L + e + l) / PP, then chunk (0, 0) builds one layer fewer when
               e = 1 and chunk (VPP-1, PP-1) one fewer when l = 1 (--account-for-*-in-pipeline-split)

    layout:    the `t`s of each stage of `pipeline_model_parallel_layout` (pipeline_parallel_layer_layout.py),
               which also fixes VPP

Example, L = 8, PP = 2, VPP = 2: rank 0 builds layers [0, 1] and [4, 5], rank 1 builds [2, 3] and [6, 7].
A chunk may hold no layer (as in Megatron-Core): 6 layers with the embedding and loss counted over PP = 4,
VPP = 2 put one layer on every chunk but (0, 0), which holds only the embedding, and (1, 3), only the loss.
Stages keep local layer numbers in their state dict (`decoder.layers.0 ..`); global index = offset +
local index. `config` is any object with the TransformerConfig field names (no import, so that the
config itself can call `pipeline_layer_split_problems`).
"""

from megatron.core import parallel_state
from megatron.core.transformer.pipeline_parallel_layer_layout import as_layout


def _rank_layer_counts(config) -> list[int]:
    """Layers (counting an accounted-for embedding/loss as one) on each pipeline rank."""
    pp, num_layers = config.pipeline_model_parallel_size, config.num_layers
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        counted = num_layers + int(config.account_for_embedding_in_pipeline_split) + int(
            config.account_for_loss_in_pipeline_split
        )
        if counted % pp:
            raise ValueError(
                f"num_layers ({num_layers}{f', {counted} counting embedding/loss' if counted != num_layers else ''})"
                f" must be divisible by pipeline_model_parallel_size ({pp}); valid sizes: "
                f"{', '.join(str(d) for d in range(1, counted + 1) if counted % d == 0)}"
            )
        return [counted // pp] * pp
    if config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split:
        raise ValueError(
            "num_layers_in_first/last_pipeline_stage (--decoder-first/last-pipeline-num-layers) cannot be combined "
            "with account_for_embedding/loss_in_pipeline_split"
        )
    if pp == 1:
        raise ValueError("num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1")
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_ranks = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_ranks and middle_layers % middle_ranks):
        raise ValueError(
            f"uneven pipeline split: num_layers ({num_layers}) - first stage ({first or 0}) - last stage "
            f"({last or 0}) = {middle_layers} layers must split evenly over the {middle_ranks} other stage(s)"
        )
    if middle_ranks == 0 and middle_layers:
        raise ValueError(
            f"uneven pipeline split: first ({first}) + last ({last}) stage layers must equal num_layers ({num_layers})"
        )
    per_middle_rank = middle_layers // middle_ranks if middle_ranks else 0
    counts = [per_middle_rank] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def pipeline_layer_counts(config) -> list[list[int]]:
    """counts[v][p]: transformer layers built by virtual stage v of pipeline rank p.

    Raises ValueError, naming the numbers, when the layers do not split over the stages.
    """
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    layout = as_layout(getattr(config, "pipeline_model_parallel_layout", None), pp)
    if layout is not None:
        return _layout_counts(config, layout, vpp)
    per_rank = _rank_layer_counts(config)
    for rank, count in enumerate(per_rank):
        if count % vpp:
            raise ValueError(
                f"pipeline rank {rank} holds {count} layers, not divisible by virtual_pipeline_model_parallel_size "
                f"({vpp})"
            )
    counts = [[count // vpp for count in per_rank] for _ in range(vpp)]
    if config.account_for_embedding_in_pipeline_split:
        counts[0][0] -= 1
    if config.account_for_loss_in_pipeline_split:
        counts[-1][-1] -= 1
    return counts  # each chunk had at least one (counted) layer, so none goes below 0


def _layout_counts(config, layout, vpp: int) -> list[list[int]]:
    """The layout's counts, once its rules hold for the config's layers and MTP depths."""
    problems = layout.problems(config.num_layers, getattr(config, "mtp_num_layers", None))
    if layout.virtual_pipeline_model_parallel_size != vpp:
        problems.append(f"pipeline layout {layout} has {layout.virtual_pipeline_model_parallel_size} virtual stage(s) "
                        f"per rank, but virtual_pipeline_model_parallel_size is {vpp}")
    if (config.num_layers_in_first_pipeline_stage is not None or config.num_layers_in_last_pipeline_stage is not None
            or config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split):
        problems.append("a pipeline layout cannot be combined with num_layers_in_first/last_pipeline_stage or "
                        "account_for_embedding/loss_in_pipeline_split (the layout places every layer)")
    if problems:
        raise ValueError("; ".join(problems))
    return layout.decoder_counts()


def pipeline_layer_split_problems(config) -> list[str]:
    """[] when the layers split over the (virtual) pipeline stages, else the reason (a bad
    pipeline_model_parallel_size itself is reported by the config's size checks)."""
    if not isinstance(config.pipeline_model_parallel_size, int) or config.pipeline_model_parallel_size < 1:
        return []
    try:
        pipeline_layer_counts(config)
    except ValueError as error:
        return [str(error)]
    return []


def _chunk_position(vp_stage: int | None, pp_rank: int | None) -> tuple[int, int]:
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if vp_stage is None:
        vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    return vp_stage, pp_rank


def get_num_layers_to_build(config, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    """Transformer layers of virtual stage `vp_stage` of pipeline rank `pp_rank` (default: this rank's
    current stage, from `parallel_state`)."""
    vp_stage, pp_rank = _chunk_position(vp_stage, pp_rank)
    return pipeline_layer_counts(config)[vp_stage][pp_rank]


def get_transformer_layer_offset(config, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    """Global index of the first layer of virtual stage `vp_stage` of pipeline rank `pp_rank` (default:
    this rank's current stage, from `parallel_state`)."""
    vp_stage, pp_rank = _chunk_position(vp_stage, pp_rank)
    counts = pipeline_layer_counts(config)
    earlier_rounds = sum(sum(round_counts) for round_counts in counts[:vp_stage])
    return earlier_rounds + sum(counts[vp_stage][:pp_rank])
