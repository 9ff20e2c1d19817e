"""One framework's view of a checkpoint, on a CPU: builds the model, optimizer and scheduler of a
`pretrain_gpt.py` command line with that framework's own `setup_model_and_optimizer` (which resumes from
`--load` with its own `load_checkpoint`), and writes the state it resumed with, keyed the same way for both
frameworks (`load_check.py` compares them):

    python load_state.py --framework megatron|ours --argv '[...pretrain_gpt.py args...]' --out STATE.pt [--fixes]

Run with the framework's source first on PYTHONPATH (Megatron-LM's, or this project's).

Megatron-LM needs a GPU; here its code runs unchanged on a CPU under these stand-ins: tensors and modules
asked for on `cuda` are made on the CPU (a TorchFunctionMode rewrites the `device` of every torch call,
`.cuda()` returns the tensor), `Tensor.type()` reports the CUDA type names Megatron-LM's optimizers check,
streams are no-ops, and the CUDA generator is a 16-byte (seed, Philox offset) state that
`torch.cuda.manual_seed` sets, as on a GPU (and Python < 3.12 gets `typing.override`). Process groups are
gloo, world size 1 (both frameworks find torch.distributed started). `--fixes` installs
`megatron_fixes.py` first.

The state written (`STATE.pt`): `iteration`, `consumed_train_samples`, `floating_point_operations_so_far`,
`scheduler` (the scheduler's state dict), `separate_steps` (no two params share one Adam step tensor),
`params` {name: {model, main, exp_avg, exp_avg_sq (flattened fp32), step, lr, weight_decay, betas, eps}}
with names as in the model (wrappers' `module.` dropped), and `rng` (python, numpy and torch CPU generators
after the load; for Megatron-LM also its CUDA generator and tensor-parallel tracker, before and after the load).
On failure: {"error": the traceback}.
"""

import argparse
import contextlib
import json
import os
import random
import sys
import traceback
import typing

import numpy as np
import torch


class _Stream:
    """A CUDA stream that does nothing (every operation here is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _on_cpu(value):
    if isinstance(value, torch.device) and value.type == "cuda" or isinstance(value, str) and value.startswith("cuda"):
        return torch.device("cpu")
    return value


class _CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Every torch call that names a CUDA device gets the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {key: _on_cpu(value) if key == "device" else value for key, value in (kwargs or {}).items()}
        return func(*[_on_cpu(arg) for arg in args], **kwargs)


def install_cpu_stand_ins() -> None:
    """The CUDA stand-ins of the module docstring (before Megatron-LM is imported), and `typing.override`
    on Python < 3.12, which Megatron-LM imports."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    generator = {"state": torch.zeros(16, dtype=torch.uint8)}

    def manual_seed(seed):
        generator["state"] = torch.tensor([seed % 2**63, 0], dtype=torch.int64).view(torch.uint8).clone()

    def get_rng_state(device="cuda"):
        return generator["state"].clone()

    def set_rng_state(state, device="cuda"):
        generator["state"] = state.clone()

    cuda_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None:
            return cuda_type(self, dtype, non_blocking, **kwargs)
        name = cuda_type(self)  # may come back through the mode above, already renamed
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = manual_seed
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = set_rng_state
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, memory_format=None: self
    torch.Tensor.type = tensor_type
    _CudaOnCpu().__enter__()


def build_megatron(fixes: bool):
    """Megatron-LM's start-up of `pretrain_gpt.py` (arguments, process groups, seeds) and its
    setup_model_and_optimizer, which loads --load."""
    from functools import partial

    import megatron.core.tensor_parallel.random as tp_random
    import megatron.training.arguments as arguments
    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.training.initialize import _set_random_seed

    # Megatron-LM's tracker reads and writes the CUDA generator through these two, not torch.cuda's.
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.cuda.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.cuda.set_rng_state(state)
    arguments.get_device_arch_version = lambda: 9  # validate_args asks the GPU's architecture for TP > 1
    if fixes:
        import megatron_fixes

        megatron_fixes.apply()
    args = arguments.parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    _set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker, args.inference_rng_tracker)
    seeded = {"cuda": torch.cuda.get_rng_state(), "tracker": tp_random.get_cuda_rng_tracker().get_states()}

    from gpt_builders import gpt_builder
    from megatron.training.training import setup_model_and_optimizer
    from model_provider import model_provider

    model, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder,
                                                            partial(model_provider, gpt_builder))
    after = {"cuda": torch.cuda.get_rng_state(), "tracker": tp_random.get_cuda_rng_tracker().get_states()}
    return args, model, optimizer, scheduler, {"seeded": seeded, "loaded": after}


