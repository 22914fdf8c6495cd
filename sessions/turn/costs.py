"""Restore or recompute: for a session whose cache is in a lower tier, the cheaper of bringing it
back (decrypt, decode, move to the device) and prefilling its tokens again, from measured rates.

Both are modelled as a fixed cost plus a cost per token, fitted by least squares over the recent
turns that did each (per tier for restores):

    restore_s(tier, n) = a_tier + n * b_tier          recompute_s(n) = c + n * d

so a short session (the fixed cost of opening a blob dominates) or a slow tier (a far Redis) is
prefilled again, and a long session on a fast tier is restored. Until a path has been measured
`MIN_SAMPLES` times its estimate is unknown and the cache is restored (which measures it). The
estimates and the choice are reported with each turn (`TurnStats`) and counted in metrics.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

SAMPLES = 32
"""Recent observations a fit uses (per tier, and for prefill)."""
MIN_SAMPLES = 3
MIN_PREFILL_TOKENS = 16
"""Prefills shorter than this are not measured: fixed overheads drown their per-token cost."""


@dataclass(frozen=True)
class RestoreChoice:
    """What a turn did with a stored cache, and why.

    Attributes:
        recompute: prefill the session's tokens instead of restoring its cache.
        restore_s, recompute_s: the two estimates in seconds (`None`: not measured enough yet).
    """

    recompute: bool
    restore_s: float | None
    recompute_s: float | None


class _Fit:
    """Least-squares line `seconds = fixed + tokens * per_token` over recent observations."""

    def __init__(self) -> None:
        self._points: deque[tuple[int, float]] = deque(maxlen=SAMPLES)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._points.append((tokens, seconds))

    def estimate(self, tokens: int) -> float | None:
        points: Sequence[tuple[int, float]] = tuple(self._points)
        if len(points) < MIN_SAMPLES:
            return None
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        if spread == 0:  # one size seen: no slope to tell, scale the mean rate
            return mean_y * tokens / mean_x
        per_token = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
        fixed = max(0.0, mean_y - per_token * mean_x)
        return fixed + per_token * tokens


class RestoreCosts:
    """The running measures and the choice (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._restores: dict[str, _Fit] = {}
        self._prefill = _Fit()
        self._lock = threading.Lock()

    def restored(self, tier: str, tokens: int, seconds: float) -> None:
        """A restore of `tokens` cached tokens from `tier` took `seconds`."""
        with self._lock:
            self._restores.setdefault(tier, _Fit()).add(tokens, seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A turn prefilled `tokens` in `seconds` (its time to first token less restore and queue)."""
        if tokens >= MIN_PREFILL_TOKENS:
            with self._lock:
                self._prefill.add(tokens, seconds)

    def choose(self, tier: str, tokens: int) -> RestoreChoice:
        """Restore from `tier`, or recompute, a cache of `tokens` tokens."""
        with self._lock:
            fit = self._restores.get(tier)
            restore_s = fit.estimate(tokens) if fit is not None else None
            recompute_s = self._prefill.estimate(tokens)
        recompute = restore_s is not None and recompute_s is not None and recompute_s < restore_s
        return RestoreChoice(recompute, restore_s, recompute_s)
