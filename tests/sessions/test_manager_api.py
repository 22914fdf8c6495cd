"""The public API's contract on bad input and isolation: typed errors, nothing half-stored."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cache.tiers import Tier
from sessions.engine import Engine
from sessions.errors import (
    ContextTooLong,
    InvalidInput,
    SessionBusy,
    SessionNotFound,
    TenantExists,
    TenantNotFound,
)
from sessions.manager import SessionManager
from sessions.turn_options import TurnOptions
from tests.conftest import make_settings


def test_tenants_are_created_listed_and_resolved_by_id_or_name(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    beta = tiny_manager.create_tenant("beta")
    assert [t.name for t in tiny_manager.list_tenants()] == ["acme", "beta"]
    assert tiny_manager.get_tenant(acme.id) == acme == tiny_manager.get_tenant("acme")
    assert tiny_manager.get_tenant(beta) == beta
    with pytest.raises(TenantExists):
        tiny_manager.create_tenant("acme")
    for bad in ("", "a b", "x" * 65, "tn_sneaky", "-dash"):
        with pytest.raises(InvalidInput):
            tiny_manager.create_tenant(bad)
    with pytest.raises(TenantNotFound):
        tiny_manager.get_tenant("nobody")


def test_another_tenants_session_is_indistinguishable_from_a_missing_one(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    beta = tiny_manager.create_tenant("beta")
    sid = tiny_manager.open_session(acme, title="private")
    tiny_manager.chat(acme, sid, "secret plans", max_new_tokens=4)
    missing = "s_000000000000000000000000"
    for call in (
        lambda s: tiny_manager.chat(beta, s, "hi", max_new_tokens=2),
        lambda s: tiny_manager.history(beta, s),
        lambda s: tiny_manager.session_info(beta, s),
        lambda s: tiny_manager.delete_session(beta, s),
        lambda s: tiny_manager.pin_turn(beta, s, 0),
        lambda s: tiny_manager.evict_session(beta, s, "disk"),
        lambda s: tiny_manager.inspect_session(beta, s),
    ):
        with pytest.raises(SessionNotFound) as theirs:
            call(sid)
        with pytest.raises(SessionNotFound) as absent:
            call(missing)
        assert str(theirs.value).replace(sid, "ID") == str(absent.value).replace(missing, "ID")
    assert [s.id for s in tiny_manager.list_sessions(beta)] == []
    assert len(tiny_manager.history(acme, sid)) == 2


def test_bad_messages_and_parameters_are_rejected_before_anything_is_stored(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    for kwargs in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(InvalidInput):
            tiny_manager.chat(tenant, sid, "hi", **kwargs)  # type: ignore[arg-type]
    for message in ("", "   \n"):
        with pytest.raises(InvalidInput):
            tiny_manager.chat(tenant, sid, message)
    assert tiny_manager.history(tenant, sid) == []
    assert tiny_manager.session_info(tenant, sid).token_count == 0


def test_a_max_tokens_over_the_context_names_both_parts_and_the_largest_max_tokens_that_fits(
    tmp_path: Path, tiny_engine: Engine
) -> None:
    with SessionManager(make_settings(tmp_path / "home", context_budget_tokens=256), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant)
        with pytest.raises(ContextTooLong) as error:
            manager.chat(tenant, sid, "hi", max_new_tokens=100_000)
        prompt = error.value.prompt_tokens
        assert (error.value.needed_tokens, error.value.reply_tokens, error.value.limit_tokens) == (
            prompt + 100_000,
            100_000,
            256,
        )
        assert str(error.value) == (
            f"reply too long for the context: the turn needs {prompt + 100_000} tokens of context ({prompt} in the "
            f"prompt, up to 100000 in the reply), the limit is 256: lower max tokens to {256 - prompt} or less"
        )
        reply = manager.chat(tenant, sid, "hi", max_new_tokens=256 - prompt)  # the number it named fits
        assert len(reply.token_ids) == reply.stats.decode_tokens == 256 - prompt and reply.finish_reason == "length"
        with pytest.raises(ContextTooLong) as error:
            manager.chat(tenant, sid, "word " * 300, max_new_tokens=4)
        prompt = error.value.prompt_tokens
        assert str(error.value) == (
            f"message too long: the turn needs {prompt + 4} tokens of context ({prompt} in the prompt, "
            "up to 4 in the reply), the limit is 256: the prompt alone is over it, shorten the message"
        )


def test_message_longer_than_the_context_raises_context_too_long_and_stores_nothing(
    tiny_manager: SessionManager,
) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    first = tiny_manager.chat(tenant, sid, "hello", max_new_tokens=4)
    before = tiny_manager.session_info(tenant, sid)
    cache_before = tiny_manager.internals.tiers.peek(tiny_manager.internals.tiers_key(tenant, sid))
    huge = "word " * (tiny_manager.context_budget_tokens + 10)
    with pytest.raises(ContextTooLong) as error:
        tiny_manager.chat(tenant, sid, huge, max_new_tokens=4)
    assert error.value.limit_tokens == tiny_manager.context_budget_tokens
    assert error.value.needed_tokens > tiny_manager.context_budget_tokens
    after = tiny_manager.session_info(tenant, sid)
    assert (
        (after.token_count, after.message_count)
        == (before.token_count, before.message_count)
        == (
            first.stats.cache_tokens,
            2,
        )
    )
    assert tiny_manager.internals.tiers.peek(tiny_manager.internals.tiers_key(tenant, sid)) is cache_before
    again = tiny_manager.chat(tenant, sid, "still there?", max_new_tokens=4)
    assert again.stats.restored_from == "device"
    assert again.stats.reused_tokens == first.stats.cache_tokens


def test_second_turn_on_a_busy_session_raises_session_busy(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    stream = tiny_manager.stream_chat(tenant, sid, "hello", max_new_tokens=64, temperature=1.0, seed=1)
    next(stream)  # the first turn is now in flight, holding the session's lease
    with pytest.raises(SessionBusy):
        tiny_manager.chat(tenant, sid, "me too", max_new_tokens=2)
    for _ in stream:
        pass
    assert len(tiny_manager.history(tenant, sid)) == 2


def test_abandoned_stream_stores_nothing_and_releases_the_session(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    stream = tiny_manager.stream_chat(tenant, sid, "hello", max_new_tokens=64, temperature=1.0, seed=1)
    next(stream)
    stream.close()
    assert tiny_manager.history(tenant, sid) == []
    reply = tiny_manager.chat(tenant, sid, "hello again", max_new_tokens=4)
    assert reply.stats.restored_from == "new"


def test_concurrent_turns_on_different_sessions_all_complete(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sessions = [tiny_manager.open_session(tenant) for _ in range(4)]

    def run(sid: str) -> None:
        for message in ("one", "two"):
            tiny_manager.chat(tenant, sid, message, max_new_tokens=8)

    with ThreadPoolExecutor(max_workers=4) as pool:
        for future in [pool.submit(run, sid) for sid in sessions]:
            future.result()  # re-raises any error of the thread
    assert [tiny_manager.session_info(tenant, sid).message_count for sid in sessions] == [4, 4, 4, 4]


def test_deleted_session_is_gone_everywhere(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    tiny_manager.chat(tenant, sid, "hello", max_new_tokens=4)
    tiny_manager.delete_session(tenant, sid)
    with pytest.raises(SessionNotFound):
        tiny_manager.history(tenant, sid)
    assert tiny_manager.internals.tiers.placement(tiny_manager.internals.tiers_key(tenant, sid)) is None
    with pytest.raises(SessionNotFound):
        tiny_manager.delete_session(tenant, sid)


def test_deleted_tenants_wrapped_key_is_gone_from_every_database_file_at_once(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    wrapped = tiny_manager.internals.metadata.get_tenant(tenant_id=tenant.id).wrapped_data_key  # type: ignore[union-attr]
    assert wrapped
    tiny_manager.delete_tenant(tenant)
    files = b"".join(path.read_bytes() for path in tiny_manager.settings.home.glob("chatkv.db*"))
    assert wrapped not in files  # the manager is still open: WAL checkpointed, freed pages zeroed


def test_a_manager_refuses_a_home_that_a_live_server_holds(tmp_path, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from sessions.errors import HomeLocked
    from storage.home_lock import HomeLock
    from tests.conftest import make_settings

    home = tmp_path / "home"
    with HomeLock(home, "http://127.0.0.1:1"):
        # The lock file names this process; another process's lock is what counts.
        pass
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from storage.home_lock import HomeLock;"
            f"lock = HomeLock(__import__('pathlib').Path({str(home)!r})).__enter__(); print('held', flush=True);"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(HomeLocked, match="holds this home"):
            SessionManager(make_settings(home), engine=tiny_engine)
        assert not (home / "chatkv.db").exists()  # refused before touching anything
    finally:
        holder.kill()
        holder.wait()
    with SessionManager(make_settings(home), engine=tiny_engine):  # a dead holder's lock is stale
        pass


@pytest.mark.parametrize("url", ["http://127.0.0.1:7999", None])
def test_a_refused_manager_names_the_holder_and_points_to_its_http_api(tmp_path, tiny_engine, url) -> None:  # type: ignore[no-untyped-def]
    """Inside Python the way to a home another process holds is that process's HTTP API (or its
    manager), never a CLI flag."""
    import subprocess
    import sys

    from sessions.errors import HomeLocked
    from storage.home_lock import program_name
    from tests.conftest import make_settings

    home = tmp_path / "home"
    code = (
        "import sys, time; from pathlib import Path; from storage.home_lock import HomeLock;"
        "lock = HomeLock(Path(sys.argv[1]), sys.argv[2] or None).acquire(); print('held', flush=True); time.sleep(60)"
    )
    argv = [sys.executable, "-c", code, str(home), url or ""]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    recovery = f"(if pid {holder.pid} is not a chatkv process, delete {home / 'server.lock'})"
    program = program_name(argv)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(HomeLocked) as refused:
            SessionManager(make_settings(home), engine=tiny_engine)
    finally:
        holder.kill()
        holder.wait()
    if url:
        assert str(refused.value) == (
            f"the chatkv server at {url} (pid {holder.pid}, {program}) holds this home; a second "
            f"SessionManager cannot open it: use its HTTP API at {url} from this process instead "
            f"(POST {url}/v1/chat/completions with a tenant API key) {recovery}"
        )
    else:
        assert str(refused.value) == (
            f"process {holder.pid} ({program}) with an open SessionManager holds this home; a second "
            "SessionManager cannot open it: share that process's manager, or run `chatkv serve` on this home "
            f"and have every process use its HTTP API (POST /v1/chat/completions) {recovery}"
        )
    assert "--server" not in str(refused.value)


def test_rotation_under_a_master_key_that_wrapped_nothing_is_refused_with_a_typed_error(tmp_path, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    import base64

    from sessions.errors import KeyMismatch
    from tests.conftest import make_settings

    home = tmp_path / "home"
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        manager.create_tenant("acme")
    other = base64.b64encode(b"\x07" * 32).decode()
    with SessionManager(make_settings(home, master_key=other), engine=tiny_engine) as manager:
        before = {t.id: t.wrapped_data_key for t in manager.internals.metadata.list_tenants()}
        with pytest.raises(KeyMismatch):
            manager.rotate_master_key(base64.b64encode(b"\x09" * 32).decode())
        assert {t.id: t.wrapped_data_key for t in manager.internals.metadata.list_tenants()} == before


def test_a_system_prompt_that_leaves_no_room_for_a_turn_is_refused_at_open(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    huge = "You are helpful. " * (tiny_manager.context_budget_tokens // 2)
    with pytest.raises(ContextTooLong, match="system prompt too long"):
        tiny_manager.open_session(tenant, system_prompt=huge)
    assert tiny_manager.list_sessions(tenant) == []


def test_the_database_file_is_readable_by_its_owner_only(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    tiny_manager.chat(tenant, tiny_manager.open_session(tenant), "private words", max_new_tokens=2)
    for path in tiny_manager.settings.home.glob("chatkv.db*"):
        assert path.stat().st_mode & 0o077 == 0, path


def test_deleting_a_tenant_during_its_turn_fails_that_turn_with_session_not_found(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant, system_prompt="You are terse.")
    tiny_manager.chat(tenant, sid, "hello", max_new_tokens=4)
    stream = tiny_manager.stream_chat(tenant, sid, "second turn", max_new_tokens=8, temperature=1.0, seed=3)
    next(stream)
    tiny_manager.delete_tenant(tenant)
    with pytest.raises(SessionNotFound):
        list(stream)
    assert len(tiny_manager.internals.tiers.pool) == 0
    assert tiny_manager.internals.tiers.usage().sessions[Tier.DEVICE] == 0


def test_deleting_a_session_while_another_sessions_turn_evicts_it_is_clean(tmp_path, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    """Budget enforcement at the end of another session's turn must not write a blob row for a
    session that is being deleted (that used to fail the other turn with an IntegrityError)."""
    from tests.conftest import make_settings

    settings = make_settings(
        tmp_path / "home", persist="on_evict", device_budget_bytes=30_000, host_budget_bytes=40_000
    )
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        x, y = manager.open_session(tenant), manager.open_session(tenant)
        manager.chat(tenant, x, "hello there", max_new_tokens=4)
        manager.evict_session(tenant, x, "host")
        forget = manager.internals.tiers.forget
        replies = []

        def forget_with_a_turn_in_between(key):  # type: ignore[no-untyped-def]
            if key.name == x and not replies:
                replies.append(manager.chat(tenant, y, "a message on another session " * 20, max_new_tokens=8))
            forget(key)

        manager.internals.tiers.forget = forget_with_a_turn_in_between  # type: ignore[method-assign]
        manager.delete_session(tenant, x)
        assert replies and len(manager.history(tenant, y)) == 2
        assert x not in [b.session_id for b in manager.internals.metadata.list_blobs()]
        with pytest.raises(SessionNotFound):
            manager.history(tenant, x)


def test_a_session_deleted_while_its_turn_is_being_recorded_is_serialised_with_it(
    tiny_manager: SessionManager,
) -> None:
    """The turn's transaction takes the session row's write lock first, so a concurrent delete waits
    for it: the turn is stored and returned, then the session is deleted (no half state, and no
    untyped error from the database)."""
    from sqlalchemy import event

    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    tiny_manager.chat(tenant, sid, "first", max_new_tokens=3)
    threads: list[threading.Thread] = []

    def delete_in_between(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if statement.lstrip().startswith("SELECT coalesce(max(messages") and not threads:
            threads.append(threading.Thread(target=lambda: tiny_manager.delete_session(tenant, sid)))
            threads[0].start()

    event.listen(tiny_manager.internals.database, "after_cursor_execute", delete_in_between)
    try:
        reply = tiny_manager.chat(tenant, sid, "second", max_new_tokens=3)
    finally:
        event.remove(tiny_manager.internals.database, "after_cursor_execute", delete_in_between)
    threads[0].join(timeout=30)
    assert reply.stats.restored_from == "device"
    with pytest.raises(SessionNotFound):
        tiny_manager.history(tenant, sid)
    assert tiny_manager.internals.tiers.placement(tiny_manager.internals.tiers_key(tenant, sid)) is None


def test_a_turn_whose_transcript_left_the_bounded_cache_is_still_recorded_in_memory(
    tiny_manager: SessionManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiny_manager.internals.transcripts, "capacity", 1)
    tenant = tiny_manager.create_tenant("acme")
    sid, other = tiny_manager.open_session(tenant), tiny_manager.open_session(tenant)
    tiny_manager.chat(tenant, sid, "My name is Bob.", max_new_tokens=4)
    stream = tiny_manager.stream_chat(tenant, sid, "I live in Paris.", max_new_tokens=8, temperature=1.0, seed=1)
    next(stream)
    tiny_manager.chat(tenant, other, "push the first transcript out", max_new_tokens=2)
    tiny_manager.pin_turn(tenant, sid, 0)
    list(stream)
    third = tiny_manager.chat(tenant, sid, "Where do I live?", max_new_tokens=4)
    assert third.stats.restored_from == "device"  # the cache matched the transcript: no rebuild
    assert tiny_manager.session_info(tenant, sid).token_count == third.stats.cache_tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": "0.5"},
        {"temperature": None},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": True},
        {"top_p": "a"},
        {"seed": "abc"},
        {"seed": 1.5},
        {"seed": 2**70},
        {"seed": -1},
        {"max_new_tokens": 2.0},
        {"max_new_tokens": True},
    ],
)
def test_sampling_parameters_of_the_wrong_type_are_invalid_input(tiny_manager: SessionManager, kwargs: dict) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    with pytest.raises(InvalidInput):
        tiny_manager.chat(tenant, sid, "hi", **kwargs)
    assert tiny_manager.history(tenant, sid) == []


def test_an_options_value_and_keyword_arguments_run_the_same_turn(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    options = TurnOptions(max_new_tokens=6, temperature=1.0, seed=3, stop=["zz"])
    assert options.stop == ("zz",) and options.sampling.max_new_tokens == 6
    by_value = tiny_manager.chat(tenant, tiny_manager.open_session(tenant), "hi", options)
    by_keywords = tiny_manager.chat(
        tenant, tiny_manager.open_session(tenant), "hi", max_new_tokens=6, temperature=1.0, seed=3, stop=["zz"]
    )
    assert by_value.token_ids == by_keywords.token_ids
    # Keywords replace the value's fields: the same seed greedy, four tokens.
    greedy = tiny_manager.chat(tenant, tiny_manager.open_session(tenant), "hi", max_new_tokens=4)
    overridden = tiny_manager.chat(
        tenant, tiny_manager.open_session(tenant), "hi", options, temperature=0.0, max_new_tokens=4
    )
    assert overridden.token_ids == greedy.token_ids
    with pytest.raises(InvalidInput):
        TurnOptions(stop=[""])
    with pytest.raises(TypeError):
        tiny_manager.chat(tenant, tiny_manager.open_session(tenant), "hi", max_tokens=4)  # type: ignore[call-arg]


def test_a_tiny_positive_temperature_samples_without_overflow(tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    greedy = tiny_manager.chat(tenant, tiny_manager.open_session(tenant), "hi", max_new_tokens=4)
    cold = tiny_manager.chat(tenant, sid, "hi", max_new_tokens=4, temperature=1e-45, seed=0)
    assert cold.token_ids == greedy.token_ids  # the limit of sampling as the temperature goes to 0


def test_text_that_is_not_valid_unicode_and_ids_of_the_wrong_type_are_typed_errors(
    tiny_manager: SessionManager,
) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant)
    with pytest.raises(InvalidInput, match="message"):
        tiny_manager.chat(tenant, sid, "hi \ud800")
    with pytest.raises(InvalidInput, match="system_prompt"):
        tiny_manager.open_session(tenant, system_prompt="\udcff")
    with pytest.raises(InvalidInput, match="title"):
        tiny_manager.open_session(tenant, title="\udcff")
    with pytest.raises(SessionNotFound):
        tiny_manager.history(tenant, "s_\udcff")
    with pytest.raises(SessionNotFound):
        tiny_manager.history(tenant, 12345)  # type: ignore[arg-type]
    with pytest.raises(TenantNotFound):
        tiny_manager.get_tenant("a\udcff")
    for key in (12345, b"ckv_tn_00_x", None, "ckv_\udcff"):
        with pytest.raises(TenantNotFound):
            tiny_manager.tenant_for_api_key(key)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        tiny_manager.rotate_master_key(123)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        tiny_manager.pin_turn(tenant, sid, True)  # type: ignore[arg-type]
    assert tiny_manager.history(tenant, sid) == []


def test_an_accelerator_this_machine_lacks_is_a_typed_error(tmp_path, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    import torch

    from sessions.errors import ModelUnavailable
    from tests.conftest import make_settings

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the error path is for machines without it")
    with pytest.raises(ModelUnavailable, match="CUDA is not available"):
        SessionManager(make_settings(tmp_path / "home", device="cuda", model=str(tiny_model_dir)))
    with pytest.raises(ValueError, match="device must be"):
        make_settings(tmp_path / "home", device="tpu")


def test_an_embedded_manager_holds_its_home_against_other_processes(tmp_path, tiny_engine, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Two processes on one home would each keep their own transcript in memory and corrupt the
    session; the second is refused while the first runs, whether it is a server or embedded."""
    import os
    import subprocess
    import sys

    from tests.conftest import MASTER_KEY, MODEL_CACHE, REPO, make_settings

    home = tmp_path / "home"
    script = (
        "from sessions import SessionManager, Settings\n"
        "try:\n"
        "    SessionManager(Settings.from_env())\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {
        **os.environ,
        "CHATKV_HOME": str(home),
        "CHATKV_MODEL": str(tiny_model_dir),
        "CHATKV_MODEL_CACHE_DIR": str(MODEL_CACHE),
        "CHATKV_MASTER_KEY": MASTER_KEY,
        "PYTHONPATH": str(REPO),
    }
    with (
        SessionManager(make_settings(home), engine=tiny_engine),
        SessionManager(make_settings(home), engine=tiny_engine),
    ):
        assert (home / "server.lock").exists()  # one process may hold a home several times
        other = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert other.stdout.startswith("HomeLocked"), other.stdout + other.stderr
    assert not (home / "server.lock").exists()  # the last holder released it


@pytest.mark.parametrize("corrupt", [[1_000_000_000], [-3], "abc", None, [1, 2, 3]])
def test_an_edited_token_ids_row_neither_breaks_the_session_nor_reuses_a_stale_cache(
    tmp_path, tiny_engine, corrupt: object
) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import update

    from storage.schema import MessageRow
    from tests.conftest import make_settings

    home = tmp_path / "home"
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant)
        manager.chat(tenant, sid, "hello", max_new_tokens=6)
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        with manager.internals.metadata.database.begin() as connection:
            connection.execute(
                update(MessageRow)
                .where(MessageRow.session_id == sid, MessageRow.role == "assistant")
                .values(token_ids=corrupt)
            )
        assert len(manager.history("acme", sid)) == 2
        reply = manager.chat("acme", sid, "and now?", max_new_tokens=4)
        assert reply.stats.restored_from == "rebuilt"  # the stored cache was of another transcript
        again = manager.chat("acme", sid, "once more", max_new_tokens=4)
        assert again.stats.restored_from == "device"
