"""A manager's lifecycle (issue 28): a manager that loaded its engine stops and joins the engine
loop when it closes, so open/close cycles leave no thread and no engine (no model) behind; an
engine handed in is shared: it outlives every manager on it and keeps serving."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest

from sessions.engine import Engine
from sessions.errors import EngineStopped
from sessions.manager import SessionManager
from tests.conftest import make_settings
from tests.sessions.offload_helpers import open_manager

CYCLES = 3


def one_turn(manager: SessionManager) -> str:
    tenant = manager.create_tenant("acme")
    session_id = manager.open_session(tenant, system_prompt="Be brief.")
    return manager.chat(tenant, session_id, "hi", max_new_tokens=2).text


def test_open_close_cycles_that_load_their_engine_leave_no_extra_thread_and_no_engine(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    before = set(threading.enumerate())
    engines: list[weakref.ref[Engine]] = []
    for cycle in range(CYCLES):
        with SessionManager(make_settings(tmp_path / f"home{cycle}", model=str(tiny_model_dir))) as manager:
            one_turn(manager)
            started = {t.name for t in set(threading.enumerate()) - before}
            assert "chatkv-engine-loop" in started  # the loop ran this cycle's turn
            engines.append(weakref.ref(manager.internals.engine))
        del manager
        gc.collect()
        assert set(threading.enumerate()) - before == set()
        assert [engine() for engine in engines] == [None] * (cycle + 1)


def test_a_closed_engine_refuses_requests_and_its_loop_thread_is_gone(tiny_model_dir: Path, tmp_path: Path) -> None:
    before = set(threading.enumerate())
    manager = SessionManager(make_settings(tmp_path / "home", model=str(tiny_model_dir)))
    one_turn(manager)
    engine = manager.internals.engine
    manager.close()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(EngineStopped, match="the model's engine was closed by the manager that loaded it"):
        engine.prefill(engine.empty_cache(None).to_working_cache(2), [1, 2])
    engine.close()  # idempotent


def test_a_manager_sharing_an_engine_its_owner_closed_gets_a_typed_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    owner = SessionManager(make_settings(tmp_path / "owner", model=str(tiny_model_dir)))
    with open_manager(tmp_path / "sharer", owner.internals.engine) as sharer:
        tenant = sharer.create_tenant("acme")
        sid = sharer.open_session(tenant)
        owner.close()
        with pytest.raises(EngineStopped):
            sharer.chat(tenant, sid, "Hello", max_new_tokens=2)
        assert sharer.history(tenant, sid) == []  # nothing stored


def test_a_shared_engine_keeps_serving_after_each_manager_on_it_closed(tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "second", tiny_engine) as second:
        with open_manager(tmp_path / "first", tiny_engine) as first:
            first_reply = one_turn(first)
        assert one_turn(second) == first_reply  # served by the same engine after `first` closed
    with open_manager(tmp_path / "third", tiny_engine) as third:
        assert one_turn(third) == first_reply
