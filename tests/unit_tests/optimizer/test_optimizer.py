"""Megatron optimizer wrappers against plain torch optimizers on the same fp32 master weights."""

import io

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer import (
    ChainedOptimizer,
    FP32Optimizer,
    Float16OptimizerWithFloat16Params,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer.param_groups import get_param_groups, reorder_saved_param_groups
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from tests.unit_tests.dist_utils import run_distributed


class TinyModel(torch.nn.Module):
    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Embedding(10, 6)
        self.linear = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.to(dtype)


def constant_scheduler(optimizer, lr):
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=0.1, end_wd=0.1, wd_incr_steps=100, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
    )


def fake_grads(model, step, scale=1.0):
    """Deterministic fp32 gradients for `step`, one per parameter (what DDP's main_grad would hold)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(param.shape, generator=generator) * scale for param in model.parameters()]


def test_weight_decay_skips_biases_and_1d_params():
    model = TinyModel()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=0.0), [model])
    assert isinstance(optimizer, FP32Optimizer)
    names = {id(param): name for name, param in model.named_parameters()}
    groups = {group["wd_mult"]: sorted(names[id(p)] for p in group["params"]) for group in optimizer.param_groups}
    assert groups == {1.0: ["embedding.weight", "linear.weight"], 0.0: ["linear.bias", "norm.bias", "norm.weight"]}

    OptimizerParamScheduler(  # writes weight_decay = 0.5 * wd_mult into each group
        optimizer, init_lr=0.0, max_lr=0.1, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
        lr_decay_style="constant", start_wd=0.5, end_wd=0.5, wd_incr_steps=10, wd_incr_style="constant",
    )
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    assert optimizer.step()[0]
    # Zero gradients leave only AdamW's decoupled decay: p <- p * (1 - lr * wd) where wd applies.
    for name, param in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if name in groups[1.0] else 1.0
        torch.testing.assert_close(param.detach(), before[name] * factor)


def test_apply_wd_to_qk_layernorm_decays_the_q_and_k_norms_only():
    # Megatron-LM's rule: 1-D params and biases get no decay, except under q_layernorm. / k_layernorm.
    model = torch.nn.ModuleDict({"q_layernorm": torch.nn.LayerNorm(4), "k_layernorm": torch.nn.LayerNorm(4),
                                 "input_layernorm": torch.nn.LayerNorm(4), "linear": torch.nn.Linear(4, 4)})
    names = {id(param): name for name, param in model.named_parameters()}
    for apply, decayed in ((False, ["linear.weight"]), (True, ["k_layernorm.bias", "k_layernorm.weight",
                                                              "linear.weight", "q_layernorm.bias",
                                                              "q_layernorm.weight"])):
        config = OptimizerConfig(lr=0.1, weight_decay=0.5, apply_wd_to_qk_layernorm=apply)
        groups = get_megatron_optimizer(config, [model]).param_groups
        assert sorted(names[id(param)] for group in groups if group["wd_mult"] == 1.0 for param in group["params"]) \
            == decayed


def test_decoupled_lr_and_scaled_lr_groups():
    model = TinyModel()
    model.embedding.weight.is_embedding_or_output_parameter = True
    config = OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-3, decoupled_min_lr=5e-5)
    optimizer = get_megatron_optimizer(config, [model], scale_lr_cond=lambda name, _: name.startswith("norm"),
                                       lr_mult=0.1)
    by_param = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    embedding = by_param[id(model.embedding.weight)]
    assert embedding["is_decoupled_lr"] and (embedding["max_lr"], embedding["min_lr"]) == (5e-3, 5e-5)
    linear = by_param[id(model.linear.weight)]
    assert (linear["max_lr"], linear["min_lr"], linear["lr_mult"]) == (1e-3, 1e-5, 1.0)
    assert by_param[id(model.norm.weight)]["lr_mult"] == 0.1
    constant_scheduler(optimizer, 1e-3)
    assert by_param[id(model.norm.weight)]["lr"] == pytest.approx(1e-4)
    assert embedding["lr"] == pytest.approx(5e-3)


def test_param_groups_are_in_megatrons_order_whatever_param_comes_first():
    """A torch-format optimizer state indexes params by position over all groups, so the groups must be in
    Megatron-LM's order (the group without overrides first, then the overrides sorted) for Megatron-LM to
    read ours: a last pipeline stage starts with a norm weight (no weight decay) and still lists the decayed
    group first."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4))
    model[2].weight.is_embedding_or_output_parameter = True
    model[2].bias.is_embedding_or_output_parameter = True
    order = [(group["wd_mult"], group["is_decoupled_lr"], len(group["params"]))
             for group in get_param_groups([model], use_decoupled_learning_rate=True)]
    # default; decoupled (max_lr); decoupled + no decay (max_lr, wd_mult); no decay (wd_mult)
    assert order == [(1.0, False, 1), (1.0, True, 1), (0.0, True, 1), (0.0, False, 2)]
    assert [group["wd_mult"] for group in get_param_groups([model[:2]])] == [1.0, 0.0]


