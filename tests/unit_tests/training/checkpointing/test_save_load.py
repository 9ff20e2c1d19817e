"""Save, then load into a freshly built GPTModel + optimizer + scheduler: every state comes back bit for
bit, and training on equals training without the interruption."""

import copy
import os

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.training.checkpointing.tiny_run import (
    BATCH_SIZE,
    VOCAB_SIZE,
    assert_same,
    build_run,
    make_args,
    model_state,
    rng_snapshot,
    seed_everything,
    train_steps,
)

pytestmark = pytest.mark.usefixtures("single_rank")

PRECISIONS = [pytest.param((), id="fp32"), pytest.param(("--bf16",), id="bf16")]


def _snapshot(model, optimizer, scheduler, args) -> dict:
    return {
        "model": model_state(model),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
        "rng": rng_snapshot(),
        "counters": (args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples),
    }


def _trained_and_saved(directory, flags=(), steps=3, seed=1234):
    """A run trained `steps` steps and saved at iteration `steps`; returns it with its snapshot at the save."""
    args = make_args("--save", directory, *flags)
    model, optimizer, scheduler = build_run(args, seed)
    train_steps(model, optimizer, scheduler, args, 0, steps)
    args.consumed_valid_samples, args.skipped_train_samples = 8, 4
    before = _snapshot(model, optimizer, scheduler, args)
    save_checkpoint(steps, [model], optimizer, scheduler, 1.5e12, args=args)
    return (model, optimizer, scheduler, args), before


def _fresh(directory, *flags):
    """A new run with other weights and other RNG states, pointed at `directory` with --load."""
    args = make_args("--load", directory, *flags)
    model, optimizer, scheduler = build_run(args, seed=99)
    seed_everything(7)
    return model, optimizer, scheduler, args


@pytest.mark.parametrize("precision", PRECISIONS)
def test_save_changes_nothing_and_load_restores_everything_bitwise(tmp_path, precision):
    (model, optimizer, scheduler, args), before = _trained_and_saved(tmp_path, precision)
    assert_same(_snapshot(model, optimizer, scheduler, args), before, "after save")

    fresh_model, fresh_optimizer, fresh_scheduler, fresh_args = _fresh(tmp_path, *precision)
    assert load_checkpoint([fresh_model], fresh_optimizer, fresh_scheduler, args=fresh_args) == (3, 1.5e12)
    assert_same(_snapshot(fresh_model, fresh_optimizer, fresh_scheduler, fresh_args), before, "loaded")
    if precision:
        main_params = [p for group in fresh_optimizer.fp32_from_float16_groups for p in group]
        assert all(param.dtype == torch.float32 for param in main_params)
        assert_same(main_params, [p for group in optimizer.fp32_from_float16_groups for p in group], "main params")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_after_load_equals_uninterrupted_training(tmp_path, precision):
    args = make_args(*precision)
    model, optimizer, scheduler = build_run(args, seed=1234)
    expected_losses = train_steps(model, optimizer, scheduler, args, 0, 5)
    expected = _snapshot(model, optimizer, scheduler, args)

    _trained_and_saved(tmp_path, precision)
    fresh_model, fresh_optimizer, fresh_scheduler, fresh_args = _fresh(tmp_path, *precision)
    load_checkpoint([fresh_model], fresh_optimizer, fresh_scheduler, args=fresh_args)
    fresh_args.consumed_valid_samples, fresh_args.skipped_train_samples = 0, 0
    losses = train_steps(fresh_model, fresh_optimizer, fresh_scheduler, fresh_args, 3, 2)
    assert losses == expected_losses[3:]
    assert_same(_snapshot(fresh_model, fresh_optimizer, fresh_scheduler, fresh_args), expected, "resumed")


