"""What the window tests share: a manager whose context budget forces eviction within a few of
`MESSAGES`, and the session cache the manager holds for a session."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cache.session_cache import SessionCache
from sessions.engine import Engine
from sessions.manager import SessionManager
from tests.conftest import make_settings

SYSTEM = "You answer in one short sentence."
MESSAGES = [f"note {i}: the parcel number is {1000 + 37 * i}, remember it" for i in range(12)]
BUDGET, RECENT = 200, 24


def open_windowed(home: Path, engine: Engine, policy: str, **overrides: object) -> SessionManager:
    """A manager with a `BUDGET`-token context under `policy`, keeping the last `RECENT` tokens."""
    values: dict[str, object] = {
        "context_budget_tokens": BUDGET,
        "window_policy": policy,
        "window_recent_tokens": RECENT,
        **overrides,
    }
    return SessionManager(make_settings(home, **values), engine=engine)


def cache_of(manager: SessionManager, tenant: str, sid: str) -> SessionCache:
    """The cache the manager holds for `sid` in whichever tier; fails the test when there is none."""
    cache = manager.internals.tiers.peek(manager.internals.tiers_key(tenant, sid))
    assert cache is not None
    return cache


def record_reservations(manager: SessionManager, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The device bytes reserved from now on by the test's own thread (the turn's buffers: the
    engine loop's thread reserves its own, not counted), in order, as a list that fills as they come."""
    reserved: list[int] = []
    reserve = manager.internals.tiers.reserve_device_bytes

    def recording(nbytes: int, *, force: bool) -> bool:
        if threading.current_thread() is threading.main_thread():
            reserved.append(nbytes)
        return reserve(nbytes, force=force)

    monkeypatch.setattr(manager.internals.tiers, "reserve_device_bytes", recording)
    return reserved


def record_reconstructions(manager: SessionManager, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The context ids of every KVzip reconstruction the manager's turns run from now on
    (`TurnWindow.reconstruction_scores`, run by the runner when an `agnostic` turn commits), in
    order, as a list that fills as they come (from any thread)."""
    calls: list[tuple[int, ...]] = []
    fitting = manager.internals.runner.preparer.fitting
    reconstruct = fitting.reconstruction_scores

    def recording(cache: SessionCache, context_ids: Sequence[int], *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(tuple(context_ids))
        return reconstruct(cache, context_ids, *args, **kwargs)

    monkeypatch.setattr(fitting, "reconstruction_scores", recording)
    return calls
