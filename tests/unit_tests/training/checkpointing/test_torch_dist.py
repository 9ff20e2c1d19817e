"""--ckpt-format torch_dist through save_checkpoint / load_checkpoint on one rank: the directory Megatron-LM
writes (metadata.json and the DCP files, with the common state inside) and what the inspector reports of it, an exact resume (model, bf16 main params, Adam, scheduler,
RNG, counters), --async-save (a snapshot; "latest" only once finalised, blocking or polled), loading either
format whatever --ckpt-format says (as Megatron-LM main) and --ckpt-convert-format."""

import json
import os
import time

import pytest

from megatron.training.checkpointing.dist_saving import finalize_async_save
from megatron.training.checkpointing.format_conversion import save_in_converted_format
from megatron.training.checkpointing.loading import load_train_state
from megatron.training.checkpointing.conversion.inspect_checkpoint import describe_checkpoint
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.training.checkpointing.tiny_run import (
    assert_same,
    build_run,
    make_args,
    model_state,
    seed_everything,
    train_steps,
)

pytestmark = pytest.mark.usefixtures("single_rank")


def _tracker(directory) -> str:
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as tracker:
        return tracker.read()


def _fresh(directory, *flags):
    args = make_args("--bf16", "--load", directory, *flags)
    model, optimizer, scheduler = build_run(args, seed=99)
    seed_everything(7)
    return model, optimizer, scheduler, args


def test_resume_from_torch_dist_continues_exactly(tmp_path):
    args = make_args("--bf16", "--ckpt-format", "torch_dist", "--save", tmp_path)
    model, optimizer, scheduler = build_run(args, 1234)
    train_steps(model, optimizer, scheduler, args, 0, 2)
    save_checkpoint(2, [model], optimizer, scheduler, 3.0e12, args=args)
    expected = train_steps(model, optimizer, scheduler, args, 2, 3)

    assert sorted(os.listdir(tmp_path / "iter_0000002")) == [".metadata", "__0_0.distcp", "metadata.json"]
    metadata = json.loads((tmp_path / "iter_0000002" / "metadata.json").read_text())
    assert metadata == {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    assert _tracker(tmp_path) == "2"
    report = describe_checkpoint(str(tmp_path))
    # The layers' tensors stack into one global tensor per name (2 layers: 12 per layer + 5 outside); each has
    # two Adam moments and an fp32 main copy (bf16); 4 linears per layer have an _extra_state object.
    tensors = 12 + 5
    for line in ("(torch_dist: global tensors", "iteration: 2", "files: 1 shard file(s) (__0_0.distcp), metadata.json",
                 "sharded objects: rng_state/shard_0.0_1.1 (and 8 _extra_state)",
                 "decoder.layers.mlp.linear_fc1.weight                         (2, 64, 32)",
                 "decoder.layers.self_attention.linear_qkv.layer_norm_weight", f"model: {tensors} global tensors",
                 f"optimizer state: exp_avg x {tensors}, exp_avg_sq x {tensors}, fp32_param x {tensors}"):
        assert line in report, line

    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-format", "torch_dist")
    assert load_checkpoint([model], optimizer, scheduler, args=args) == (2, 3.0e12)
    assert args.consumed_train_samples == 8
    assert train_steps(model, optimizer, scheduler, args, 2, 3) == expected


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_muon_resume_continues_exactly(tmp_path, ckpt_format):
    # Muon's momentum of the matrices, Adam's moments and step of the rest, the fp32 main params.
    flags = ("--optimizer", "muon", "--ckpt-format", ckpt_format)
    args = make_args("--bf16", *flags, "--save", tmp_path)
    model, optimizer, scheduler = build_run(args, 1234)
    train_steps(model, optimizer, scheduler, args, 0, 2)
    save_checkpoint(2, [model], optimizer, scheduler, 3.0e12, args=args)
    expected = train_steps(model, optimizer, scheduler, args, 2, 3)
    if ckpt_format == "torch_dist":
        report = describe_checkpoint(str(tmp_path))
        assert "momentum_buffer x 5" in report and "exp_avg x 12" in report, report

    model, optimizer, scheduler, args = _fresh(tmp_path, *flags)
    assert load_checkpoint([model], optimizer, scheduler, args=args) == (2, 3.0e12)
    assert train_steps(model, optimizer, scheduler, args, 2, 3) == expected


def test_async_save_writes_a_snapshot_and_is_latest_once_finalised(tmp_path):
    args = make_args("--bf16", "--ckpt-format", "torch_dist", "--async-save", "--save", tmp_path)
    model, optimizer, scheduler = build_run(args, 1234)
    train_steps(model, optimizer, scheduler, args, 0, 1)
    save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)
    saved = model_state(model)
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()
    train_steps(model, optimizer, scheduler, args, 1, 1)  # changes the weights while the thread writes
    # The training loop polls without blocking: the tracker flips once the write has finished.
    for _ in range(1200):
        finalize_async_save(blocking=False)
        if (tmp_path / "latest_checkpointed_iteration.txt").exists():
            break
        time.sleep(0.05)
    assert _tracker(tmp_path) == "1"
    finalize_async_save()  # nothing left to finish

    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-format", "torch_dist")
    load_checkpoint([model], optimizer, scheduler, args=args)
    assert_same(model_state(model), saved)


