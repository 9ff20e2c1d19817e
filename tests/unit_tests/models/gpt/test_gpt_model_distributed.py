"""GPTModel on 2 gloo ranks: the Megatron-Core developer-guide snippet, TP/SP invariance against the
same model at TP=1, and tied embeddings split over two pipeline stages."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

SEQ, BATCH = 16, 2


def _batch(vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens[:, :-1], positions, tokens[:, 1:]


def _developer_guide_snippet(rank, world_size, tensor_parallel_size):
    get_cuda_rng_tracker().reset()  # a fresh process, as far as the RNG streams go
    # As in the Megatron-Core developer guide, with 2 layers instead of 12.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=1,
    )
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=768,
        num_attention_heads=12,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float16,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=50257,
        max_sequence_length=1024,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    tokens, positions, labels = _batch(50257)
    model.eval()
    with torch.no_grad():
        eval_loss = model(tokens, positions, None, labels=labels).mean().item()
    shard_rows = model.embedding.word_embeddings.weight.shape[0]

    if tensor_parallel_size == 1:  # the TP=1 run only provides the reference loss
        return eval_loss, shard_rows, None, True
    model.train()
    try:
        model(tokens, positions, None, labels=labels)
        dropout_without_seed = "no error"
    except RuntimeError as error:
        dropout_without_seed = str(error)
    model_parallel_cuda_manual_seed(123)
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    optimizer.step()
    return eval_loss, shard_rows, dropout_without_seed, torch.isfinite(loss).item()


def _developer_guide_snippet_at_tp1_and_tp2(rank, world_size):
    return [_developer_guide_snippet(rank, world_size, tensor_parallel_size) for tensor_parallel_size in (1, 2)]


def test_developer_guide_snippet_runs_at_tp1_and_tp2_with_the_same_initial_loss():
    tp1, tp2 = zip(*run_distributed(_developer_guide_snippet_at_tp1_and_tp2, 2))
    assert all(finite for *_, finite in tp1 + tp2)
    # vocab 50257 is odd: TP rank 0 holds 25129 rows, rank 1 the remaining 25128.
    assert [rows for _, rows, _, _ in tp2] == [25129, 25128]
    assert "model_parallel_cuda_manual_seed" in tp2[0][2]
    # use_cpu_initialization draws the same full weights at any TP size, so the model is the same.
    assert abs(tp1[0][0] - tp2[0][0]) < 1e-4
    assert abs(tp2[0][0] - tp2[1][0]) < 1e-6


def _configs():
    gpt2 = dict(
        config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, bias_activation_fusion=True),
        model=dict(vocab_size=97, share_embeddings_and_output_weights=True),
    )
    llama = dict(
        config=dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        ),
        model=dict(vocab_size=96, position_embedding_type="rope"),
    )
    return {"gpt2": gpt2, "llama": llama}


def _build(name, tensor_parallel_size, sequence_parallel=False):
    spec = _configs()[name]
    torch.manual_seed(7)
    config = TransformerConfig(
        **spec["config"], tensor_model_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), max_sequence_length=SEQ, **spec["model"])


def _shard_of(full: torch.Tensor, name: str, param, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of a full TP=1 tensor (fc1 of a GLU holds [gate_r; up_r])."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if "linear_fc1" in name and param.partition_stride == 2:
        return torch.cat([half.chunk(world_size, 0)[rank] for half in full.chunk(2, 0)])
    if full.shape[param.partition_dim] % world_size:  # uneven vocabulary: ceil-sized leading shards
        chunk = -(-full.shape[param.partition_dim] // world_size)
        length = min(chunk, full.shape[param.partition_dim] - rank * chunk)
        return full.narrow(param.partition_dim, rank * chunk, length)
    return full.chunk(world_size, param.partition_dim)[rank]


def _tp_invariance(name, rank, world_size, sequence_parallel):
    tokens, positions, labels = _batch(_configs()[name]["model"]["vocab_size"])
    parallel_state.destroy_model_parallel()
    reference = _build(name, 1)
    reference_loss = reference(tokens, positions, None, labels=labels)
    reference_loss.sum().backward()
    reference_logits = reference(tokens, positions, None).detach()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    model = _build(name, world_size, sequence_parallel)
    loss = model(tokens, positions, None, labels=labels)
    loss.sum().backward()
    logits = model(tokens, positions, None, runtime_gather_output=True).detach()

    tp_group = parallel_state.get_tensor_model_parallel_group()
    reference_params = dict(reference.named_parameters())
    worst = {
        "loss": (loss - reference_loss).abs().max().item(),
        "logits": (logits - reference_logits).abs().max().item(),
    }
    for param_name, param in model.named_parameters():
        expected = reference_params[param_name]
        grad = param.grad.clone()
        if getattr(param, "sequence_parallel", False):  # each rank saw part of the sequence
            dist.all_reduce(grad, group=tp_group)
        worst[param_name] = max(
            (param.detach() - _shard_of(expected.detach(), param_name, param, rank, world_size)).abs().max().item(),
            (grad - _shard_of(expected.grad, param_name, param, rank, world_size)).abs().max().item(),
        )
    return worst


def _tp_invariance_cases(rank, world_size):
    return {
        (name, sequence_parallel): _tp_invariance(name, rank, world_size, sequence_parallel)
        for name in ("gpt2", "llama")
        for sequence_parallel in (False, True)
    }


def test_tensor_and_sequence_parallel_match_tp1():
    """Loss, gathered logits, weights and grads at TP=2 (with and without SP) equal the TP=1 model's.
    The GPT-2 case has an odd vocabulary (97), so it covers the uneven vocab split too."""
    for per_rank in run_distributed(_tp_invariance_cases, 2):
        for case, worst in per_rank.items():
            bad = {key: value for key, value in worst.items() if value > 1e-5}
            assert not bad, f"{case}: {bad}"


def _pipeline_tied_embeddings(rank, world_size):
    config_args = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    vocab = 64
    tokens, positions, labels = _batch(vocab)
    torch.manual_seed(3)
    reference = GPTModel(
        TransformerConfig(**config_args), get_gpt_layer_local_spec(), vocab, SEQ,
        share_embeddings_and_output_weights=True,
    )
    reference_loss = reference(tokens, positions, None, labels=labels)
    reference_loss.sum().backward()

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = TransformerConfig(**config_args, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    first = rank == 0
    stage = GPTModel(
        config, get_gpt_layer_local_spec(), vocab, SEQ, pre_process=first, post_process=not first,
        share_embeddings_and_output_weights=True,
    )
    keys = sorted(stage.state_dict())
    embedding_weight = stage.shared_embedding_or_output_weight().detach().clone()
    layer_number = stage.decoder.layers[0].layer_number

    # Load the reference weights (stage 1's local layer 0 is global layer 1), then run the two stages.
    reference_state = reference.state_dict()
    state = {}
    for key in stage.state_dict():
        source = key.replace("decoder.layers.0.", f"decoder.layers.{rank}.")
        state[key] = reference_state["embedding.word_embeddings.weight" if key == "output_layer.weight" else source]
    stage.load_state_dict(state)
    if first:
        hidden = stage(tokens, positions, None)
        dist.send(hidden.detach(), dst=1)
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=1)
        hidden.backward(grad)
        loss_error = None
    else:
        received = torch.empty(SEQ, BATCH, 32)
        dist.recv(received, src=0)
        received.requires_grad_(True)
        stage.set_input_tensor(received)
        loss = stage(tokens, positions, None, labels=labels)
        loss.sum().backward()
        dist.send(received.grad, dst=0)
        loss_error = (loss - reference_loss).abs().max().item()
    shared = stage.shared_embedding_or_output_weight()
    dist.all_reduce(shared.grad, group=parallel_state.get_embedding_group())  # what finalize_model_grads does
    grad_error = (shared.grad - reference.embedding.word_embeddings.weight.grad).abs().max().item()
    return keys, embedding_weight, layer_number, loss_error, grad_error, getattr(shared, "shared_embedding", False)


def test_tied_embeddings_across_two_pipeline_stages():
    first, last = run_distributed(_pipeline_tied_embeddings, 2)
    assert "output_layer.weight" not in first[0] and "embedding.word_embeddings.weight" in first[0]
    assert "output_layer.weight" in last[0] and not any(key.startswith("embedding.") for key in last[0])
    torch.testing.assert_close(last[1], first[1])  # the last stage's copy was synced at construction
    assert (first[2], last[2]) == (1, 2)  # global layer numbers
    assert last[3] < 1e-5
    assert first[4] < 1e-5 and last[4] < 1e-5
    assert first[5] and last[5]
