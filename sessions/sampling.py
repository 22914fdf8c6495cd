"""Next-token selection: greedy at temperature 0, else temperature and nucleus (top-p) sampling.

Nucleus sampling as in Holtzman et al., "The Curious Case of Neural Text Degeneration" (2019).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sessions.errors import InvalidInput


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `seed` makes sampling at `temperature > 0` reproducible.

    `min_new_tokens` (vLLM's `min_tokens`): the stop tokens cannot be sampled before the reply has
    that many tokens (their logits are masked), and stop strings are looked for only in the text
    after them. `ignore_eos`: the stop tokens are never sampled, so the reply runs to
    `max_new_tokens` (stop strings still end it). Masking, rather than generating past a stop
    token as vLLM's `ignore_eos` does, keeps every stored reply a well-formed turn.

    Raises:
        InvalidInput: for `max_new_tokens < 1`, `min_new_tokens` outside [0, max_new_tokens], a
            negative temperature or `top_p` outside (0, 1].
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidInput(
                f"min_new_tokens must be an integer from 0 to max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidInput(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise InvalidInput(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidInput(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_tokens_allowed(self, generated_tokens: int) -> bool:
        """May a stop token end the reply once it has `generated_tokens` tokens?"""
        return not self.ignore_eos and generated_tokens >= self.min_new_tokens


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


class Sampler:
    """Picks one token id from `[vocab]` logits (any float dtype)."""

    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device="cpu")
            if params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self._generator is None:
            return int(torch.argmax(logits).item())
        # Subtracting the maximum first keeps a tiny temperature from overflowing to inf - inf.
        work = logits.detach().to(dtype=torch.float64, device="cpu")
        probs = torch.softmax((work - work.max()) / self._params.temperature, dim=-1)
        if self._params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it
            # is below top_p, so the most likely token always stays.
            keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < self._params.top_p
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = int(torch.multinomial(sorted_probs, 1, generator=self._generator).item())
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
