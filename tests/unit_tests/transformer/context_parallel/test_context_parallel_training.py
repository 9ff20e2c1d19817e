"""Several optimizer steps with context parallelism against the same model trained without it (CP=1).

On 4 gloo ranks, Megatron-Core's training path (GPTModel, DDP over DP x CP, the no-pipelining schedule
with finalize_model_grads, get_megatron_optimizer with Adam and clipping, the distributed optimizer in one
layout) and the GPT task's own batch split and loss function (`get_batch_on_this_cp_rank`,
`tasks/gpt.loss_func`) train a GPT-2-like model (learned positions, tied embeddings) and a Llama-like one
(RoPE, GQA with 2 groups, SwiGLU, RMSNorm) at CP=2 x DP=2, CP=2 x TP=2 (with sequence parallelism), CP=4,
with ring and all-gather attention. The loss mask drops a quarter of the tokens at random, so the CP ranks
of one sequence hold different numbers of loss tokens: the loss must still be the token mean of each
microbatch's whole sequences (averaged over microbatches, as Megatron does).

The reference is the model at CP=1 in one process with plain `torch.optim.AdamW` and `clip_grad_norm_`
(tests/unit_tests/reference_training.py).
Every step the logged loss (global token mean), the un-sharded gradients and the gradient norm must match,
and after the last step the weights. Tolerances in fp32: losses, gradients and gradient norms within 2e-5
(absolute, or relative to the tensor's largest entry when that exceeds 1; measured <= 4e-6); weights after
three Adam steps within 1e-4 (Adam moves near-zero-gradient entries by up to the learning rate whatever the
gradient's size, so 1e-7 differences in summation order show more there; measured <= 5e-5).
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.tasks import gpt as gpt_task
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.reference_training import adamw_reference_steps
from tests.unit_tests.tensor_parallel.test_tensor_parallel_training import MODELS, _scaled_error, _unsharded

SEQ, MICRO_BATCH, GLOBAL_BATCH, VOCAB, STEPS = 16, 2, 4, 128, 3
LR, WEIGHT_DECAY, CLIP = 3e-3, 0.01, 0.5
TOLERANCE, WEIGHT_TOLERANCE = 2e-5, 1e-4

# (model, TP, CP, sequence parallel, cp_comm_type, distributed optimizer); DP = 4 / (TP x CP).
LAYOUTS = [
    ("gpt2", 1, 2, False, "p2p", False),
    ("llama", 1, 2, False, "all_gather", True),
    ("llama", 2, 2, True, "p2p", False),
    ("gpt2", 2, 2, False, "all_gather", False),
    ("llama", 1, 4, False, "p2p", False),
]


def _build(name, tensor_parallel_size=1, context_parallel_size=1, sequence_parallel=False, cp_comm_type=None):
    torch.manual_seed(11)
    config = TransformerConfig(
        **MODELS[name]["config"], tensor_model_parallel_size=tensor_parallel_size,
        context_parallel_size=context_parallel_size, sequence_parallel=sequence_parallel, cp_comm_type=cp_comm_type,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, **MODELS[name]["model"])


def _global_batches():
    """STEPS global batches: dicts of tokens, labels, loss_mask, position_ids, each [GLOBAL_BATCH, SEQ]."""
    generator = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(STEPS):
        sequences = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        loss_mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=generator) > 0.25).float()
        batches.append(dict(tokens=sequences[:, :-1], labels=sequences[:, 1:], loss_mask=loss_mask,
                            position_ids=torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ)))
    return batches


def _microbatches(batch: dict, first: int, last: int):
    return [{key: value[start : start + MICRO_BATCH] for key, value in batch.items()}
            for start in range(first, last, MICRO_BATCH)]


def _reference_loss(model, batch):
    """The mean over microbatches of each microbatch's token-mean loss, carrying the global token mean as
    its value: the gradient Megatron's schedule takes, the number its log line shows."""
    sums, counts = [], []
    for micro in _microbatches(batch, 0, GLOBAL_BATCH):
        losses = model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"])
        sums.append((losses * micro["loss_mask"]).sum())
        counts.append(micro["loss_mask"].sum())
    backpropagated = torch.stack([total / count for total, count in zip(sums, counts)]).mean()
    logged = torch.stack(sums).sum() / torch.stack(counts).sum()
    return backpropagated + (logged - backpropagated).detach()


