"""Validated arguments -> TransformerConfig / OptimizerConfig / DistributedDataParallelConfig, checked
field by field against what the flags mean in Megatron-LM."""

import torch
import torch.nn.functional as F

from megatron.core.activations import openai_gelu, squared_relu
from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import (
    core_transformer_config_from_args,
    ddp_config_from_args,
    optimizer_config_from_args,
)

from .conftest import MINIMAL


def test_gpt2_style_defaults(validated):
    config = core_transformer_config_from_args(validated(*MINIMAL))
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.ffn_hidden_size, config.kv_channels) == (256, 16)
    assert config.num_query_groups == 4  # no --group-query-attention: one key/value head per query head
    assert config.activation_func is F.gelu and not config.gated_linear_unit
    assert config.bias_activation_fusion is True  # --bias-gelu-fusion is on by default (tanh GELU)
    assert (config.hidden_dropout, config.attention_dropout, config.init_method_std) == (0.1, 0.1, 0.02)
    assert (config.layernorm_epsilon, config.normalization, config.add_bias_linear) == (1e-5, "LayerNorm", True)
    assert config.attention_backend is AttnBackend.auto
    assert config.params_dtype == torch.float32 and config.pipeline_dtype == torch.float32
    assert config.persist_layer_norm is True and config.deallocate_pipeline_outputs is True
    assert config.batch_p2p_comm is True  # no interleaved schedule: no p2p overlap


def test_llama_style_flags(validated):
    args = validated(*MINIMAL, "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
                     "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2",
                     "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                     "--apply-layernorm-1p", "--attention-backend", "flash", "--bf16",
                     "--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1")
    config = core_transformer_config_from_args(args)
    assert config.activation_func is F.silu and config.gated_linear_unit
    assert config.ffn_hidden_size == 128  # int(8 x 64 / 3 / 64) x 64 = int(2.67) x 64
    assert (config.normalization, config.layernorm_epsilon) == ("RMSNorm", 1e-6)
    assert config.layernorm_zero_centered_gamma is True
    assert config.add_bias_linear is False and config.add_qkv_bias is False
    assert config.num_query_groups == 2
    assert config.attention_backend is AttnBackend.flash
    assert config.bf16 and config.params_dtype == torch.bfloat16
    recompute = (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
    assert recompute == ("full", "uniform", 1)


def test_other_activations_and_init(validated):
    config = core_transformer_config_from_args(validated(*MINIMAL, "--squared-relu"))
    assert config.activation_func is squared_relu and config.bias_activation_fusion is False
    config = core_transformer_config_from_args(validated(*MINIMAL, "--openai-gelu"))
    assert config.activation_func is openai_gelu
    config = core_transformer_config_from_args(validated(*MINIMAL, "--no-bias-gelu-fusion"))
    assert config.activation_func is F.gelu and config.bias_activation_fusion is False
    config = core_transformer_config_from_args(validated(*MINIMAL, "--init-method-xavier-uniform"))
    assert config.init_method is torch.nn.init.xavier_uniform_
    assert config.output_layer_init_method is torch.nn.init.xavier_uniform_


def test_optimizer_config(validated):
    args = validated(*MINIMAL, "--fp16", "--loss-scale", "1024", "--weight-decay", "0.1", "--adam-beta2", "0.95",
                     "--clip-grad", "0.5", "--min-lr", "1e-5", "--optimizer", "sgd", "--sgd-momentum", "0.8")
    config = optimizer_config_from_args(args)
    assert (config.optimizer, config.lr, config.min_lr) == ("sgd", 1e-3, 1e-5)
    assert (config.weight_decay, config.adam_beta1, config.adam_beta2, config.adam_eps) == (0.1, 0.9, 0.95, 1e-8)
    assert (config.clip_grad, config.sgd_momentum) == (0.5, 0.8)
    assert config.fp16 and config.params_dtype == torch.float16 and config.loss_scale == 1024
    assert (config.initial_loss_scale, config.min_loss_scale, config.hysteresis) == (2**32, 1.0, 2)


def test_ddp_config(validated):
    config = ddp_config_from_args(validated(*MINIMAL, "--bf16"))
    assert config.grad_reduce_in_fp32 is True  # bf16 reduces gradients in fp32 by default
    assert config.check_for_nan_in_grad is False  # the training loop checks instead (bad_step.py)
    config = ddp_config_from_args(validated(*MINIMAL, "--bf16", "--grad-reduce-in-bf16",
                                            "--ddp-average-in-collective"))
    assert config.grad_reduce_in_fp32 is False and config.average_in_collective is True
    config = ddp_config_from_args(validated(*MINIMAL, "--fp16"))
    assert config.check_for_nan_in_grad is False  # fp16 dynamic scaling owns inf/nan
