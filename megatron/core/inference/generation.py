"""Autoregressive generation with a KV cache, for a batch of prompts of different lengths.

Prompts are right-padded into one [b, prompt + new] token buffer and the batch advances one position at
a time, as Megatron's static generation loop does. The first forward pass (prefill) reads the first
`min(prompt lengths)` tokens of every row; each later pass reads one token per row. At position t a row
whose prompt is longer than t keeps its prompt token and ignores the model's choice; the other rows take
the sampled one. So every row sees exactly the tokens it would see alone, at the same positions, and
no padding ever enters attention (the causal mask alone is right).
"""

import torch

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.sampling import sample_from_logits
from megatron.core.inference.sampling_params import SamplingParams


def _check_request(model, prompt_tokens, max_new_tokens: int) -> None:
    if not getattr(model, "pre_process", True) or not getattr(model, "post_process", True):
        raise ValueError("generation needs the whole model on one rank: pipeline parallelism is not supported yet")
    tensor_parallel = getattr(getattr(model, "config", None), "tensor_model_parallel_size", 1)
    if tensor_parallel != 1:
        # Each rank's logits would cover only its V/p slice of the vocabulary.
        raise ValueError(f"generation supports tensor_model_parallel_size 1 only for now, got {tensor_parallel}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not prompt_tokens:
        raise ValueError("no prompts to generate from")
    empty = [index for index, tokens in enumerate(prompt_tokens) if len(tokens) == 0]
    if empty:
        raise ValueError(f"prompts {empty} have no tokens; every prompt needs at least one")
    longest = max(len(tokens) for tokens in prompt_tokens)
    limit = getattr(model, "max_sequence_length", None)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus {max_new_tokens} new tokens exceeds the model's "
            f"max_sequence_length of {limit} positions (--max-position-embeddings); ask for at most "
            f"{max(limit - longest, 0)} new tokens or shorten the prompt"
        )


def _until_termination(tokens: list[int], termination_id: int | None) -> list[int]:
    if termination_id is not None and termination_id in tokens:
        return tokens[: tokens.index(termination_id) + 1]
    return tokens


@torch.no_grad()
def generate_tokens(
    model,
    prompt_tokens: list[list[int]],
    max_new_tokens: int,
    sampling_params: SamplingParams | None = None,
    termination_id: int | None = None,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The new token ids of each prompt: `max_new_tokens` of them, or fewer when the row produced
    `termination_id` (kept as its last token).

    `model` is a GPTModel-like module (`model(ids, positions, mask, inference_context=...)` -> logits
    [b, s, V]), run in eval mode on its own device. `vocab_size` keeps the padded vocabulary rows out
    of the choice; `generator` makes sampling reproducible. Greedy by default.
    """
    sampling_params = sampling_params or SamplingParams(use_greedy=True)
    _check_request(model, prompt_tokens, max_new_tokens)
    device = next(model.parameters()).device
    batch = len(prompt_tokens)
    lengths = torch.tensor([len(tokens) for tokens in prompt_tokens], device=device)
    total_length = int(lengths.max()) + max_new_tokens
    tokens = torch.zeros(batch, total_length, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompt_tokens):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    positions = torch.arange(total_length, device=device).expand(batch, total_length)
    row_ends = lengths + max_new_tokens  # [b], exclusive end of each row's new tokens
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    context = StaticInferenceContext(batch, total_length)

    was_training = model.training
    model.eval()
    try:
        start = 0
        for position in range(int(lengths.min()), total_length):
            logits = model(
                tokens[:, start:position], positions[:, start:position], None, inference_context=context
            )  # [b, 1, V]
            context.increment_sequence_len_offset(position - start)
            start = position
            chosen = sample_from_logits(logits[:, -1, :], sampling_params, vocab_size, generator)  # [b]
            in_prompt = position < lengths
            tokens[:, position] = torch.where(in_prompt, tokens[:, position], chosen)
            if termination_id is not None:
                finished |= ~in_prompt & (chosen == termination_id)
            finished |= position + 1 >= row_ends
            if bool(finished.all()):
                break
    finally:
        model.train(was_training)

    rows = tokens.tolist()
    return [
        _until_termination(rows[row][len(prompt) : len(prompt) + max_new_tokens], termination_id)
        for row, prompt in enumerate(prompt_tokens)
    ]


def generate(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    sampling_params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    stop_at_eod: bool = True,
) -> list[str]:
    """Each prompt followed by its continuation, as text (Megatron's "prompts plus generations").

    Prompt and new tokens are detokenized together, so that tokenizers which join tokens with spaces or
    merge bytes across the boundary give the right text. `tokenizer` is a Megatron tokenizer
    (`tokenize`, `detokenize`, `vocab_size`, `eod`). A row stops at the end-of-document token when
    `stop_at_eod` (the token itself is left out of the text). An empty prompt starts from the
    end-of-document token: an unconditional sample, as GPT-2's.
    """
    eod = getattr(tokenizer, "eod", None)
    prompt_tokens = []
    for index, prompt in enumerate(prompts):
        tokens = tokenizer.tokenize(prompt) if prompt else []
        if not tokens and eod is None:
            raise ValueError(f"prompt {index} is empty and the tokenizer has no end-of-document token to start from")
        prompt_tokens.append(tokens)
    termination_id = eod if stop_at_eod else None
    generated = generate_tokens(
        model, [tokens or [eod] for tokens in prompt_tokens], max_new_tokens, sampling_params, termination_id,
        tokenizer.vocab_size, generator,
    )
    texts = []
    for prompt, new_tokens in zip(prompt_tokens, generated):
        if termination_id is not None and new_tokens and new_tokens[-1] == termination_id:
            new_tokens = new_tokens[:-1]
        texts.append(tokenizer.detokenize(prompt + new_tokens))
    return texts
