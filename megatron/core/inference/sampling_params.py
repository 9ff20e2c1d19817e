"""How the next token is chosen (Megatron-Core's `SamplingParams`, the fields this project implements)."""

import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """Greedy decoding or sampling with temperature, top-k and top-p (nucleus) filtering.

    `use_greedy` (or `top_k` = 1, Megatron's spelling of greedy) takes the most likely token and ignores
    the rest. Otherwise the logits are divided by `temperature`, then `top_k` > 0 keeps the k most likely
    tokens, then 0 < `top_p` < 1 keeps the smallest set of most likely tokens whose probability reaches
    top_p; `top_k` = 0 and `top_p` = 0 (or 1) switch the filters off. Both filters may be combined.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    use_greedy: bool = False

    def __post_init__(self):
        problems = []
        temperature_ok = isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
        if not (temperature_ok and self.temperature > 0):
            problems.append(
                f"temperature must be a positive number, got {self.temperature!r} (for the most likely token "
                "every time, use greedy decoding)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off, 1 = greedy), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 <= self.top_p <= 1.0):
            problems.append(f"top_p must be in [0, 1] (0 = off), got {self.top_p!r}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        """True when the argmax is taken (no randomness)."""
        return self.use_greedy or self.top_k == 1
