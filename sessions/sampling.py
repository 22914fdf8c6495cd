"""Next-token selection: greedy at temperature 0, else temperature and nucleus (top-p) sampling.

Nucleus sampling as in Holtzman et al., "The Curious Case of Neural Text Degeneration" (2019).
"""

from __future__ import annotations

import torch

from sessions.turn_options import SamplingParams

__all__ = ["Sampler", "SamplingParams"]


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
