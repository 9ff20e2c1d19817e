"""Text generation: a KV-cache inference context, next-token sampling, and the generation loop.

    from megatron.core.inference import SamplingParams, generate
    texts = generate(model, tokenizer, ["Once upon a time"], max_new_tokens=32,
                     sampling_params=SamplingParams(temperature=0.8, top_p=0.9),
                     generator=torch.Generator().manual_seed(1234))
"""

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.generation import generate, generate_tokens
from megatron.core.inference.sampling import filter_top_k, filter_top_p, sample_from_logits
from megatron.core.inference.sampling_params import SamplingParams

__all__ = [
    "SamplingParams",
    "StaticInferenceContext",
    "filter_top_k",
    "filter_top_p",
    "generate",
    "generate_tokens",
    "sample_from_logits",
]