def test_file_holds_megatrons_state_dict(tmp_path):
    (model, optimizer, scheduler, args), _ = _trained_and_saved(tmp_path, ("--bf16",))
    state = torch.load(tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert set(state) == {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                          "rng_state", "num_floating_point_operations_so_far"}
    assert (state["checkpoint_version"], state["iteration"], state["num_floating_point_operations_so_far"]) == (3.0, 3,
                                                                                                              1.5e12)
    assert state["args"].consumed_train_samples == 3 * BATCH_SIZE and state["args"].consumed_valid_samples == 8
    # Saved from inside the Float16Module: the bare GPTModel's keys, no `module.` prefix.
    bare = GPTModel(core_transformer_config_from_args(args), get_gpt_layer_local_spec(), VOCAB_SIZE, 16)
    linears = [f"decoder.layers.{layer}.{name}" for layer in (0, 1)
               for name in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                            "mlp.linear_fc2")] + ["output_layer"]
    # Megatron-Core's order: linear_proj before linear_qkv, each linear's _extra_state after its params.
    assert set(state["model"]) == set(bare.state_dict()) | {f"{name}._extra_state" for name in linears}
    assert all(state["model"][f"{name}._extra_state"] is None for name in linears)
    assert list(state["model"])[4:7] == ["decoder.layers.0.self_attention.linear_proj.weight",
                                         "decoder.layers.0.self_attention.linear_proj.bias",
                                         "decoder.layers.0.self_attention.linear_proj._extra_state"]
    assert set(state["optimizer"]) == {"optimizer", "fp32_from_fp16_params"}
    assert set(state["opt_param_scheduler"]) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style",
                                                 "lr_decay_steps", "min_lr", "start_wd", "end_wd", "wd_incr_style",
                                                 "wd_incr_steps"}
    assert len(state["rng_state"]) == 1
    generators = {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"}
    # Written on a CPU: CUDA states of the seeds for a GPU run (Megatron-LM needs them), the CPU streams apart.
    assert set(state["rng_state"][0]) == generators | {"cuda_rng_state"} | (
        set() if torch.cuda.is_available() else {"cpu_rng_tracker_states"})
    assert set(state["rng_state"][0]["rng_tracker_states"]) == {"model-parallel-rng", "data-parallel-rng",
                                                                "expert-parallel-rng"}
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_no_save_optim_and_rng_leave_them_out_and_loading_them_asks_for_the_flags(tmp_path):
    _trained_and_saved(tmp_path, ("--no-save-optim", "--no-save-rng"))
    state = torch.load(tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert not {"optimizer", "opt_param_scheduler", "rng_state"} & set(state)
    model, optimizer, scheduler, args = _fresh(tmp_path)
    with pytest.raises(ValueError, match="has no optimizer or opt_param_scheduler state .*--no-save-optim.*pass --no-load-optim"):
        load_checkpoint([model], optimizer, scheduler, args=args)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--no-load-optim")
    with pytest.raises(ValueError, match="has no RNG state .*--no-save-rng.*pass --no-load-rng"):
        load_checkpoint([model], optimizer, scheduler, args=args)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--no-load-optim", "--no-load-rng")
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 3


@pytest.mark.parametrize("precision", PRECISIONS)
def test_no_load_optim_loads_model_rng_and_counters_only(tmp_path, precision):
    _, before = _trained_and_saved(tmp_path, precision)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--no-load-optim", *precision)
    fresh_scheduler_state = scheduler.state_dict()
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 3
    after = _snapshot(model, optimizer, scheduler, args)
    assert_same(after["model"], before["model"])
    assert_same(after["rng"], before["rng"])
    assert after["counters"] == before["counters"]
    assert not optimizer.state and scheduler.state_dict() == fresh_scheduler_state
    if precision:
        # The fp32 main params were refreshed from the loaded bf16 weights.
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                assert torch.equal(main_param, model_param.float())


def test_no_load_rng_keeps_this_runs_generators_and_then_training_differs(tmp_path):
    args = make_args()
    model, optimizer, scheduler = build_run(args, seed=1234)
    expected_losses = train_steps(model, optimizer, scheduler, args, 0, 5)

    _, before = _trained_and_saved(tmp_path)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--no-load-rng")
    own_rng = rng_snapshot()
    load_checkpoint([model], optimizer, scheduler, args=args)
    assert_same(rng_snapshot(), own_rng, "rng")
    assert_same(model_state(model), before["model"])
    # The dropout masks now differ, so does the loss: the resume test above really depends on the RNG.
    assert train_steps(model, optimizer, scheduler, args, 3, 2) != expected_losses[3:]


def test_finetune_loads_the_model_only_and_starts_at_iteration_0(tmp_path):
    _, before = _trained_and_saved(tmp_path)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--finetune")
    own_rng = rng_snapshot()
    assert load_checkpoint([model], optimizer, scheduler, args=args) == (0, 1.5e12)
    assert_same(model_state(model), before["model"])
    assert_same(rng_snapshot(), own_rng, "rng")
    assert not optimizer.state and scheduler.num_steps == 0
    assert (args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples) == (0, 0, 0)


def test_release_checkpoint_starts_at_iteration_0_with_the_model_only(tmp_path):
    args = make_args("--save", tmp_path)
    model, optimizer, scheduler = build_run(args, seed=1234)
    train_steps(model, optimizer, scheduler, args, 0, 2)
    saved = model_state(model)
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, release=True, args=args)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt").is_file()

    model, optimizer, scheduler, args = _fresh(tmp_path)
    own_rng = rng_snapshot()
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 0
    assert_same(model_state(model), saved)
    assert_same(rng_snapshot(), own_rng, "rng")
    assert not optimizer.state and args.consumed_train_samples == 2 * BATCH_SIZE


def test_ckpt_step_picks_an_older_iteration(tmp_path):
    args = make_args("--save", tmp_path)
    model, optimizer, scheduler = build_run(args, seed=1234)
    train_steps(model, optimizer, scheduler, args, 0, 2)
    at_2 = model_state(model)
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    train_steps(model, optimizer, scheduler, args, 2, 2)
    save_checkpoint(4, [model], optimizer, scheduler, 0.0, args=args)

    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-step", 2)
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 2
    assert_same(model_state(model), at_2)
    assert args.consumed_train_samples == 2 * BATCH_SIZE
    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-step", 3)
    with pytest.raises(FileNotFoundError, match=r"--ckpt-step 3: .* has no iter_0000003; saved iterations: \[2, 4\]"):
        load_checkpoint([model], optimizer, scheduler, args=args)


def test_no_checkpoint_starts_from_scratch_or_stops_when_asked(tmp_path, capsys):
    model, optimizer, scheduler, args = _fresh(tmp_path)
    initial = model_state(model)
    assert load_checkpoint([model], optimizer, scheduler, args=args) == (0, 0)
    assert "will not load any checkpoints and will start from random" in capsys.readouterr().out
    assert_same(model_state(model), initial)
    args.exit_on_missing_checkpoint = True
    with pytest.raises(FileNotFoundError, match="--exit-on-missing-checkpoint: .*latest_checkpointed_iteration.txt"):
        load_checkpoint([model], optimizer, scheduler, args=args)


def test_pretrained_checkpoint_is_used_when_load_has_none(tmp_path):
    _, before = _trained_and_saved(tmp_path / "pretrained")
    model, optimizer, scheduler, args = _fresh(tmp_path / "empty", "--pretrained-checkpoint", tmp_path / "pretrained")
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 0
    assert args.finetune and not optimizer.state
    assert_same(model_state(model), before["model"])
    model, optimizer, scheduler, args = _fresh(tmp_path / "empty", "--pretrained-checkpoint", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no checkpoint in the load directory"):
        load_checkpoint([model], optimizer, scheduler, args=args)


def test_several_model_chunks_are_saved_as_model0_model1(tmp_path):
    args = make_args("--save", tmp_path, "--load", tmp_path)
    chunks = [build_run(args, seed)[0] for seed in (1, 2)]
    save_checkpoint(1, chunks, None, None, 0.0, args=args)
    state = torch.load(tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert {"model0", "model1"} <= set(state) and "model" not in state
    fresh = [build_run(args, seed)[0] for seed in (3, 4)]
    args.no_load_optim = True
    load_checkpoint(fresh, None, None, args=args)
    for loaded, saved in zip(fresh, chunks):
        assert_same(model_state(loaded), model_state(saved))
    with pytest.raises(ValueError, match=r"has no 'model' entry \(it holds \['model0', 'model1'\]\)"):
        load_checkpoint(fresh[0], None, None, args=args)


def _rewrite(directory, iteration, edit):
    path = os.path.join(directory, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


def test_checkpoints_without_counters_count_iteration_times_global_batch(tmp_path):
    _trained_and_saved(tmp_path)

    def forget_counters(state):
        for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
            delattr(state["args"], name)

    _rewrite(tmp_path, 3, forget_counters)
    model, optimizer, scheduler, args = _fresh(tmp_path)
    load_checkpoint([model], optimizer, scheduler, args=args)
    assert (args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples) == (
        3 * args.global_batch_size, 0, 0)


def test_checkpoint_versions_before_2_are_refused(tmp_path):
    _trained_and_saved(tmp_path)
    _rewrite(tmp_path, 3, lambda state: state.update(checkpoint_version=1.0))
    model, optimizer, scheduler, args = _fresh(tmp_path)
    with pytest.raises(ValueError, match="checkpoint_version 1.0: the QKV layout of versions below 2.0 is not supported"):
        load_checkpoint([model], optimizer, scheduler, args=args)


def test_scheduler_flags_decide_between_checkpoint_and_command_line(tmp_path):
    _, before = _trained_and_saved(tmp_path)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--lr", "5e-3")
    with pytest.raises(ValueError, match="--override-opt-param-scheduler"):
        load_checkpoint([model], optimizer, scheduler, args=args)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--lr", "5e-3", "--override-opt-param-scheduler")
    load_checkpoint([model], optimizer, scheduler, args=args)
    assert scheduler.max_lr == 5e-3 and scheduler.num_steps == before["scheduler"]["num_steps"]
    model, optimizer, scheduler, args = _fresh(tmp_path, "--lr", "5e-3", "--use-checkpoint-opt-param-scheduler")
    load_checkpoint([model], optimizer, scheduler, args=args)
    assert scheduler.max_lr == 1e-2


def test_other_checkpoint_formats_are_refused(tmp_path):
    model, optimizer, scheduler, args = _fresh(tmp_path)
    args.ckpt_format = "torch_dcp"
    with pytest.raises(ValueError, match="--ckpt-format torch_dcp is not supported yet"):
        load_checkpoint([model], optimizer, scheduler, args=args)
    args.save = str(tmp_path)
    with pytest.raises(ValueError, match="--ckpt-format torch_dcp is not supported yet"):
        save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)

    args.ckpt_format = "torch"
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000005" / "__0_0.distcp").write_bytes(b"")  # a torch_dist save cut before metadata.json
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(ValueError, match="iter_0000005 is an incompletely written distributed checkpoint"):
        load_checkpoint([model], optimizer, scheduler, args=args)
