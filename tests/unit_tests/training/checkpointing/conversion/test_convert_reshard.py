"""tools/checkpoint/convert.py core -> core: TP/PP (and EP for mixture-of-experts) resharding round trips
(bitwise; a DeepSeek-V3-shaped model with multi-latent attention and a multi-token-prediction layer too), the
shards against the split rules of reference 8.3/8.4 worked by hand, TP=2 and EP=2 models
loaded from converted shards against the TP=1 logits on 2 gloo ranks, vocabulary re-padding, and the
errors."""

import os

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training.checkpointing.files import load_checkpoint_file
from megatron.training.checkpointing.conversion.convert import main as convert
from megatron.training.checkpointing.conversion.torch_checkpoint import read_torch_checkpoint
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.checkpointing.conftest import single_rank  # noqa: F401 (the fixture)
from tests.unit_tests.training.checkpointing.conversion.gpt_models import (
    PADDED_VOCAB,
    TRUE_VOCAB,
    build_model,
    gpt_model,
    logits,
    model_args,
    save_model,
)


def _convert(load_dir, save_dir, *flags):
    convert(["--model-type", "GPT", "--loader", "core", "--saver", "core", "--load-dir", str(load_dir),
             "--save-dir", str(save_dir), *map(str, flags)])


def _shard(directory, name):
    return load_checkpoint_file(os.path.join(directory, "iter_0000007", name, "model_optim_rng.pt"))


