"""--nccl-communicator-config-path and --high-priority-stream-groups: the file's settings reach the NCCL groups
they name, bad files are refused with the file and what is valid."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import nccl_settings, parallel_state
from megatron.core.nccl_settings import load_communicator_settings, process_group_options
from megatron.training.arguments import parse_args, validate_args


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "nccl.yaml"
    path.write_text(text)
    return str(path)


def test_settings_by_group_with_high_priority_streams(tmp_path):
    path = _write(tmp_path, "dp:\n  max_ctas: 8\n  min_ctas: 1\n  cga_cluster_size: 2\ntp:\n  net_name: IB\nhcp: {}\n")
    settings = load_communicator_settings(path, ["tp", "pp"])
    assert settings == {"dp": {"max_ctas": 8, "min_ctas": 1, "cga_cluster_size": 2},
                        "tp": {"net_name": "IB", "is_high_priority_stream": True},
                        "hcp": {}, "pp": {"is_high_priority_stream": True}}
    assert load_communicator_settings(None) == {} and process_group_options(None) is None


@pytest.mark.parametrize("text, message", [
    ("dp_typo:\n  max_ctas: 8\n", "'dp_typo' is not a process group name; valid: cp, dp, dp_cp"),
    ("dp:\n  max_cta: 8\n", "dp.max_cta is not an NCCL communicator setting; valid: cga_cluster_size"),
    ("dp:\n  max_ctas: eight\n", "dp.max_ctas must be int, got 'eight'"),
    ("dp:\n  max_ctas: 0\n", "dp.max_ctas must be at least 1"),
    ("tp:\n  net_name: nvlink\n", "tp.net_name 'nvlink' is not supported; use IB or socket"),
    ("- dp\n", "expected a mapping of process group names"),
    ("dp: [1, 2\n", "not valid YAML"),
])
def test_bad_files_are_refused_naming_what_is_valid(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")) as error:
        load_communicator_settings(path)
    assert path in str(error.value)


RUN = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
       "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128").split()


def test_flags_are_validated_with_the_run(tmp_path):
    with pytest.raises(ValueError, match="--nccl-communicator-config-path .*missing.yaml: cannot read it"):
        validate_args(parse_args(args_list=[*RUN, "--nccl-communicator-config-path", str(tmp_path / "missing.yaml")]))
    with pytest.raises(ValueError, match="--high-priority-stream-groups: 'data' is not a process group name"):
        validate_args(parse_args(args_list=[*RUN, "--high-priority-stream-groups", "dp", "data"]))
    args = validate_args(parse_args(args_list=[*RUN, "--high-priority-stream-groups", "dp_cp", "ep_dp"]))
    assert args.high_priority_stream_groups == ["dp_cp", "ep_dp"] and args.nccl_communicator_config_path is None


def test_nccl_groups_get_their_settings_and_gloo_groups_none(tmp_path, monkeypatch):
    """One process: the groups' NCCL options as initialize_model_parallel makes them, on an NCCL default backend
    (new_group and the options recorded, since this machine may have no NCCL) and on gloo."""
    path = _write(tmp_path, "dp:\n  max_ctas: 8\ntp:\n  min_ctas: 2\n")
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout, backend, pg_options: made.append(
        (backend, pg_options)) or object())
    monkeypatch.setattr(parallel_state, "process_group_options", lambda settings: settings and dict(settings))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        parallel_state.initialize_model_parallel(nccl_communicator_config_path=path,
                                                 high_priority_stream_groups=["ep_dp"])
        names = list(parallel_state._GROUPS)  # one group per name with one rank, in the order made
        assert len(made) == len(names)
        options = dict(zip(names, [pg_options for _, pg_options in made]))
        assert options["dp"] == {"max_ctas": 8} and options["tp"] == {"min_ctas": 2}
        assert options["edp"] == {"is_high_priority_stream": True}
        assert options["dp-gloo"] is None and options["dp-cp"] is None and options["pp"] is None
        made.clear()
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        parallel_state.initialize_model_parallel(nccl_communicator_config_path=path)
        assert made and all(pg_options is None for _, pg_options in made)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ProcessGroupNCCL)")
def test_options_carry_the_settings():
    options = process_group_options({"max_ctas": 8, "min_ctas": 2, "cga_cluster_size": 2,
                                     "is_high_priority_stream": True})
    assert (options.config.max_ctas, options.config.min_ctas, options.config.cga_cluster_size) == (8, 2, 2)
    assert options.is_high_priority_stream and nccl_settings.COMMUNICATOR_NAMES["edp"] == "ep_dp"
