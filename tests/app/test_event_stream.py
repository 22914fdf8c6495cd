"""`EventStream` closes its frames however the response ends, and a stream whose generator never
ran (the client gone before the first frame was asked for) still runs the route's clean-up: closing
an unstarted generator does not run its `finally` (the idempotency key would stay claimed)."""

from __future__ import annotations

from collections.abc import Generator

from app.http.sse import EventStream


def _frames(calls: list[str]) -> Generator[str, None, None]:
    try:
        yield "data: 1\n\n"
        yield "data: 2\n\n"
    finally:
        calls.append("finally")


def test_a_stream_that_never_started_runs_its_unstarted_clean_up_then_its_callbacks() -> None:
    calls: list[str] = []
    stream = EventStream(_frames(calls), unstarted=lambda: calls.append("unstarted"))
    stream.call_on_close(lambda: calls.append("on close"))
    stream._close()
    assert calls == ["unstarted", "on close"]


def test_a_started_stream_runs_its_own_finally_and_not_the_unstarted_clean_up() -> None:
    calls: list[str] = []
    frames = _frames(calls)
    stream = EventStream(frames, unstarted=lambda: calls.append("unstarted"))
    stream.call_on_close(lambda: calls.append("on close"))
    next(frames)
    stream._close()
    assert calls == ["finally", "on close"]