def _reference_run(name: str) -> list[dict]:
    """CP=1 in one process: AdamW and clip_grad_norm_ on `_reference_loss`."""
    return adamw_reference_steps(_build(name), _global_batches(), _reference_loss, LR, WEIGHT_DECAY, CLIP)


def _forward_step(data_iterator, model):
    """The GPT task's path: this CP rank's chunks of the microbatch, the task's loss function."""
    batch = get_batch_on_this_cp_rank(dict(next(data_iterator)))
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return losses, partial(gpt_task.loss_func, batch["loss_mask"])


def _context_parallel_run(layout, reference) -> dict:
    """Worst errors against `reference` over the steps, for one layout of the 4 ranks."""
    name, tp, cp, sequence_parallel, comm_type, distributed_optimizer = layout
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(123)
    group = parallel_state.get_tensor_model_parallel_group()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    module = _build(name, tp, cp, sequence_parallel, comm_type)
    glu = module.config.gated_linear_unit
    model = DistributedDataParallel(
        module.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer), module
    )
    module.config.finalize_model_grads_func = finalize_model_grads
    module.config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
                        use_distributed_optimizer=distributed_optimizer), [model]
    )
    OptimizerParamScheduler(  # constant LR and weight decay
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=1, lr_decay_style="constant",
        start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY, wd_incr_steps=1, wd_incr_style="constant",
    )

    per_rank = GLOBAL_BATCH // dp_size  # this DP rank's sequences; all CP ranks of a replica read the same
    data = iter([micro for batch in _global_batches()
                 for micro in _microbatches(batch, dp_rank * per_rank, (dp_rank + 1) * per_rank)])
    worst = {}
    for step in range(1, STEPS + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=data, model=[model],
            num_microbatches=per_rank // MICRO_BATCH, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        loss_and_tokens = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
        dist.all_reduce(loss_and_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        expected = reference[step]
        worst[f"loss {step}"] = abs((loss_and_tokens[0] / loss_and_tokens[1]).item() - expected["loss"])
        if not distributed_optimizer:  # (its main_grad is reduced only on the shard this rank owns)
            worst[f"grads {step}"] = max(
                _scaled_error(_unsharded(key, param.main_grad, group, tp, glu), expected["grads"][key])
                for key, param in module.named_parameters()
            )
        _, grad_norm, _ = optimizer.step()
        worst[f"grad norm {step}"] = abs(grad_norm - expected["grad_norm"]) / expected["grad_norm"]
    worst["final weights"] = max(
        _scaled_error(_unsharded(key, value, group, tp, glu), reference[-1]["weights"][key])
        for key, value in module.state_dict().items()
    )
    parallel_state.destroy_model_parallel()
    return worst


def _all_layouts(rank, world_size, references):
    return {layout: _context_parallel_run(layout, references[layout[0]]) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def results():
    references = {name: _reference_run(name) for name in MODELS}
    return run_distributed(_all_layouts, 4, references)


def test_context_parallel_training_matches_cp1_over_several_steps(results):
    """CP=2 x DP=2, CP=2 x TP=2 (+SP), CP=4; ring and all-gather; plain and distributed optimizer."""
    for rank, per_rank in enumerate(results):
        for layout, worst in per_rank.items():
            worst = dict(worst)
            weights = worst.pop("final weights")
            assert weights < WEIGHT_TOLERANCE, f"rank {rank} {layout}: final weights differ by {weights}"
            bad = {key: value for key, value in worst.items() if value > TOLERANCE}
            assert not bad, f"rank {rank} {layout}: {bad}"
