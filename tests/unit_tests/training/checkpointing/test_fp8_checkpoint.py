"""FP8 scaling state through save_checkpoint / load_checkpoint on one rank, in both formats: it is saved as
each FP8 linear's `_extra_state`, a resumed run continues exactly (so the state came back: with scales
reset to 1 the losses differ), and runs switch precision across a checkpoint (an FP8 checkpoint loads into a
bf16 run, a bf16 one into an FP8 run with fresh scales).

With --fp8-param-gather (weights stored in FP8, the distributed optimizer): the checkpoint holds those weights
in bf16 (their FP8 values), a resumed run continues bitwise, and with an optimizer state that does not depend
on the buffers (torch_dist, --dist-ckpt-optim-fully-reshardable) a run without the flag resumes from it, and a
run with the flag from one without, bitwise as well (the FP8 weights are cast again from the exact main
params). The optimizer layouts of the buffers (torch's distrib_optim.pt, dp_reshardable) differ with the
flag (the FP8 weights have a buffer of their own): loading across is refused naming the flag."""

import os

import pytest
import torch

from megatron.core.fp8.params import dequantize_fp8_param
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.training.checkpointing.tiny_run import build_run, make_args, seed_everything, train_steps

pytestmark = pytest.mark.usefixtures("single_rank")

FP8 = ("--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max")
FP8_LINEARS = [f"decoder.layers.{layer}.{name}._extra_state" for layer in (0, 1)
               for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                            "mlp.linear_fc2")]


def _fp8_states(model) -> dict:
    return {name: value.clone() for name, value in model.state_dict().items() if name.endswith("_extra_state")}


def _saved_run(directory, ckpt_format: str, *precision):
    """A run trained 2 steps and saved; returns (its FP8 states at the save, its next 3 losses)."""
    args = make_args(*precision, "--ckpt-format", ckpt_format, "--save", directory)
    model, optimizer, scheduler = build_run(args, 1234)
    train_steps(model, optimizer, scheduler, args, 0, 2)
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    return _fp8_states(model), train_steps(model, optimizer, scheduler, args, 2, 3)


def _loaded_run(directory, ckpt_format: str, *precision):
    args = make_args(*precision, "--ckpt-format", ckpt_format, "--load", directory)
    model, optimizer, scheduler = build_run(args, seed=99)
    seed_everything(7)
    load_checkpoint([model], optimizer, scheduler, args=args)
    return model, optimizer, scheduler, args


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_fp8_run_resumes_exactly_with_its_scaling_state(tmp_path, ckpt_format):
    saved_states, expected = _saved_run(tmp_path, ckpt_format, *FP8)
    assert sorted(saved_states) == sorted(FP8_LINEARS)
    for state in saved_states.values():  # [1 + 4, 3]: scales moved off 1, one step of amax history
        assert state.shape == (5, 3) and (state[0] != 1).all() and (state[1] == 0).all() and (state[-1] > 0).all()
    model, optimizer, scheduler, args = _loaded_run(tmp_path, ckpt_format, *FP8)
    loaded_states = _fp8_states(model)
    for name, state in saved_states.items():
        assert torch.equal(loaded_states[name], state), name
    assert train_steps(model, optimizer, scheduler, args, 2, 3) == expected


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_fp8_checkpoint_loads_into_a_bf16_run(tmp_path, ckpt_format):
    _saved_run(tmp_path, ckpt_format, *FP8)
    model, optimizer, scheduler, args = _loaded_run(tmp_path, ckpt_format, "--bf16")
    assert _fp8_states(model) == {}
    assert all(torch.isfinite(torch.tensor(train_steps(model, optimizer, scheduler, args, 2, 1))))


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_bf16_checkpoint_loads_into_an_fp8_run_with_fresh_scales(tmp_path, ckpt_format):
    _saved_run(tmp_path, ckpt_format, "--bf16")
    model, optimizer, scheduler, args = _loaded_run(tmp_path, ckpt_format, *FP8)
    for state in _fp8_states(model).values():
        assert (state[0] == 1).all() and (state[1:] == 0).all()
    assert all(torch.isfinite(torch.tensor(train_steps(model, optimizer, scheduler, args, 2, 1))))


def test_another_amax_history_length_is_refused_by_name(tmp_path):
    _saved_run(tmp_path, "torch", *FP8)
    with pytest.raises(RuntimeError, match="linear_qkv._extra_state: saved FP8 scaling state \\(5, 3\\) does not "
                                           "fit this run's \\(9, 3\\) = \\(1 \\+ fp8_amax_history_len 8, 3\\)"):
        _loaded_run(tmp_path, "torch", *FP8, "--fp8-amax-history-len", "8")


FP8_PARAMS = (*FP8, "--use-distributed-optimizer", "--fp8-param-gather")
RESHARDABLE = ("--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable")


def _resumed_losses(directory, *flags) -> list:
    model, optimizer, scheduler, args = _loaded_run(directory, flags[flags.index("--ckpt-format") + 1], *flags)
    return train_steps(model, optimizer, scheduler, args, 2, 3)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_fp8_param_gather_run_resumes_exactly(tmp_path, ckpt_format):
    args = make_args(*FP8_PARAMS, "--ckpt-format", ckpt_format, "--save", tmp_path)
    model, optimizer, scheduler = build_run(args, 1234)
    train_steps(model, optimizer, scheduler, args, 0, 2)
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    gpt = model.module.module  # DistributedDataParallel(Float16Module(GPTModel))
    weights = {name: dequantize_fp8_param(param) for name, param in gpt.named_parameters()
               if param.dtype == torch.float8_e4m3fn}
    assert len(weights) == 8
    expected = train_steps(model, optimizer, scheduler, args, 2, 3)
    if ckpt_format == "torch":
        saved = torch.load(os.path.join(tmp_path, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"),
                           map_location="cpu", weights_only=False)["model"]
        for name, value in weights.items():
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], value), name
    assert _resumed_losses(tmp_path, *FP8_PARAMS, "--ckpt-format", ckpt_format) == expected


@pytest.mark.parametrize("saved_with, loaded_with", [(("--fp8-param-gather",), ()), ((), ("--fp8-param-gather",))],
                         ids=["with-then-without", "without-then-with"])
def test_fp8_param_gather_on_either_side_of_a_reshardable_checkpoint(tmp_path, saved_with, loaded_with):
    flags = (*FP8, "--use-distributed-optimizer", *RESHARDABLE)
    expected = _saved_run(tmp_path, "torch_dist", *flags, *saved_with)[1]
    assert _resumed_losses(tmp_path, *flags, *loaded_with) == expected


def test_buffer_layouts_of_the_optimizer_name_the_flag(tmp_path):
    _saved_run(tmp_path, "torch", *FP8_PARAMS)
    with pytest.raises(ValueError, match="The checkpoint was saved with --fp8-param-gather, this run is without it"):
        _loaded_run(tmp_path, "torch", *FP8, "--use-distributed-optimizer")
