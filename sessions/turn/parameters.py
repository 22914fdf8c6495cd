"""The parameters of a turn as a face checks them before any work (an HTTP route answers 400 before
it reads a session)."""

from __future__ import annotations

from collections.abc import Sequence


def check_turn_parameters(
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop: Sequence[str],
    *,
    min_new_tokens: int = 0,
    ignore_eos: bool = False,
) -> None:
    """Raises `InvalidInput` for sampling parameters or stop strings a turn would refuse: the
    checks `SessionManager.stream_chat` makes."""
    from sessions.sampling import SamplingParams  # imports torch: only once a turn is asked for
    from sessions.turn.stop_strings import StopStrings

    SamplingParams(max_new_tokens, temperature, top_p, seed, min_new_tokens, ignore_eos)
    StopStrings(stop)
