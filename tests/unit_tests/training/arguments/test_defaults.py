"""Parser defaults against Megatron-LM's (values read off the argparse parser of its
megatron/training/arguments.py, main of mid-2026, and written out here by flag group)."""

import pytest

from megatron.training.arguments import parse_args

REFERENCE_DEFAULTS = {
    # model size / architecture
    "num_layers": None, "hidden_size": None, "ffn_hidden_size": None, "num_attention_heads": None,
    "kv_channels": None, "group_query_attention": False, "num_query_groups": 1, "max_position_embeddings": None,
    "seq_length": None, "position_embedding_type": "learned_absolute", "rotary_base": 10000,
    "rotary_percent": 1.0, "rotary_interleaved": False, "rotary_seq_len_interpolation_factor": None,
    "use_rope_scaling": False, "rope_scaling_factor": 8.0, "make_vocab_size_divisible_by": 128,
    "untie_embeddings_and_output_weights": False, "normalization": "LayerNorm", "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False, "qk_layernorm": False, "apply_residual_connection_post_layernorm": False,
    "swiglu": False, "openai_gelu": False, "squared_relu": False, "quick_geglu": False, "add_bias_linear": True,
    "add_qkv_bias": False, "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02,
    "init_method_xavier_uniform": False, "attention_backend": "auto", "spec": None, "bert_binary_head": True,
    # precision
    "fp16": False, "bf16": False, "loss_scale": None, "initial_loss_scale": 2**32, "min_loss_scale": 1.0,
    "loss_scale_window": 1000, "hysteresis": 2, "attention_softmax_in_fp32": False,
    "accumulate_allreduce_grads_in_fp32": False, "grad_reduce_in_bf16": False, "fp32_residual_connection": False,
    "fp16_lm_cross_entropy": False, "fp8": None, "fp8_recipe": "delayed", "fp8_margin": 0, "fp8_interval": 1,
    "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True,
    "fp8_param_gather": False, "first_last_layers_bf16": False, "num_layers_at_start_in_bf16": 1,
    "num_layers_at_end_in_bf16": 1, "fp4": None,
    # optimizer, regularisation, LR schedule
    "optimizer": "adam", "lr": None, "min_lr": 0.0, "lr_decay_style": "linear", "lr_decay_iters": None,
    "lr_decay_samples": None, "lr_warmup_fraction": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0,
    "lr_warmup_init": 0.0, "lr_wsd_decay_style": "exponential", "lr_wsd_decay_iters": None,
    "lr_wsd_decay_samples": None, "override_opt_param_scheduler": False,
    "use_checkpoint_opt_param_scheduler": False, "weight_decay": 0.01, "start_weight_decay": None,
    "end_weight_decay": None, "weight_decay_incr_style": "constant", "clip_grad": 1.0, "adam_beta1": 0.9,
    "adam_beta2": 0.999, "adam_eps": 1e-8, "sgd_momentum": 0.9, "decoupled_lr": None, "decoupled_min_lr": None,
    # batch and training length
    "micro_batch_size": None, "global_batch_size": None, "rampup_batch_size": None,
    "step_batch_size_schedule": None, "decrease_batch_size_if_needed": False, "train_iters": None,
    "train_samples": None, "exit_interval": None, "exit_duration_in_mins": None, "exit_signal_handler": False,
    "exit_signal": "SIGTERM", "seed": 1234, "data_parallel_random_init": False, "eval_iters": 100, "eval_interval": None,
    "skip_train": False, "full_validation": False, "multiple_validation_sets": False,
    "calculate_per_token_loss": False, "check_for_nan_in_loss_and_grad": True, "manual_gc": False,
    "manual_gc_interval": 0, "empty_unused_memory_level": 0,
    # parallelism
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": None,
    "pipeline_model_parallel_layout": None, "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None, "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False, "microbatch_group_size_per_vp_stage": None,
    "overlap_p2p_comm": True, "context_parallel_size": 1, "cp_comm_type": ["p2p"],
    "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None, "sequence_parallel": False,
    "tp_comm_overlap": False, "use_distributed_optimizer": False, "overlap_grad_reduce": False,
    "overlap_param_gather": False, "ddp_bucket_size": None, "ddp_average_in_collective": False,
    "use_torch_fsdp2": False, "use_megatron_fsdp": False, "distributed_backend": "nccl",
    "distributed_timeout_minutes": 10, "use_tp_pp_dp_mapping": False, "gradient_accumulation_fusion": True,
    "use_cpu_initialization": None,
    # activation recomputation
    "recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
    "recompute_modules": None, "distribute_saved_activations": False, "recompute_activations": False,
    # checkpointing
    "save": None, "load": None, "save_interval": None, "auto_detect_ckpt_format": False, "no_load_optim": None,
    "no_load_rng": None, "no_save_optim": None, "no_save_rng": None, "finetune": False,
    "pretrained_checkpoint": None, "use_checkpoint_args": False, "exit_on_missing_checkpoint": False,
    "ckpt_step": None, "async_save": None, "ckpt_fully_parallel_save": True, "ckpt_fully_parallel_load": False,
    "ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": False,
    "ckpt_convert_format": None, "ckpt_convert_save": None, "non_persistent_save_interval": None,
    "non_persistent_ckpt_type": None, "save_retain_interval": None, "dist_ckpt_strictness": "assume_ok_unexpected",
    # data
    "data_path": None, "split": None, "train_data_path": None, "valid_data_path": None, "test_data_path": None,
    "data_args_path": None, "per_split_data_args_path": None, "data_cache_path": None, "mock_data": False,
    "num_workers": 2, "dataloader_type": None, "mmap_bin_files": True, "reset_position_ids": False,
    "reset_attention_mask": False, "eod_mask_loss": False, "create_attention_mask_in_dataloader": True,
    "num_dataset_builder_threads": 1, "mid_level_dataset_surplus": 0.005, "mask_prob": 0.15,
    "short_seq_prob": 0.1,
    # logging
    "log_interval": 100, "tensorboard_dir": None, "tensorboard_log_interval": 1, "tensorboard_queue_size": 1000,
    "log_timers_to_tensorboard": False, "log_loss_scale_to_tensorboard": True,
    "log_validation_ppl_to_tensorboard": False, "log_memory_to_tensorboard": False, "log_params_norm": False,
    "log_num_zeros_in_grad": False, "log_throughput": False, "timing_log_level": 0, "timing_log_option": "minmax",
    "wandb_project": None, "wandb_exp_name": None, "wandb_save_dir": None, "wandb_entity": None,
    "log_progress": False, "profile": False, "profile_step_start": 10, "profile_step_end": 12,
    # MoE
    "num_experts": None, "moe_layer_freq": 1, "moe_ffn_hidden_size": None, "moe_router_topk": 2,
    "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None,
    "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
    "moe_router_enable_expert_bias": False, "moe_router_bias_update_rate": 1e-3,
    "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False, "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs", "moe_shared_expert_intermediate_size": None, "moe_permute_fusion": False,
    "transformer_impl": "transformer_engine",
}

# Where this project deliberately differs from Megatron HEAD (each choice is written next to its flag).
OUR_CHOICES = {}


@pytest.fixture(scope="module")
def defaults():
    return parse_args(args_list=[])


@pytest.mark.parametrize("dest, expected", sorted({**REFERENCE_DEFAULTS, **OUR_CHOICES}.items()))
def test_default(defaults, dest, expected):
    assert getattr(defaults, dest) == expected
    assert type(getattr(defaults, dest)) is type(expected) or expected is None
