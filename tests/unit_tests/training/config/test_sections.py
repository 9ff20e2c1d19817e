"""The configuration sections (megatron/training/config/): the parser made from them, their own rules and
their derived values, checked on the dataclasses alone (no parsing), against Megatron's rules."""

import dataclasses

import pytest
import torch

from megatron.training.arguments import build_parser, parse_args
from megatron.training.config.checkpointing import CheckpointingConfig
from megatron.training.config.data import DataConfig
from megatron.training.config.logging import LoggingConfig
from megatron.training.config.model import KernelFusionConfig, NetworkSizeConfig
from megatron.training.config.moe import MoEConfig
from megatron.training.config.optimizer import LearningRateConfig, OptimizerChoiceConfig, RegularizationConfig
from megatron.training.config.parallel import DistributedConfig
from megatron.training.config.precision import LowPrecisionConfig, MixedPrecisionConfig
from megatron.training.config.resilience import ResilienceConfig
from megatron.training.config.run_config import RunConfig
from megatron.training.config.training import TrainingConfig, ValidationConfig

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=32)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_every_flag_has_help_and_one_group_per_section():
    parser = build_parser()
    titles = [group.title for group in parser._action_groups]
    for section in RunConfig.section_classes():
        assert titles.count(section.TITLE) == 1
        for field in dataclasses.fields(section):
            action = next(action for action in parser._actions if action.dest == field.name)
            assert action.help, f"{section.__name__}.{field.name} has no docstring"
    assert RunConfig.flag_names()["fp8"] == "--fp8-format"
    assert RunConfig.flag_names()["add_bias_linear"] == "--disable-bias-linear"


def test_parsed_defaults_are_the_field_defaults():
    parsed = RunConfig.from_namespace(parse_args(args_list=[]))
    assert parsed == RunConfig(**{field.name: field.type() for field in dataclasses.fields(RunConfig)})


def test_a_section_without_required_flags_is_valid_by_default():
    required = {NetworkSizeConfig, DataConfig, TrainingConfig}
    for section in set(RunConfig.section_classes()) - required:
        assert section().validate() == [], section.__name__


@pytest.mark.parametrize("section, expected", [
    (NetworkSizeConfig(), "--num-layers is required"),
    (NetworkSizeConfig(**{**SHAPE, "hidden_size": 66}),
     "--hidden-size 66 is not divisible by --num-attention-heads 4 (16.50 per head)"),
    (NetworkSizeConfig(**SHAPE, encoder_num_layers=3), "give --num-layers or --encoder-num-layers, not both"),
    (NetworkSizeConfig(**SHAPE, swiglu=True, quick_geglu=True), "choose one activation: --swiglu and --quick-geglu"),
    (DataConfig(), "--seq-length is required"),
    (DataConfig(seq_length=32, mock_data=True, data_path=["a"]), "choose one data source"),
    (DataConfig(seq_length=32, split="98/x"), "--split '98/x' must be up to three comma-separated numbers"),
    (TrainingConfig(), "--micro-batch-size is required"),
    (TrainingConfig(micro_batch_size=1, train_iters=5, rampup_batch_size=[1, 1, 8]),
     "--rampup-batch-size needs sample-based training"),
    (TrainingConfig(micro_batch_size=1, recompute_activations=True, recompute_granularity="full"),
     "--recompute-activations means selective recompute"),
    (ValidationConfig(eval_iters=-1), "--eval-iters -1 must be >= 0"),
    (DistributedConfig(tp_comm_overlap=True, sequence_parallel=True),  # TP 1 turns sequence parallelism off
     "--tp-comm-overlap needs --sequence-parallel"),
    (DistributedConfig(num_layers_per_virtual_pipeline_stage=1, pipeline_model_parallel_layout="E|t|L"),
     "give at most one of"),
    (DistributedConfig(context_parallel_size=2, cp_comm_type=["a2a+p2p"]),
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (MixedPrecisionConfig(fp16=True, bf16=True), "--fp16 and --bf16 are mutually exclusive"),
    (LowPrecisionConfig(fp8="e4m3", fp8_recipe="tensorwise", fp8_amax_history_len=4),
     "belong to --fp8-recipe delayed"),
    (CheckpointingConfig(save="ckpt"), "--save needs --save-interval"),
    (CheckpointingConfig(ckpt_convert_format="torch"), "needs --ckpt-convert-save and --load"),
    (LoggingConfig(profile=True, profile_step_start=5, profile_step_end=5), "--profile-step-end 5 must be above"),
    (RegularizationConfig(weight_decay_incr_style="cosine"), "needs --start-weight-decay and --end-weight-decay"),
    (LearningRateConfig(lr=1e-3, min_lr=1e-2), "--min-lr 0.01 must be <= --lr 0.001"),
    (MoEConfig(num_experts=4, moe_router_topk=5), "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    (MoEConfig(moe_aux_loss_coeff=[0.1, 0.2]), "combining several load-balancing losses is not supported yet"),
    (MoEConfig(moe_layer_freq="[1]*x"), "--moe-layer-freq '[1]*x' must be an integer or a 0/1 list"),
    (KernelFusionConfig(cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=0),
     "--cuda-graph-warmup-steps 0 must be at least 1"),
    (ResilienceConfig(spiky_loss_window=0), "--spiky-loss-window 0 must be at least 1"),
])
def test_each_section_checks_its_own_flags(section, expected):
    assert any(expected in problem for problem in section.validate()), section.validate()


def test_derived_values():
    # Megatron's SwiGLU width: int(8 x 768 / 3 / 64) x 64 = 2048; kv = 768 / 12.
    network = NetworkSizeConfig(**{**SHAPE, "hidden_size": 768, "num_attention_heads": 12}, swiglu=True)
    assert network.derived() == {"num_layers": 2, "encoder_num_layers": 2, "ffn_hidden_size": 2048,
                                 "kv_channels": 64, "add_qkv_bias": True}
    assert MixedPrecisionConfig(bf16=True).derived() == {
        "params_dtype": torch.bfloat16, "attention_softmax_in_fp32": False, "accumulate_allreduce_grads_in_fp32": True}
    assert MixedPrecisionConfig(fp16=True).dynamic_loss_scaling
    assert DistributedConfig(sequence_parallel=True).derived()["sequence_parallel"] is False  # TP 1
    assert DistributedConfig(tensor_model_parallel_size=2, context_parallel_size=2).data_parallel_size(8) == 2
    assert DistributedConfig(tensor_model_parallel_size=3).data_parallel_size(8) is None
    assert DataConfig(data_path=["a"]).derived()["split"] == "969, 30, 1"
    assert OptimizerChoiceConfig(exp_avg_dtype="bf16").derived()["exp_avg_dtype"] is torch.bfloat16
    assert MoEConfig(num_experts=0, moe_layer_freq="([1]+[0])*2").derived()["moe_layer_freq"] == [1, 0, 1, 0]
    assert MoEConfig(num_experts=0).effective_num_experts is None