def test_bf16_update_equals_fp32_adamw_on_the_master_copy():
    model = TinyModel(torch.bfloat16)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=True, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [model])
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    constant_scheduler(optimizer, 1e-2)

    masters = [param.detach().float().clone().requires_grad_() for param in model.parameters()]
    names = [name for name, _ in model.named_parameters()]
    decay = [m for m, n in zip(masters, names) if n in ("embedding.weight", "linear.weight")]
    no_decay = [m for m, n in zip(masters, names) if n not in ("embedding.weight", "linear.weight")]
    reference = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for step in range(3):
        grads = fake_grads(model, step)
        for param, master, grad in zip(model.parameters(), masters, grads):
            param.main_grad = grad.clone()
            master.grad = grad.clone()
        update_successful, grad_norm, num_zeros = optimizer.step()
        reference.step()
        assert update_successful and num_zeros is None
        assert grad_norm == pytest.approx(torch.cat([g.flatten() for g in grads]).norm().item(), rel=1e-6)
    main_params = [param.main_param for param in model.parameters()]
    for param, main_param, master in zip(model.parameters(), main_params, masters):
        assert torch.equal(main_param, master.detach())
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))


def test_clipping_inside_step_matches_clip_grad_norm():
    model, reference_model = TinyModel(), TinyModel()
    config = OptimizerConfig(lr=1.0, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.5)
    optimizer = get_megatron_optimizer(config, [model])
    grads = fake_grads(model, 0, scale=2.0)
    for param, reference, grad in zip(model.parameters(), reference_model.parameters(), grads):
        param.grad, reference.grad = grad.clone(), grad.clone()
    _, grad_norm, _ = optimizer.step()
    reference_norm = torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 0.5)
    torch.optim.SGD(reference_model.parameters(), lr=1.0).step()
    assert grad_norm == pytest.approx(reference_norm.item(), rel=1e-6)
    for param, reference in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(param.detach(), reference.detach(), rtol=1e-6, atol=1e-6)