def build_ours():
    """This project's start-up of `pretrain_gpt.py` and its setup_model_and_optimizer (loads --load)."""
    from megatron.core.enums import ModelType
    from megatron.training.initialize import initialize_megatron
    from megatron.training.tasks.gpt import model_provider
    from megatron.training.training import setup_model_and_optimizer

    args = initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, ModelType.encoder_or_decoder)
    return args, model, optimizer, scheduler, {}


def _main_param(optimizer, param):
    """The fp32 tensor the inner optimizer updates for model param `param` (a flat shard under the
    distributed optimizer; at one data-parallel rank the whole param)."""
    if hasattr(optimizer, "model_param_group_index_map"):  # Megatron-LM's DistributedOptimizer
        group, order = optimizer.model_param_group_index_map[param]
        return optimizer.optimizer.param_groups[group]["params"][order]
    if hasattr(optimizer, "main_param_and_state"):  # this project's DistributedOptimizer
        return optimizer.main_param_and_state(param)["param"]
    for model_group, main_group in zip(getattr(optimizer, "float16_groups", []),
                                       getattr(optimizer, "fp32_from_float16_groups", [])):
        for model_param, main_param in zip(model_group, main_group):
            if model_param is param:
                return main_param
    return param


def _flat(tensor):
    return tensor.detach().float().reshape(-1).clone()


def canonical_state(args, model, optimizer, scheduler) -> dict:
    """The state the module docstring describes, from either framework's objects."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None and len(chained) != 1:
        raise ValueError(f"{len(chained)} chained optimizers: comparing more than one is not supported yet")
    inner = chained[0] if chained else optimizer
    groups = {id(param): group for group in inner.optimizer.param_groups for param in group["params"]}
    params, step_tensors = {}, []
    for chunk in model:
        for name, param in chunk.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            main = _main_param(inner, param)
            state = inner.optimizer.state.get(main, {})
            group = groups[id(main)]
            entry = {"model": _flat(param), "main": _flat(main),
                     **{key: _flat(state[key]) for key in ("exp_avg", "exp_avg_sq") if key in state},
                     "step": float(state["step"]) if "step" in state else None,
                     **{key: group[key] for key in ("lr", "weight_decay", "betas", "eps")}}
            params[name] = entry
            step_tensors += [state["step"]] if isinstance(state.get("step"), torch.Tensor) else []
    scheduler_state = {key: value for key, value in scheduler.state_dict().items()
                       if isinstance(value, (int, float, str)) or value is None}
    return {"iteration": args.iteration, "consumed_train_samples": args.consumed_train_samples,
            "floating_point_operations_so_far": args.num_floating_point_operations_so_far,
            "scheduler": scheduler_state, "params": params,
            # Adam advances each param's step tensor: one tensor shared by several params is advanced by each.
            "separate_steps": len({id(step) for step in step_tensors}) == len(step_tensors),
            "rng": {"random": random.getstate(), "numpy": np.random.get_state()[1].copy(),
                    "torch": torch.get_rng_state()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("megatron", "ours"), required=True)
    parser.add_argument("--argv", required=True, help="the pretrain_gpt.py arguments, a JSON list")
    parser.add_argument("--out", required=True)
    parser.add_argument("--fixes", action="store_true", help="install megatron_fixes.py (Megatron-LM only)")
    options = parser.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    sys.argv = ["pretrain_gpt.py", *json.loads(options.argv)]
    store = options.out + ".store"  # a file, not a port: several of these may run at once
    if os.path.exists(store):
        os.remove(store)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        if options.framework == "megatron":
            install_cpu_stand_ins()
            args, model, optimizer, scheduler, cuda_rng = build_megatron(options.fixes)
        else:
            args, model, optimizer, scheduler, cuda_rng = build_ours()
        state = canonical_state(args, model, optimizer, scheduler)
        state["rng"]["cuda"] = cuda_rng
    except Exception:
        torch.save({"error": traceback.format_exc()}, options.out)
        raise SystemExit(1)
    torch.save(state, options.out)


if __name__ == "__main__":
    main()
