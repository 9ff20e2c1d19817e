"""--test-mode (TransformerConfig.test_mode): every self-attention forward checks that its QK norms' params are
identical on the data-parallel and tensor-parallel ranks, and stops with the param, group and ranks when one
replica differs."""

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed


def _forward_clean_then_corrupted(rank, world_size):
    """For TP 1 (two data-parallel ranks) and TP 2: the error of a clean forward (None) and of one after rank 1's
    k_layernorm weight changed."""
    errors = []
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1234)
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, qk_layernorm=True,
                                   test_mode=True, use_cpu_initialization=True, tensor_model_parallel_size=tp)
        layer = build_module(get_gpt_layer_local_spec(qk_layernorm=True), config=config, layer_number=1)
        hidden = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(0))
        for corrupt in (False, True):
            if corrupt and rank == 1:
                with torch.no_grad():
                    layer.self_attention.k_layernorm.weight[0] += 1e-3
            try:
                layer(hidden, attention_mask=None)
                errors.append(None)
            except RuntimeError as error:
                errors.append(str(error))
        parallel_state.destroy_model_parallel()
    return errors


def test_test_mode_stops_on_a_corrupted_replica():
    for rank, (dp_clean, dp_corrupt, tp_clean, tp_corrupt) in enumerate(run_distributed(_forward_clean_then_corrupted,
                                                                                        2)):
        assert dp_clean is None and tp_clean is None
        assert dp_corrupt.startswith(f"--test-mode: layer 1 k_layernorm.weight differs between data-parallel ranks "
                                     f"{1 - rank} and {rank}")
        assert tp_corrupt.startswith(f"--test-mode: layer 1 k_layernorm.weight differs between tensor-parallel ranks "
                                     f"{1 - rank} and {rank}")
