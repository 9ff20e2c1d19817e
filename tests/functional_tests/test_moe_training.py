"""A small Mixtral-shaped model (RMSNorm, RoPE, SwiGLU, GQA, no biases, 4 experts top-2 with the
load-balancing loss, grouped GEMM, all-to-all dispatcher) learns the built-in corpus through
pretrain_gpt.py, and its routers end up balanced: the per-expert token fractions of the saved model on
corpus text are printed and each must be near 1/4."""

import math

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.training.arguments import core_transformer_config_from_args

from .harness import TINY_GPT, read_scalars, run
from .test_gpt_pretraining import dataset  # noqa: F401  (the fixture: corpus, tokenizer, .bin/.idx)

EXPERTS, ITERATIONS = 4, 60
MIXTRAL_SHAPE = [
    "--swiglu", "--ffn-hidden-size", "128", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--group-query-attention",
    "--num-query-groups", "2", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--num-experts", str(EXPERTS), "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-1",
    "--moe-z-loss-coeff", "1e-3", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
]


def _token_fractions(checkpoint_path: str, data_prefix: str) -> list:
    """Per layer, the share of the routed (token, slot) pairs each expert receives on 16 x 128 corpus tokens."""
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    args = state["args"]
    config = core_transformer_config_from_args(args)
    model = GPTModel(config, get_gpt_decoder_block_spec(config, False, normalization=args.normalization),
                     args.padded_vocab_size, args.max_position_embeddings, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    model.load_state_dict(state["model"])
    model.eval()
    corpus = IndexedDataset(data_prefix)
    tokens = np.concatenate([corpus[index] for index in range(min(len(corpus), 400))])[: 16 * 128]
    tokens = torch.from_numpy(tokens.astype(np.int64)).view(16, 128)
    counts = {}

    def count(module, inputs, output):
        counts[module] = counts.get(module, 0) + output[1].sum(dim=0)

    routers = [layer.mlp.router for layer in model.decoder.layers]
    for router in routers:
        router.register_forward_hook(count)
    with torch.no_grad():
        model(tokens, torch.arange(128).expand(16, 128), None)
    return [(counts[router] / counts[router].sum()).tolist() for router in routers]


def test_mixtral_shaped_model_learns_with_balanced_routing(tmp_path, dataset):  # noqa: F811
    tensorboard, save = str(tmp_path / "tb"), str(tmp_path / "ckpt")
    run("pretrain_gpt.py", TINY_GPT + MIXTRAL_SHAPE + dataset + [
        "--train-iters", str(ITERATIONS), "--tensorboard-dir", tensorboard, "--save", save,
        "--save-interval", str(ITERATIONS), "--ckpt-format", "torch"])
    losses = read_scalars(tensorboard, "lm loss")
    balancing = read_scalars(tensorboard, "load_balancing_loss")
    assert sorted(losses) == sorted(balancing) == list(range(1, ITERATIONS + 1))
    assert losses[1] > math.log(4000) - 0.5 and losses[ITERATIONS] < losses[1] - 1.0
    # E * sum_i f_i P_i is 1 for uniform routing and 2 when top-2 of 4 experts always take everything.
    assert np.mean([balancing[step] for step in range(ITERATIONS - 9, ITERATIONS + 1)]) < 1.1

    data_prefix = dataset[dataset.index("--data-path") + 1]
    fractions = _token_fractions(f"{save}/iter_{ITERATIONS:07d}/mp_rank_00/model_optim_rng.pt", data_prefix)
    report = "; ".join(
        f"layer {n}: " + " ".join(f"{share:.3f}" for share in layer) for n, layer in enumerate(fractions)
    )
    print(f"\nlm loss {losses[1]:.3f} -> {losses[ITERATIONS]:.3f}, load_balancing_loss {balancing[1]:.3f} -> "
          f"{balancing[ITERATIONS]:.3f}; per-expert token fractions after {ITERATIONS} iterations: {report}")
    for layer in fractions:
        assert all(0.5 / EXPERTS < share < 1.5 / EXPERTS for share in layer), report
