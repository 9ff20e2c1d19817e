"""Process groups for tensor (TP), context (CP), expert (EP), data (DP) and pipeline (PP) parallelism.

Ranks are laid out by an order string, `tp-cp-ep-dp-pp` by default, whose FIRST token varies fastest:

    global_rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

so TP peers are neighbours (one NVLink island) and PP peers are far apart. A group for a set of tokens
("dp-cp", say) is every set of ranks that differ only in those coordinates. Two generators share the
world: the dense one (tp, cp, dp, pp; ep = 1) and the expert one (etp, ep, edp, pp; cp = 1), and both
must give the same pipeline groups. Names and semantics follow Megatron-Core's `parallel_state`.
"""

from datetime import timedelta

import numpy as np
import torch.distributed as dist

from megatron.core.nccl_settings import COMMUNICATOR_NAMES, load_communicator_settings, process_group_options

_GROUPS: dict = {}  # name -> (this rank's group, its global ranks)
_GLOO_TWINS: dict = {}  # global ranks -> a gloo group of those ranks (tensor_parallel/host_group.py)
_VIRTUAL_PIPELINE_RANK = None
_VIRTUAL_PIPELINE_WORLD_SIZE = None
_ORDER = None


class RankGenerator:
    """Enumerates rank groups for a parallel layout (Megatron-Core's `RankGenerator`).

    `sizes` maps each token of `order` to its size. `get_ranks("dp-cp")` returns every group of ranks that
    differ only in their dp and cp coordinates, members listed with the earlier token varying fastest.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str):
        self.sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        self.order = order.split("-")
        if sorted(self.order) != sorted(self.sizes):
            raise ValueError(f"parallel order {order!r} must name each of tp, cp, ep, dp, pp exactly once")
        self.world_size = int(np.prod(list(self.sizes.values())))

    def get_ranks(self, tokens: str) -> list[list[int]]:
        wanted = tokens.split("-")
        unknown = set(wanted) - set(self.order)
        if unknown:
            raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)} in {tokens!r}")
        # Array axes run slowest -> fastest, i.e. the order string reversed: [pp, dp, ep, cp, tp].
        axes = list(reversed(self.order))
        ranks = np.arange(self.world_size).reshape([self.sizes[a] for a in axes])
        kept = [i for i, a in enumerate(axes) if a not in wanted]
        grouped = [i for i, a in enumerate(axes) if a in wanted]
        group_size = int(np.prod([self.sizes[axes[i]] for i in grouped]))
        return ranks.transpose(kept + grouped).reshape(-1, group_size).tolist()


def _new_groups(name: str, rank_lists: list[list[int]], timeout: timedelta, backend=None,
                nccl_settings: dict | None = None) -> None:
    """Creates every group of `rank_lists` (all ranks must call this in the same order) and keeps ours; an NCCL
    group gets the settings `nccl_settings` holds for its Megatron-Core name (nccl_settings.py)."""
    rank = dist.get_rank()
    options = None
    if (backend or dist.get_backend()) == "nccl" and name in COMMUNICATOR_NAMES:
        options = process_group_options((nccl_settings or {}).get(COMMUNICATOR_NAMES[name]))
    for ranks in rank_lists:
        group = dist.new_group(ranks, timeout=timeout, backend=backend, pg_options=options)
        if rank in ranks:
            _GROUPS[name] = (group, ranks)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
) -> None:
    """Builds all model- and data-parallel groups. `torch.distributed` must already be initialised.
    `nccl_communicator_config_path` and `high_priority_stream_groups`: NCCL settings per group
    (megatron/core/nccl_settings.py)."""
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE, _ORDER
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group "
            "first (under torchrun, or with world_size=1 for a single process)"
        )
    unsupported = {
        "hierarchical_context_parallel_sizes": hierarchical_context_parallel_sizes,
        "num_distributed_optimizer_instances": num_distributed_optimizer_instances != 1,
        "use_sharp": use_sharp,
    }
    for name, value in unsupported.items():
        if value:
            raise ValueError(f"initialize_model_parallel: {name} is not supported yet")

    world_size = dist.get_world_size()
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    problems = []
    if world_size % (tp * pp * cp):
        problems.append(
            f"world size ({world_size}) is not divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
            f"model-parallel size ({tp * pp * cp})"
        )
    if world_size % (etp * ep * pp):
        problems.append(
            f"world size ({world_size}) is not divisible by expert tensor ({etp}) x expert ({ep}) x pipeline "
            f"({pp}) parallel size ({etp * ep * pp})"
        )
    if problems:
        raise ValueError("; ".join(problems))
    dp = world_size // (tp * pp * cp)
    if "ep" not in order.split("-"):
        raise ValueError(f"parallel order {order!r} must contain ep")

    settings = load_communicator_settings(nccl_communicator_config_path, high_priority_stream_groups or ())
    destroy_model_parallel()
    timeout = timedelta(minutes=distributed_timeout_minutes)

    def new_groups(name: str, rank_lists: list[list[int]], backend=None) -> None:
        _new_groups(name, rank_lists, timeout, backend, settings)

    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, cp=1, order=order)
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise ValueError("dense and expert layouts give different pipeline groups; check the parallel sizes")

    new_groups("dp", dense.get_ranks("dp"))
    new_groups("dp-cp", dense.get_ranks("dp-cp"))
    if create_gloo_process_groups and dist.get_backend() != "gloo":
        new_groups("dp-gloo", dense.get_ranks("dp"), backend="gloo")
        new_groups("dp-cp-gloo", dense.get_ranks("dp-cp"), backend="gloo")
    new_groups("cp", dense.get_ranks("cp"))
    new_groups("mp", dense.get_ranks("tp-pp"))
    new_groups("tp", dense.get_ranks("tp"))
    new_groups("pp", dense.get_ranks("pp"), backend=pipeline_model_parallel_comm_backend)
    new_groups("tp-dp-cp", dense.get_ranks("tp-dp-cp"))
    new_groups("tp-dp", dense.get_ranks("tp-dp"))
    new_groups("tp-cp", dense.get_ranks("tp-cp"))

    # Embedding group: the stages that hold a copy of the word embedding (first and last, for tied
    # embeddings across pipeline stages); position-embedding group: the first stage only.
    embedding_lists, position_lists = [], []
    for pp_ranks in dense.get_ranks("pp"):
        if get_embedding_ranks is not None:
            embedding_lists.append(list(get_embedding_ranks(pp_ranks)))
        else:
            embedding_lists.append([pp_ranks[0], pp_ranks[-1]] if len(pp_ranks) > 1 else [pp_ranks[0]])
        if get_position_embedding_ranks is not None:
            position_lists.append(list(get_position_embedding_ranks(pp_ranks)))
        else:
            position_lists.append([pp_ranks[0]])
    new_groups("embd", embedding_lists)
    new_groups("pos-embd", position_lists)

    new_groups("ep", expert.get_ranks("ep"))
    new_groups("etp", expert.get_ranks("tp"))
    new_groups("etp-ep", expert.get_ranks("tp-ep"))
    new_groups("etp-ep-pp", expert.get_ranks("tp-ep-pp"))
    new_groups("edp", expert.get_ranks("dp"))
    if create_gloo_process_groups and dist.get_backend() != "gloo":
        new_groups("edp-gloo", expert.get_ranks("dp"), backend="gloo")

    _ORDER = order
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_RANK = 0
        _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size


def model_parallel_is_initialized() -> bool:
    return "tp" in _GROUPS


def gloo_twin(ranks) -> "dist.ProcessGroup":
    """A gloo group of the global `ranks`, made by those ranks only the first time (no other rank need take
    part) and kept with the other groups until `destroy_model_parallel`, which frees its worker threads."""
    key = tuple(ranks)
    if key not in _GLOO_TWINS:
        _GLOO_TWINS[key] = dist.new_group(list(key), backend="gloo", use_local_synchronization=True)
    return _GLOO_TWINS[key]


def destroy_model_parallel() -> None:
    """Forgets every group (the process-group objects are released with them)."""
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE, _ORDER
    _GROUPS.clear()
    _GLOO_TWINS.clear()
    _VIRTUAL_PIPELINE_RANK = None
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    _ORDER = None


def _group(name: str):
    if name not in _GROUPS:
        raise RuntimeError(
            f"parallel group {name!r} is not initialised: call parallel_state.initialize_model_parallel first"
        )
    return _GROUPS[name][0]


def _ranks(name: str) -> list[int]:
    _group(name)
    return _GROUPS[name][1]


def _size(name: str) -> int:
    # Before initialisation every group is this rank alone, so layers work in a plain single process.
    return len(_ranks(name)) if model_parallel_is_initialized() else 1


def _rank(name: str) -> int:
    return _ranks(name).index(dist.get_rank()) if model_parallel_is_initialized() else 0


# --- tensor parallel -------------------------------------------------------------------------------------
def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp") if check_initialized or model_parallel_is_initialized() else None


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the rank that reads data and broadcasts it)."""
    return _ranks("tp")[0]


