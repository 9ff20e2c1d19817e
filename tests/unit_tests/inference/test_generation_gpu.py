"""Generation on a CUDA device: the cached forward with the CUDA SDPA kernels, greedy tokens equal to
those on the CPU, and a CUDA generator for reproducible sampling. Skipped without a GPU."""

import pytest
import torch

from megatron.core.inference import SamplingParams, StaticInferenceContext, generate_tokens
from tests.unit_tests.inference.tiny_models import PAIRS, full_forward_logits, random_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _prompts():
    return [random_tokens(1, length, seed=20 + length)[0].tolist() for length in (6, 2, 11)]


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_cached_forward_on_cuda_equals_full_forward(name):
    model = PAIRS[name]()[1].cuda()
    tokens = random_tokens(2, 12).cuda()
    expected = full_forward_logits(model, tokens)
    context = StaticInferenceContext(2, 12, materialize_only_last_token_logits=False)
    outputs, start = [], 0
    with torch.no_grad():
        for end in (4, 7, 8, 12):
            positions = torch.arange(start, end, device="cuda").expand(2, end - start)
            outputs.append(model(tokens[:, start:end], positions, None, inference_context=context))
            context.increment_sequence_len_offset(end - start)
            start = end
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_greedy_tokens_on_cuda_equal_the_cpu(name):
    model = PAIRS[name]()[1]
    on_cpu = generate_tokens(model, _prompts(), 10)
    assert generate_tokens(model.cuda(), _prompts(), 10) == on_cpu


def test_sampling_with_a_cuda_generator_is_reproducible():
    model = PAIRS["llama"]()[1].cuda()
    params = SamplingParams(temperature=1.2, top_k=20, top_p=0.9)
    draws = [generate_tokens(model, _prompts(), 10, params, generator=torch.Generator("cuda").manual_seed(3))
             for _ in range(2)]
    assert draws[0] == draws[1]