@pytest.mark.parametrize("name, ranks", [
    ("gpt2", ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    ("llama", ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    ("mixtral", [f"mp_rank_0{t}_00{p}_00{e}" for t in range(2) for p in range(2) for e in range(2)]),
    ("deepseek_v3", [f"mp_rank_0{t}_00{p}_00{e}" for t in range(2) for p in range(2) for e in range(2)]),
])
def test_tp_pp_and_ep_reshards_round_trip_bitwise(tmp_path, single_rank, name, ranks):
    args = model_args(name, *(["--mtp-num-layers", "1"] if name == "deepseek_v3" else []))
    model = build_model(args)
    save_model(model, args, str(tmp_path / "tp1"))
    original = read_torch_checkpoint(str(tmp_path / "tp1"))[0]
    expert_parallel = ["--target-expert-parallel-size", 2] if args.num_experts else []
    _convert(tmp_path / "tp1", tmp_path / "tp2pp2", "--target-tensor-parallel-size", 2,
             "--target-pipeline-parallel-size", 2, *expert_parallel)
    assert sorted(os.listdir(tmp_path / "tp2pp2" / "iter_0000007")) == ranks
    _convert(tmp_path / "tp2pp2", tmp_path / "back", "--target-tensor-parallel-size", 1,
             "--target-pipeline-parallel-size", 1, *(["--target-expert-parallel-size", 1] if expert_parallel else []))
    back, back_args, iteration, _ = read_torch_checkpoint(str(tmp_path / "back"))
    assert iteration == 7 and (back_args.tensor_model_parallel_size, back_args.pipeline_model_parallel_size) == (1, 1)
    assert back.keys() == original.keys()
    for key in original:
        assert torch.equal(back[key], original[key]), key


def test_shards_follow_the_split_rules(tmp_path):
    args = model_args("llama")  # 4 heads in 2 groups of width 16, ffn 96, hidden 64, 4 layers
    save_model(build_model(args), args, str(tmp_path / "tp1"))
    full = read_torch_checkpoint(str(tmp_path / "tp1"))[0]
    _convert(tmp_path / "tp1", tmp_path / "tp2pp2", "--target-tensor-parallel-size", 2,
             "--target-pipeline-parallel-size", 2)
    rank_1_stage_1 = _shard(tmp_path / "tp2pp2", "mp_rank_01_001")
    assert rank_1_stage_1["args"].tensor_model_parallel_size == 2 and rank_1_stage_1["checkpoint_version"] == 3.0
    shard = rank_1_stage_1["model"]
    # Stage 1 holds global layers 2, 3 as local 0, 1, the final norm and the untied output layer.
    assert sorted({key.split(".")[2] for key in shard if key.startswith("decoder.layers.")}) == ["0", "1"]
    assert "embedding.word_embeddings.weight" not in shard and "decoder.final_layernorm.weight" in shard
    layer = "decoder.layers.3."
    # QKV rows per group: (2 query heads + k + v) x 16 = 64 rows per group; TP rank 1 holds group 1.
    assert torch.equal(shard["decoder.layers.1.self_attention.linear_qkv.weight"],
                       full[layer + "self_attention.linear_qkv.weight"][64:128])
    # SwiGLU fc1 = [gate (96 rows); up (96 rows)]; rank 1 holds [gate[48:96]; up[48:96]].
    fc1 = full[layer + "mlp.linear_fc1.weight"]
    assert torch.equal(shard["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([fc1[48:96], fc1[144:192]]))
    # Row-parallel weights split their input columns; norms are replicated; vocab rows split in two.
    assert torch.equal(shard["decoder.layers.1.mlp.linear_fc2.weight"], full[layer + "mlp.linear_fc2.weight"][:, 48:])
    assert torch.equal(shard["decoder.layers.1.input_layernorm.weight"], full[layer + "input_layernorm.weight"])
    assert torch.equal(shard["output_layer.weight"], full["output_layer.weight"][64:])


def test_experts_follow_the_split_rules(tmp_path, single_rank):
    args = model_args("mixtral")  # 4 experts of width 96 per layer, 4 layers
    save_model(build_model(args), args, str(tmp_path / "tp1"))
    full = read_torch_checkpoint(str(tmp_path / "tp1"))[0]
    _convert(tmp_path / "tp1", tmp_path / "tp2ep2", "--target-tensor-parallel-size", 2,
             "--target-expert-parallel-size", 2)
    shard = _shard(tmp_path / "tp2ep2", "mp_rank_01_001")  # TP rank 1 of expert-parallel rank 1
    assert (shard["args"].expert_model_parallel_size, shard["args"].expert_tensor_parallel_size) == (2, 2)
    model = shard["model"]
    # EP rank 1 holds global experts 2, 3 as local 0, 1; the dense tensors and the router are in every file.
    experts = sorted({key.split(".")[6] for key in model if ".local_experts." in key})
    assert experts == ["0", "1"]
    assert torch.equal(model["decoder.layers.2.mlp.router.weight"], full["decoder.layers.2.mlp.router.weight"])
    # Expert 3's SwiGLU fc1 = [gate (96 rows); up (96 rows)]; TP rank 1 holds [gate[48:96]; up[48:96]].
    fc1 = full["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(model["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"],
                       torch.cat([fc1[48:96], fc1[144:192]]))
    fc2 = full["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"]
    assert torch.equal(model["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"], fc2[:, 48:])


def test_grouped_gemm_checkpoints_keep_their_key_spelling(tmp_path, single_rank):
    args = model_args("mixtral", "--moe-grouped-gemm")
    model = build_model(args)
    save_model(model, args, str(tmp_path / "ep1"))
    _convert(tmp_path / "ep1", tmp_path / "ep2", "--target-expert-parallel-size", 2)
    shard = _shard(tmp_path / "ep2", "mp_rank_00_001")["model"]
    # EP rank 1 holds experts 2, 3 as GroupedMLP's weight0, weight1.
    assert torch.equal(shard["decoder.layers.0.mlp.experts.linear_fc2.weight1"],
                       model.state_dict()["decoder.layers.0.mlp.experts.linear_fc2.weight3"])
    _convert(tmp_path / "ep2", tmp_path / "back", "--target-expert-parallel-size", 1)
    back = _shard(tmp_path / "back", "mp_rank_00")["model"]
    assert {key for key in model.state_dict() if not key.endswith("_extra_state")} == set(back)
    assert all(torch.equal(back[key], model.state_dict()[key]) for key in back)


def test_tied_embeddings_are_on_the_last_stage_when_pipelined(tmp_path):
    args = model_args("gpt2")
    save_model(build_model(args), args, str(tmp_path / "tp1"))
    full = read_torch_checkpoint(str(tmp_path / "tp1"))[0]
    assert "output_layer.weight" not in full
    _convert(tmp_path / "tp1", tmp_path / "pp2", "--target-pipeline-parallel-size", 2)
    first = _shard(tmp_path / "pp2", "mp_rank_00_000")["model"]
    last = _shard(tmp_path / "pp2", "mp_rank_00_001")["model"]
    assert "output_layer.weight" not in first and "embedding.position_embeddings.weight" in first
    assert torch.equal(last["output_layer.weight"], full["embedding.word_embeddings.weight"])


def test_vocabulary_is_repadded_for_the_target_tp(tmp_path):
    args = model_args("gpt2")  # 100 ids padded to a multiple of 64: 128 rows
    save_model(build_model(args), args, str(tmp_path / "tp1"))
    full = read_torch_checkpoint(str(tmp_path / "tp1"))[0]["embedding.word_embeddings.weight"]
    _convert(tmp_path / "tp1", tmp_path / "tp4", "--target-tensor-parallel-size", 4, "--true-vocab-size", TRUE_VOCAB)
    resharded, args4, _, _ = read_torch_checkpoint(str(tmp_path / "tp4"))
    rows = resharded["embedding.word_embeddings.weight"]
    assert args4.padded_vocab_size == rows.shape[0] == 256  # 100 rounded up to 64 x 4
    assert torch.equal(rows[:PADDED_VOCAB], full)
    assert torch.equal(rows[PADDED_VOCAB:], full[-1].expand(256 - PADDED_VOCAB, -1))
    _convert(tmp_path / "tp4", tmp_path / "tp1_again", "--target-tensor-parallel-size", 1, "--true-vocab-size",
             TRUE_VOCAB)
    assert torch.equal(read_torch_checkpoint(str(tmp_path / "tp1_again"))[0]["embedding.word_embeddings.weight"], full)


def _converted_logits(rank, world_size, checkpoints, tokens):
    """{checkpoint dir: full logits} of the models loaded from this rank's file of each (dir, TP, EP) layout."""
    results = {}
    for checkpoint_dir, tensor_parallel, expert_parallel in checkpoints:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 expert_model_parallel_size=expert_parallel)
        model_parallel_cuda_manual_seed(1)  # the weights come from the checkpoint; this only sets up the RNG streams
        name = f"mp_rank_00_{rank:03d}" if expert_parallel > 1 else f"mp_rank_{rank:02d}"
        checkpoint = _shard(checkpoint_dir, name)
        model = gpt_model(checkpoint["args"], parallel_output=False).eval()
        model.load_state_dict(checkpoint["model"], strict=True)
        results[checkpoint_dir] = logits(model, tokens)
        parallel_state.destroy_model_parallel()
    return results


def test_tp2_and_ep2_models_from_converted_shards_compute_the_tp1_logits(tmp_path, single_rank):
    tokens = torch.randint(0, TRUE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    layouts = {"gpt2": [(2, 1)], "llama": [(2, 1)], "mixtral": [(2, 1), (1, 2)], "deepseek_v3": [(2, 1), (1, 2)]}
    expected, checkpoints = {}, []
    for name, targets in layouts.items():
        args = model_args(name)
        model = build_model(args)
        save_model(model, args, str(tmp_path / name / "tp1"))
        for tensor_parallel, expert_parallel in targets:
            directory = str(tmp_path / name / f"tp{tensor_parallel}ep{expert_parallel}")
            _convert(tmp_path / name / "tp1", directory, "--target-tensor-parallel-size", tensor_parallel,
                     *(["--target-expert-parallel-size", expert_parallel] if args.num_experts else []))
            expected[directory] = logits(model, tokens)
            checkpoints.append((directory, tensor_parallel, expert_parallel))
    for result in run_distributed(_converted_logits, 2, checkpoints, tokens):  # one spawn for all
        for directory, reference in expected.items():
            torch.testing.assert_close(result[directory], reference, atol=1e-5, rtol=0, msg=directory)


@pytest.mark.parametrize("flags, message", [
    (["--loader", "nonexistent"], "--loader nonexistent: no such loader"),
    (["--target-tensor-parallel-size", "3"], "TP 3 must divide the 4 attention heads: legal sizes 1, 2, 4"),
    (["--target-pipeline-parallel-size", "3"], "must divide the 4 layers"),
    (["--true-vocab-size", "200"], "the tokenizer has 200 ids but the model only 128 vocabulary rows"),
    (["--model-type", "BERT"], "--model-type BERT: convert.py converts GPT checkpoints"),
    (["--target-expert-parallel-size", "2"], "--target-expert-parallel-size 2: the model has no experts"),
])
def test_clear_errors(tmp_path, flags, message):
    args = model_args("gpt2")
    save_model(build_model(args), args, str(tmp_path / "tp1"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        convert(["--model-type", "GPT", "--load-dir", str(tmp_path / "tp1"), "--save-dir", str(tmp_path / "out"),
                 *flags])
    assert not os.path.exists(tmp_path / "out" / "latest_checkpointed_iteration.txt")


def test_saver_error_stops_a_loader_that_runs_ahead(tmp_path):
    args = model_args("gpt2")
    save_model(build_model(args), args, str(tmp_path / "tp1"))
    # A queue of 1 message: the loader blocks on put until the failed saver stops it; the saver's error wins.
    with pytest.raises(ValueError, match="TP 3 must divide"):
        _convert(tmp_path / "tp1", tmp_path / "out", "--max-queue-size", 1, "--target-tensor-parallel-size", 3)


def test_loader_error_is_reported_and_the_saver_stops(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no torch-format checkpoint"):
        _convert(tmp_path / "missing", tmp_path / "out")
