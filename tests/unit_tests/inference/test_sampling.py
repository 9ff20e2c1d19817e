"""Next-token choice: greedy, temperature, top-k and top-p against distributions worked out independently
(numpy sorting and softmax, a hand-worked nucleus), with a fixed generator so the draws are repeatable.

Statistical checks draw N = 4000 samples per row: every draw must lie in the expected support, and each
frequency must be within 0.03 of the expected probability (the standard error is at most 0.008).
"""

import numpy as np
import pytest
import torch

from megatron.core.inference import SamplingParams, filter_top_k, filter_top_p, sample_from_logits

DRAWS = 4000
VOCAB = 12


def _logits(rows=3, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _frequencies(logits, params, seed=1):
    """[rows, V] empirical distribution of DRAWS samples per row."""
    repeated = logits.repeat_interleave(DRAWS, dim=0)
    draws = sample_from_logits(repeated, params, generator=torch.Generator().manual_seed(seed)).view(-1, DRAWS)
    return np.stack([np.bincount(row.numpy(), minlength=VOCAB) / DRAWS for row in draws])


def _expected_top_k(row, k, temperature=1.0):
    keep = np.argsort(-row)[:k]
    probs = np.zeros_like(row)
    probs[keep] = _softmax(row[keep] / temperature)
    return probs


def _expected_top_p(probs, p):
    """Smallest set of most likely tokens holding at least p, renormalised (written as a loop)."""
    kept, mass = [], 0.0
    for token in np.argsort(-probs):
        kept.append(token)
        mass += probs[token]
        if mass >= p:
            break
    out = np.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def _assert_matches(frequencies, expected):
    assert np.all(frequencies[expected == 0] == 0), "a filtered-out token was sampled"
    np.testing.assert_allclose(frequencies, expected, atol=0.03)


def test_greedy_and_top_k_1_take_the_argmax():
    logits = _logits(rows=8)
    expected = np.argmax(logits.numpy(), axis=1)
    for params in (SamplingParams(use_greedy=True), SamplingParams(top_k=1), SamplingParams(top_k=1, temperature=3.0)):
        np.testing.assert_array_equal(sample_from_logits(logits, params).numpy(), expected)


def test_temperature_scales_the_distribution():
    logits = _logits()
    for temperature in (0.5, 2.0):
        expected = np.stack([_softmax(row / temperature) for row in logits.numpy().astype(np.float64)])
        _assert_matches(_frequencies(logits, SamplingParams(temperature=temperature)), expected)


@pytest.mark.parametrize("top_k", [2, 5])
def test_top_k_samples_only_the_k_most_likely(top_k):
    logits = _logits()
    params = SamplingParams(top_k=top_k, temperature=0.7)
    expected = np.stack([_expected_top_k(row, top_k, 0.7) for row in logits.numpy().astype(np.float64)])
    assert np.all((expected > 0).sum(axis=1) == top_k)
    _assert_matches(_frequencies(logits, params), expected)


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_top_p_samples_only_the_nucleus(top_p):
    logits = _logits()
    expected = np.stack([_expected_top_p(_softmax(row), top_p) for row in logits.numpy().astype(np.float64)])
    _assert_matches(_frequencies(logits, SamplingParams(top_p=top_p)), expected)


def test_top_k_then_top_p():
    logits = _logits()
    expected = np.stack(
        [_expected_top_p(_expected_top_k(row, 6), 0.8) for row in logits.numpy().astype(np.float64)]
    )
    _assert_matches(_frequencies(logits, SamplingParams(top_k=6, top_p=0.8)), expected)


def test_top_p_hand_worked_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: p = 0.7 and p = 0.8 keep the first two (0.8 >= p), p = 0.81 three.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()

    def kept(top_p):
        return torch.isfinite(filter_top_p(logits, top_p))[0].tolist()

    assert kept(0.7) == [True, True, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]


def test_top_k_hand_worked():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    assert torch.isfinite(filter_top_k(logits, 2))[0].tolist() == [False, True, True, False, False]
    assert torch.isfinite(filter_top_k(logits, 9)).all()  # k beyond the vocabulary keeps everything


def test_padded_vocabulary_rows_are_never_chosen():
    logits = _logits(rows=4)
    logits[:, VOCAB - 2:] = 100.0  # padding rows with the largest logits
    greedy = sample_from_logits(logits, SamplingParams(use_greedy=True), vocab_size=VOCAB - 2)
    sampled = sample_from_logits(
        logits.repeat(500, 1), SamplingParams(), vocab_size=VOCAB - 2, generator=torch.Generator().manual_seed(0)
    )
    assert greedy.max() < VOCAB - 2 and sampled.max() < VOCAB - 2


def test_the_generator_makes_draws_repeatable():
    logits = _logits(rows=64)

    def draw(seed):
        return sample_from_logits(logits, SamplingParams(), generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.0}, "temperature must be a positive number"),
        ({"temperature": float("nan")}, "temperature must be a positive number"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"top_p": 1.5}, "top_p must be in [0, 1]"),
        ({"top_p": -0.1}, "top_p must be in [0, 1]"),
    ],
)
def test_invalid_sampling_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError) as error:
        SamplingParams(temperature=-1.0, top_k=-2, top_p=3.0)
    assert all(name in str(error.value) for name in ("temperature", "top_k", "top_p"))