def test_either_format_loads_and_converts(tmp_path):
    args = make_args("--bf16", "--save", tmp_path / "torch")
    model, optimizer, scheduler = build_run(args, 1234)
    train_steps(model, optimizer, scheduler, args, 0, 1)
    save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)
    saved = model_state(model)

    # As in Megatron-LM main, a torch checkpoint loads under --ckpt-format torch_dist (the format this run saves).
    model, optimizer, scheduler, args = _fresh(tmp_path / "torch", "--ckpt-format", "torch_dist")
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 1
    assert_same(model_state(model), saved)

    model, optimizer, scheduler, args = _fresh(tmp_path / "torch", "--ckpt-format", "torch_dist",
                                               "--auto-detect-ckpt-format", "--ckpt-convert-format", "torch_dist",
                                               "--ckpt-convert-save", tmp_path / "converted")
    state = load_train_state([model], optimizer, scheduler, args)
    assert_same(model_state(model), saved)
    save_in_converted_format(args, [model], optimizer, scheduler, state)
    assert args.save == str(tmp_path / "converted" / "torch_dist")

    model, optimizer, scheduler, args = _fresh(tmp_path / "converted" / "torch_dist", "--ckpt-format", "torch_dist")
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 1
    assert_same(model_state(model), saved)


def test_a_checkpoint_without_rng_or_optimizer_names_the_flag_to_pass(tmp_path):
    args = make_args("--bf16", "--ckpt-format", "torch_dist", "--save", tmp_path, "--no-save-rng", "--no-save-optim")
    model, optimizer, scheduler = build_run(args, 1234)
    save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-format", "torch_dist")
    with pytest.raises(ValueError, match="no RNG state \\(it was saved with --no-save-rng\\); pass --no-load-rng"):
        load_checkpoint([model], optimizer, scheduler, args=args)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-format", "torch_dist", "--no-load-rng")
    with pytest.raises(ValueError, match="has no optimizer state \\(was it saved with --no-save-optim\\?\\); pass "
                                         "--no-load-optim"):
        load_checkpoint([model], optimizer, scheduler, args=args)
    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-format", "torch_dist", "--no-load-rng",
                                               "--no-load-optim")
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 1


def test_verify_integrity_writes_a_manifest_and_refuses_a_changed_file(tmp_path):
    args = make_args("--bf16", "--ckpt-format", "torch_dist", "--save", tmp_path, "--verify-integrity")
    model, optimizer, scheduler = build_run(args, 1234)
    save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)
    directory = tmp_path / "iter_0000001"
    with open(directory / "integrity.json") as file:
        manifest = json.load(file)
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == sorted(name for name in os.listdir(directory) if name != "integrity.json")
    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-format", "torch_dist", "--verify-integrity")
    assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 1
    damaged = next(name for name in sorted(manifest["files"]) if name.endswith(".distcp"))
    with open(directory / damaged, "r+b") as file:
        file.seek(10)
        file.write(b"\x00\x01\x02")
    model, optimizer, scheduler, args = _fresh(tmp_path, "--ckpt-format", "torch_dist", "--verify-integrity")
    with pytest.raises(ValueError, match=f"failed its integrity check \\(--verify-integrity\\):\n  - {damaged}: "
                                         "SHA-256 .* differs from the manifest's"):
        load_checkpoint([model], optimizer, scheduler, args=args)
