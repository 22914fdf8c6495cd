"""The options of one turn, as one frozen value: how tokens are picked and what ends the reply.

Every face builds a `TurnOptions` from its own request shape (OpenAI's names and defaults, the
session routes', the chat page's sliders) and hands it over whole; `SessionManager.chat`,
`stream_chat` and `continue_history` also take the fields as keyword arguments and build it.
Torch-free, so a face checks a request's options (a 400) before anything loads or is stored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from sessions.errors import InvalidInput
from sessions.turn.stop_strings import StopStrings


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


class TurnOptionKeywords(TypedDict, total=False):
    """`TurnOptions`' fields as keyword arguments (`SessionManager.chat(..., max_new_tokens=64)`)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: Sequence[str]
    min_new_tokens: int
    ignore_eos: bool


@dataclass(frozen=True)
class TurnOptions:
    """Sampling (`SamplingParams`: chatkv's defaults, greedy) and stop strings (`StopStrings`: up
    to 4, the reply ends before the first) of one turn, checked at construction.

    Raises:
        InvalidInput: for any value a turn would refuse (see `SamplingParams`, `StopStrings`).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    """Kept as a tuple."""
    min_new_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", self.stop_strings.strings)
        self.sampling  # noqa: B018  # checked now: a face answers 400 before any work

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            self.max_new_tokens, self.temperature, self.top_p, self.seed, self.min_new_tokens, self.ignore_eos
        )

    @property
    def stop_strings(self) -> StopStrings:
        return StopStrings(self.stop)

    @classmethod
    def of(cls, options: TurnOptions | None, keywords: Mapping[str, Any]) -> TurnOptions:
        """`options` (default: chatkv's) with the fields `keywords` name replaced.

        Raises:
            InvalidInput: for a value a turn would refuse.
            TypeError: for a keyword that is not a field.
        """
        base = options if options is not None else DEFAULT_OPTIONS
        return dataclasses.replace(base, **keywords) if keywords else base


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


DEFAULT_OPTIONS = TurnOptions()
