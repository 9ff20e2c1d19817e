"""NCCL settings per communicator: Megatron-Core's `nccl_communicator_config_path` (`--nccl-communicator-config-path`)
and `high_priority_stream_groups` (`--high-priority-stream-groups`).

The YAML file maps Megatron-Core's name of a process group to settings of the NCCL communicators made for it:

    dp:                           # the data-parallel groups
      max_ctas: 8                 # at most 8 thread blocks (CTAs) per collective kernel
      min_ctas: 1
      cga_cluster_size: 2
    tp:
      is_high_priority_stream: true
    pp:
      net_name: IB                # IB or socket

Why: a collective overlapped with compute (the distributed optimizer's reduce-scatters during backward, its
all-gathers during forward) runs its kernels on the SMs the GEMMs use; capping its CTAs leaves them more SMs
while its bandwidth may still hide it behind the compute, and a high-priority stream gets its kernels scheduled
first. A setting left out keeps NCCL's default (on Hopper, per Megatron-Core: cga_cluster_size 4, max_ctas 32,
min_ctas 1). `--high-priority-stream-groups dp tp` sets is_high_priority_stream for the named groups on top of
the file.

Names: those of the groups this implementation builds (`COMMUNICATOR_NAMES`, Megatron-Core's spelling of
parallel_state's groups). A Megatron-Core name of a group not built here (`UNBUILT_NAMES`, e.g. `hcp` for
hierarchical context parallelism) is accepted and used by nothing, as Megatron-Core ignores names it has no
group for; any other name, and any other key, is an error naming the file and what is valid. The settings are
NCCL's: groups on gloo (CPU runs, the gloo twins of the data-parallel groups) are made without them.
"""

from typing import Iterable, Optional

import torch.distributed as dist

# parallel_state's group name -> Megatron-Core's (the key in the file).
COMMUNICATOR_NAMES = {
    "dp": "dp", "dp-cp": "dp_cp", "cp": "cp", "mp": "mp", "tp": "tp", "pp": "pp", "tp-dp-cp": "tp_dp_cp",
    "tp-dp": "tp_dp", "tp-cp": "tp_cp", "embd": "embd", "pos-embd": "pos_embd", "ep": "ep", "etp": "ep_tp",
    "etp-ep": "tp_ep_mp", "etp-ep-pp": "tp_ep_pp", "edp": "ep_dp",
}
UNBUILT_NAMES = ("hcp", "intra_dp_cp", "intra_ep_dp", "inter_ep_dp", "intra_dist_opt_instance", "gtp_remat",
                 "gtp_remat_dp", "gtp_remat_dp_cp", "expt_gtp_remat", "tp_ep_gtp_remat_pp", "ep_gtp_remat_dp")
SETTING_TYPES = {"cga_cluster_size": int, "max_ctas": int, "min_ctas": int, "net_name": str,
                 "is_high_priority_stream": bool}
NET_NAMES = ("ib", "socket")


def _check_group(name, where: str) -> None:
    if name not in COMMUNICATOR_NAMES.values() and name not in UNBUILT_NAMES:
        raise ValueError(f"{where}: {name!r} is not a process group name; valid: "
                         f"{', '.join(sorted(COMMUNICATOR_NAMES.values()))} (and Megatron-Core's unbuilt "
                         f"{', '.join(UNBUILT_NAMES)})")


def _check_settings(name: str, settings, path: str) -> None:
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: the settings of {name!r} must be a mapping of {', '.join(SETTING_TYPES)}, "
                         f"got {settings!r}")
    for key, value in settings.items():
        expected = SETTING_TYPES.get(key)
        if expected is None:
            raise ValueError(f"{path}: {name}.{key} is not an NCCL communicator setting; valid: "
                             f"{', '.join(SETTING_TYPES)}")
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"{path}: {name}.{key} must be {expected.__name__}, got {value!r}")
        if key == "net_name" and value.lower() not in NET_NAMES:
            raise ValueError(f"{path}: {name}.net_name {value!r} is not supported; use IB or socket")
        if expected is int and value < 1:
            raise ValueError(f"{path}: {name}.{key} must be at least 1, got {value}")


def load_communicator_settings(path: Optional[str], high_priority_groups: Iterable[str] = ()) -> dict:
    """{Megatron-Core group name: {setting: value}} from the YAML file at `path` (None: no file), with
    is_high_priority_stream set for each of `high_priority_groups`. Raises ValueError naming the file, group or
    setting that is not valid (module docstring)."""
    settings = {}
    if path is not None:
        import yaml  # imported here: a run without the file needs no YAML parser

        try:
            with open(path) as stream:
                loaded = yaml.safe_load(stream)
        except OSError as error:
            raise ValueError(f"--nccl-communicator-config-path {path}: cannot read it ({error.strerror})") from None
        except yaml.YAMLError as error:
            raise ValueError(f"--nccl-communicator-config-path {path}: not valid YAML ({error})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of process group names to NCCL settings, got "
                             f"{type(loaded).__name__}")
        for name, group_settings in loaded.items():
            _check_group(name, path)
            _check_settings(name, group_settings, path)
            settings[name] = dict(group_settings)
    for name in high_priority_groups:
        _check_group(name, "--high-priority-stream-groups")
        settings.setdefault(name, {})["is_high_priority_stream"] = True
    return settings


def process_group_options(settings: Optional[dict]):
    """`ProcessGroupNCCL.Options` carrying one group's settings, or None for none (NCCL's defaults)."""
    if not settings:
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=settings.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in settings:
            setattr(options.config, key, settings[key])
    return options