def test_fp32_optimizer_reads_main_grad_and_counts_zeros():
    model, reference_model = TinyModel(), TinyModel()
    config = OptimizerConfig(lr=0.1, optimizer="sgd", weight_decay=0.0, clip_grad=0.0, log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, [model])
    reference = torch.optim.SGD(reference_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        grads = fake_grads(model, step)
        grads[1][0] = 0.0  # an all-zero row of the embedding gradient: 6 zeros
        for param, reference_param, grad in zip(model.parameters(), reference_model.parameters(), grads):
            param.main_grad = grad.clone()
            reference_param.grad = grad.clone()
        _, _, num_zeros = optimizer.step()
        reference.step()
        assert num_zeros == 6
    for param, reference_param in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(param.detach(), reference_param.detach())


def test_fp16_overflow_skips_the_step_and_the_scale_follows_hysteresis_and_window():
    model = TinyModel(torch.float16)
    config = OptimizerConfig(lr=1.0, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, fp16=True, clip_grad=0.0,
                             initial_loss_scale=2.0**10, loss_scale_window=2, hysteresis=2)
    optimizer = get_megatron_optimizer(config, [model])
    start = [param.main_param.clone() for param in model.parameters()]
    assert optimizer.scale_loss(torch.tensor(3.0)).item() == 3 * 2.0**10

    for expected_scale in [2.0**10, 2.0**9]:  # two overflows: the second one halves the scale
        for param, grad in zip(model.parameters(), fake_grads(model, 0)):
            param.grad = (grad * 0.01).half()
        model.linear.weight.grad[0, 0] = float("inf")
        assert optimizer.step() == (False, None, None)
        assert optimizer.get_loss_scale().item() == expected_scale
    for param, original in zip(model.parameters(), start):
        assert torch.equal(param.main_param, original)

    grads = fake_grads(model, 1)
    for param, grad in zip(model.parameters(), grads):
        param.grad = (grad * 0.01 * 2.0**9).half()
    assert optimizer.step()[0]
    for param, original, grad in zip(model.parameters(), start, grads):
        # SGD with lr 1 on the unscaled gradient; the only error is the fp16 rounding of the scaled grad.
        torch.testing.assert_close(param.main_param, original - grad * 0.01, rtol=0, atol=2e-5)
        assert torch.equal(param.detach(), param.main_param.half())
    assert optimizer.get_loss_scale().item() == 2.0**9
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    assert optimizer.get_loss_scale().item() == 2.0**10  # two clean steps: the window of 2 is full


def _train(model, optimizer, scheduler, steps, first_step, overflow_at=None):
    for step in range(first_step, first_step + steps):
        scale = optimizer.get_loss_scale().item()
        for param, grad in zip(model.parameters(), fake_grads(model, step, scale=0.01 * scale)):
            param.grad = grad.to(param.dtype)
        if step == overflow_at:
            model.linear.bias.grad[0] = float("nan")
        if optimizer.step()[0]:
            scheduler.step(increment=8)


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, None)])
def test_state_dict_round_trip_continues_bit_for_bit(dtype, precision):
    def build(seed):
        model = TinyModel(dtype, seed=seed)
        config = OptimizerConfig(lr=1e-2, clip_grad=1.0, loss_scale_window=2, initial_loss_scale=2.0**12,
                                 **({precision: True} if precision else {}))
        optimizer = get_megatron_optimizer(config, [model])
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=16, lr_decay_steps=80,
            lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=80, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
        )
        return model, optimizer, scheduler

    model, optimizer, scheduler = build(seed=0)
    # Under fp16 an overflow at step 1 leaves the loss scaler mid-window in the checkpoint.
    _train(model, optimizer, scheduler, steps=3, first_step=0, overflow_at=1 if precision == "fp16" else None)
    checkpoint = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, checkpoint)
    _train(model, optimizer, scheduler, steps=3, first_step=3)

    checkpoint.seek(0)
    state = torch.load(checkpoint)
    resumed_model, resumed_optimizer, resumed_scheduler = build(seed=1)
    resumed_model.load_state_dict(state["model"])
    resumed_optimizer.load_state_dict(state["optimizer"])
    resumed_scheduler.load_state_dict(state["scheduler"])
    _train(resumed_model, resumed_optimizer, resumed_scheduler, steps=3, first_step=3)

    for param, resumed in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(param, resumed)
        if precision:
            assert torch.equal(param.main_param, resumed.main_param)
    assert torch.equal(optimizer.get_loss_scale(), resumed_optimizer.get_loss_scale())
    assert scheduler.num_steps == resumed_scheduler.num_steps