def get_tensor_model_parallel_ranks() -> list[int]:
    return _ranks("tp")


# --- pipeline parallel -----------------------------------------------------------------------------------
def get_pipeline_model_parallel_group():
    return _group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks("pp")
    return ranks[(ranks.index(dist.get_rank()) - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_rank():
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_model_parallel_rank(rank) -> None:
    global _VIRTUAL_PIPELINE_RANK
    _VIRTUAL_PIPELINE_RANK = rank


def get_virtual_pipeline_model_parallel_world_size():
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the stage that owns the embedding (for virtual stages: chunk 0 of PP rank 0)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None:
        chunk = _VIRTUAL_PIPELINE_RANK if vp_stage is None else vp_stage
        if chunk != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the stage that owns the output layer and the loss."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_WORLD_SIZE is not None:
        chunk = _VIRTUAL_PIPELINE_RANK if vp_stage is None else vp_stage
        if chunk != _VIRTUAL_PIPELINE_WORLD_SIZE - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# --- data and context parallel ---------------------------------------------------------------------------
def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    if partial_data_parallel:
        raise ValueError("partial data parallel groups are not supported yet")
    return _group("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_group_gloo(with_context_parallel: bool = False):
    """A gloo twin of the data-parallel group (the group itself when the default backend is gloo)."""
    name = "dp-cp" if with_context_parallel else "dp"
    return _GROUPS[name + "-gloo"][0] if name + "-gloo" in _GROUPS else _group(name)


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _ranks("dp-cp" if with_context_parallel else "dp")[0]


def get_context_parallel_group():
    return _group("cp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_context_parallel_global_ranks() -> list[int]:
    return _ranks("cp")


# --- combined groups -------------------------------------------------------------------------------------
def get_model_parallel_group():
    """TP x PP: the ranks that together hold one full model replica."""
    return _group("mp")


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    return _group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_tensor_and_context_parallel_group():
    return _group("tp-cp")


def get_embedding_group():
    return _group("embd")


def get_position_embedding_group():
    return _group("pos-embd")


def is_rank_in_embedding_group(ignore_virtual: bool = True) -> bool:
    return "embd" in _GROUPS and dist.get_rank() in _GROUPS["embd"][1]


def is_rank_in_position_embedding_group() -> bool:
    return "pos-embd" in _GROUPS and dist.get_rank() in _GROUPS["pos-embd"][1]


# --- expert parallel -------------------------------------------------------------------------------------
def get_expert_model_parallel_group():
    return _group("ep")


def get_expert_model_parallel_world_size() -> int:
    return _size("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep")


def get_expert_tensor_parallel_group():
    return _group("etp")


def get_expert_tensor_parallel_world_size() -> int:
    return _size("etp")


def get_expert_tensor_parallel_rank() -> int:
    return _rank("etp")


def get_expert_tensor_and_model_parallel_group():
    return _group("etp-ep")


def get_expert_tensor_model_pipeline_parallel_group():
    return _group("etp-ep-pp")


def get_expert_data_parallel_group():
    return _group("edp")


def get_expert_data_parallel_group_gloo():
    return _GROUPS["edp-gloo"][0] if "edp-gloo" in _GROUPS else _group("edp")


def get_expert_data_parallel_world_size() -> int:
    return _size("edp")


def get_expert_data_parallel_rank() -> int:
    return _rank("edp")


def collective_device():
    """Where small tensors for collectives must live: the current CUDA device under NCCL, else the CPU."""
    import torch

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
