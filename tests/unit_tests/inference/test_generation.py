"""The generation loop: greedy with the KV cache equals greedy by full recomputation (a plain loop over
the whole sequence, no cache) and `transformers`' own `generate`, token for token; a batch of prompts of
different lengths equals the prompts one by one; rows stop at the termination token."""

import pytest
import torch

from megatron.core.inference import SamplingParams, generate, generate_tokens
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from tests.unit_tests.inference.tiny_models import MAX_POSITIONS, PAIRS, VOCAB, full_forward_logits, random_tokens

NEW_TOKENS = 12


def _prompts(lengths=(5, 1, 9, 3), seed=3):
    return [random_tokens(1, length, seed=seed + i)[0].tolist() for i, length in enumerate(lengths)]


def _greedy_by_recomputation(model, prompt, new_tokens):
    """The reference: run the full sequence through the model for every new token, take the argmax."""
    sequence = list(prompt)
    for _ in range(new_tokens):
        logits = full_forward_logits(model, torch.tensor([sequence]))
        sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt):]


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request):
    return PAIRS[request.param]()


def test_greedy_with_cache_equals_full_recomputation(pair):
    _, model = pair
    for prompt in _prompts():
        assert generate_tokens(model, [prompt], NEW_TOKENS) == [_greedy_by_recomputation(model, prompt, NEW_TOKENS)]


def test_greedy_equals_transformers_generate(pair):
    hf, model = pair
    hf.generation_config.eos_token_id = None  # run the full length, as generate_tokens without termination_id
    for prompt in _prompts():
        input_ids = torch.tensor([prompt])
        expected = hf.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert len(expected) == NEW_TOKENS
        assert generate_tokens(model, [prompt], NEW_TOKENS) == [expected]


def test_batch_of_different_lengths_equals_one_by_one(pair):
    _, model = pair
    prompts = _prompts()
    one_by_one = [generate_tokens(model, [prompt], NEW_TOKENS)[0] for prompt in prompts]
    assert generate_tokens(model, prompts, NEW_TOKENS) == one_by_one
    assert generate_tokens(model, prompts[::-1], NEW_TOKENS) == one_by_one[::-1]


def test_top_k_1_equals_greedy(pair):
    _, model = pair
    prompts = _prompts()
    sampled = generate_tokens(
        model, prompts, NEW_TOKENS, SamplingParams(top_k=1, temperature=5.0), generator=torch.Generator().manual_seed(0)
    )
    assert sampled == generate_tokens(model, prompts, NEW_TOKENS, SamplingParams(use_greedy=True))


def test_rows_stop_at_the_termination_token(pair):
    _, model = pair
    prompts = _prompts()
    free = generate_tokens(model, prompts, NEW_TOKENS)
    stop = free[0][4]  # the fifth new token of the first row: that row must end right there
    stopped = generate_tokens(model, prompts, NEW_TOKENS, termination_id=stop)
    for row, tokens in zip(stopped, free):
        expected = tokens[: tokens.index(stop) + 1] if stop in tokens else tokens
        assert row == expected
    assert stopped[0] == free[0][: free[0].index(stop) + 1] and len(stopped[0]) <= 5


def test_sampling_is_reproducible_and_stays_in_the_vocabulary(pair):
    _, model = pair
    prompts = _prompts()
    params = SamplingParams(temperature=1.5, top_p=0.95)
    draw = [generate_tokens(model, prompts, NEW_TOKENS, params, vocab_size=VOCAB - 10,
                            generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert draw[0] == draw[1]
    assert all(0 <= token < VOCAB - 10 for row in draw[0] for token in row)


def test_tensor_and_pipeline_parallel_models_are_refused():
    _, model = PAIRS["gpt2"]()
    model.config.tensor_model_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_model_parallel_size 1 only for now, got 2"):
        generate_tokens(model, [[1, 2]], 2)
    model.config.tensor_model_parallel_size = 1
    model.post_process = False
    with pytest.raises(ValueError, match="pipeline parallelism is not supported yet"):
        generate_tokens(model, [[1, 2]], 2)


def test_model_mode_is_restored():
    _, model = PAIRS["gpt2"]()
    model.train()
    generate_tokens(model, [[1, 2, 3]], 2)
    assert model.training


def test_text_generation_with_a_tokenizer():
    _, model = PAIRS["llama"]()
    tokenizer = NullTokenizer(VOCAB)  # text "12 7 40" <-> ids; end of document = VOCAB - 1
    prompts = ["12 7 40", ""]
    texts = generate(model, tokenizer, prompts, NEW_TOKENS, stop_at_eod=False)
    new_tokens = generate_tokens(model, [[12, 7, 40], [VOCAB - 1]], NEW_TOKENS)
    assert texts[0] == " ".join(str(token) for token in [12, 7, 40] + new_tokens[0])
    # An empty prompt starts from the end-of-document token, which the text leaves out.
    assert texts[1] == " ".join(str(token) for token in new_tokens[1])


def test_text_generation_stops_at_end_of_document():
    _, model = PAIRS["llama"]()
    free = generate_tokens(model, [[12, 7, 40]], NEW_TOKENS)[0]
    tokenizer = NullTokenizer(VOCAB, eod_id=free[2])
    (text,) = generate(model, tokenizer, ["12 7 40"], NEW_TOKENS)
    assert text == " ".join(str(token) for token in [12, 7, 40] + free[: free.index(free[2])])


@pytest.mark.parametrize(
    "prompts, new_tokens, message",
    [
        ([[1] * 60], 5, "the longest prompt \\(60 tokens\\) plus 5 new tokens exceeds the model's max_sequence_length "
                        f"of {MAX_POSITIONS} positions .*ask for at most 4 new tokens"),
        ([[1, 2], []], 3, r"prompts \[1\] have no tokens"),
        ([], 3, "no prompts"),
        ([[1]], 0, "max_new_tokens must be a positive integer, got 0"),
    ],
)
def test_bad_requests_are_refused(prompts, new_tokens, message):
    _, model = PAIRS["gpt2"]()
    with pytest.raises(ValueError, match=message):
        generate_tokens(model, prompts, new_tokens)