def test_expert_parallel_params_get_their_own_optimizer():
    model, reference_model = TinyModel(), TinyModel()
    model.linear.weight.allreduce = False
    config = OptimizerConfig(lr=1.0, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.3)
    optimizer = get_megatron_optimizer(config, [model])
    assert isinstance(optimizer, ChainedOptimizer) and len(optimizer.chained_optimizers) == 2
    expert_params = optimizer.chained_optimizers[1].get_parameters()
    assert len(expert_params) == 1 and expert_params[0] is model.linear.weight
    for param, reference, grad in zip(model.parameters(), reference_model.parameters(), fake_grads(model, 0)):
        param.grad, reference.grad = grad.clone(), grad.clone()
    _, grad_norm, _ = optimizer.step()
    assert grad_norm == pytest.approx(torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 0.3).item())
    torch.optim.SGD(reference_model.parameters(), lr=1.0).step()
    for param, reference in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(param.detach(), reference.detach(), rtol=1e-6, atol=1e-6)
    assert len(optimizer.state_dict()) == 2
    for member in optimizer.chained_optimizers:  # the chain clips in place: no member folds it into its update
        member.optimizer._step_supports_amp_scaling = True  # as torch's fused Adam on a GPU says
        assert not member._clips_in_update()


def test_param_groups_are_matched_by_key_when_loading():
    flags = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    current = [{"params": [0], "wd_mult": 1.0, **flags}, {"params": [1, 2], "wd_mult": 0.0, **flags}]
    assert reorder_saved_param_groups(current, current[::-1]) == [1, 0]
    with pytest.raises(ValueError, match="no param group in the checkpoint matches"):
        reorder_saved_param_groups(current, [dict(current[0], wd_mult=0.5), current[1]])
    with pytest.raises(ValueError, match="has 1 param groups"):
        reorder_saved_param_groups(current, current[:1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fp16": True, "bf16": True}, "mutually exclusive"),
        ({"overlap_param_gather_with_optimizer_step": True}, "--overlap-param-gather-with-optimizer-step.*not supp"),
        ({"optimizer": "lion"}, "'lion' is not supported yet; choose one of adam, sgd"),
        ({"clip_grad": -1.0}, "--clip-grad"),
    ],
)
def test_invalid_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(lr=1e-3, **kwargs)


def test_missing_lr_and_bad_dtypes_are_reported():
    with pytest.raises(ValueError, match="--lr"):
        get_megatron_optimizer(OptimizerConfig(), [TinyModel()])
    with pytest.raises(ValueError, match="float64"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True), [TinyModel(torch.float64)])


class ShardedLayer(torch.nn.Module):
    """This rank's part of a layer: a TP shard, a TP-replicated bias, and the shared copy of an embedding."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3, 4, dtype=dtype))
        self.weight.tensor_model_parallel = True
        self.bias = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        self.shared_copy = torch.nn.Parameter(torch.zeros(5, dtype=dtype))
        self.shared_copy.shared = True


def _model_parallel_statistics(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    generator = torch.Generator().manual_seed(0)
    full_weight_grad, bias_grad = torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)
    full_weight_grad[0, 0] = full_weight_grad[3, 0] = 0.0

    layer = ShardedLayer(torch.float32)
    config = OptimizerConfig(lr=1.0, optimizer="sgd", clip_grad=0.0, log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, [layer])
    layer.weight.grad = full_weight_grad[3 * rank : 3 * rank + 3].clone()
    layer.bias.grad = bias_grad.clone()
    layer.shared_copy.grad = torch.zeros(5)  # counted on the stage that owns the weight, not here
    _, grad_norm, num_zeros = optimizer.step()
    # The norm of the full layer: every shard once, the replicated bias once, no shared copy.
    expected = torch.cat([full_weight_grad.flatten(), bias_grad]).norm().item()
    assert grad_norm == pytest.approx(expected, rel=1e-6)
    assert num_zeros == 2

    fp16_layer = ShardedLayer(torch.float16)
    config = OptimizerConfig(lr=1.0, optimizer="sgd", fp16=True, initial_loss_scale=8.0, hysteresis=1)
    fp16_optimizer = get_megatron_optimizer(config, [fp16_layer])
    for param in fp16_layer.parameters():
        param.grad = torch.ones_like(param)
    if rank == 1:
        fp16_layer.bias.grad[0] = float("inf")
    assert fp16_optimizer.step() == (False, None, None), "the rank without an overflow must skip the step too"
    assert fp16_optimizer.get_loss_scale().item() == 4.0
    assert torch.all(fp16_layer.weight == 0)


def test_model_parallel_norm_zeros_and_overflow_agree_across_ranks():
    run_distributed(_model_parallel_statistics, 2)
