"""The chat UI's event handlers and the server routes, without a browser: a real manager on a tiny
model, a real SQLite file and real encryption."""

from __future__ import annotations

import re
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import gradio as gr
import gradio.utils
import pytest
from fastapi.testclient import TestClient

from app.http.server import build_app
from app.ui import (
    EMPTY_KEY_MESSAGE,
    LABEL_CHARS,
    LOCAL_TENANT,
    STOPPED_NOTE,
    UNKNOWN_KEY_MESSAGE,
    ChatUI,
    View,
    ViewState,
)
from app.ui.forks import (
    EMPTY_EDIT,
    FORK_STOPPED_NOTE,
    NO_SUCH_MESSAGE,
    NOTHING_TO_REGENERATE,
    REPLY_NOT_EDITABLE,
)
from app.ui.render import error_html, note_html, stats_html, stats_row
from app.ui.sessions import ago
from sessions import TurnStats
from sessions.manager import Services, SessionManager
from sessions.validation import MAX_MESSAGE_CHARS

UNKNOWN_KEY_HTML = error_html(UNKNOWN_KEY_MESSAGE)


def _stat(view: View, name: str) -> str:
    """A figure of the stats line: its `data-value` if it has one, else its text."""
    match = re.search(rf'data-stat="{name}"(?: data-value="([^"]*)")?>([^<]*)<', view.stats_line)
    assert match, view.stats_line
    return match.group(1) if match.group(1) is not None else match.group(2)


def _send(ui: ChatUI, state: ViewState, message: str, max_new_tokens: int = 6) -> list[View]:
    return list(ui.send(message, max_new_tokens, 0.0, state))


def _choice_ids(view: View) -> list[str]:
    return [value for _, value in view.session_picker["choices"]]


def test_healthz_metrics_and_page_are_served(tiny_manager: SessionManager, tiny_services: Services) -> None:
    with TestClient(build_app(tiny_services, local=True, token="t0ken")) as client:
        health = client.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "model": tiny_manager.model_name}
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        assert "chatkv_tier_bytes" in metrics.text
        page = client.get("/")
        assert page.status_code == 200
        assert '<meta property="og:title" content="chatkv" />' in page.text


def test_wrong_and_unknown_keys_get_the_same_answer(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    key = tiny_manager.issue_api_key(acme)
    ui = ChatUI(tiny_manager, local=False)
    assert ui.on_load(ViewState()).main_panel["visible"] is False
    wrong_secret = key[: key.rindex("_") + 1] + "not-the-secret"
    unknown_tenant = "ckv_tn_00000000000000ff_" + key[key.rindex("_") + 1 :]
    for bad in (wrong_secret, unknown_tenant, "hello"):
        view = ui.login(bad, ViewState())
        assert view.login_message == UNKNOWN_KEY_HTML, bad
        assert view.state == ViewState()
        assert view.main_panel["visible"] is False
        assert view.api_key == ""
    for empty in ("", "   "):
        assert ui.login(empty, ViewState()).login_message == error_html(EMPTY_KEY_MESSAGE)
    view = ui.login(f"  {key} ", ViewState())
    assert view.state.tenant == acme
    assert view.login_message == ""
    assert view.main_panel["visible"] is True
    assert view.login_panel["visible"] is False


def test_a_tenant_key_never_reaches_another_tenants_sessions(tiny_manager: SessionManager) -> None:
    acme, beta = tiny_manager.create_tenant("acme"), tiny_manager.create_tenant("beta")
    acme_sid = tiny_manager.open_session(acme, title="acme plans")
    beta_sid = tiny_manager.open_session(beta, title="beta secrets")
    ui = ChatUI(tiny_manager, local=False)
    signed_in = ui.login(tiny_manager.issue_api_key(acme), ViewState())
    assert _choice_ids(signed_in) == [acme_sid]
    assert all("beta" not in label for label, _ in signed_in.session_picker["choices"])
    state = signed_in.state
    # Another tenant's id (as a crafted client could send) reads exactly like a missing one.
    foreign = ui.select_session(beta_sid, state)
    missing = ui.select_session("s_000000000000000000000000", state)
    assert foreign.error_line == error_html(f"session not found: {beta_sid}")
    assert missing.error_line == error_html("session not found: s_000000000000000000000000")
    assert foreign.state == state
    assert foreign.chatbot == {"__type__": "update"}
    views = _send(ui, replace(state, session_id=beta_sid), "hi")
    assert [v.error_line for v in views][-1] == error_html(f"session not found: {beta_sid}")
    assert tiny_manager.history(beta, beta_sid) == []


def test_local_mode_signs_in_as_the_local_tenant_once(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    first = ui.on_load(ViewState())
    second = ui.on_load(ViewState())
    assert first.state.tenant is not None and first.state.tenant.name == LOCAL_TENANT
    assert second.state.tenant == first.state.tenant
    assert [t.name for t in tiny_manager.list_tenants()] == [LOCAL_TENANT]
    assert first.main_panel["visible"] is True


def test_two_turns_stream_and_the_second_reuses_the_cache(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    first = _send(ui, state, "Hello there")
    # Without an open session a new one is started, shown in the picker, and the box is cleared.
    assert first[0].chatbot == [{"role": "user", "content": "Hello there"}]
    assert first[0].message["value"] == ""
    sid = first[0].state.session_id
    assert sid is not None and _choice_ids(first[0]) == [sid]
    assert len(first) >= 3  # the opening view, at least one streamed piece, the final view
    one = first[-1]
    [user, assistant] = tiny_manager.history(LOCAL_TENANT, sid)
    assert one.chatbot == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": assistant.text}]
    assert _stat(one, "turn") == "1"
    assert _stat(one, "restored_from") == "new"
    assert _stat(one, "reused_tokens") == "0"
    assert int(_stat(one, "prefill_tokens")) == len(user.token_ids)
    context_1 = int(_stat(one, "context_tokens"))

    two = _send(ui, one.state, "And then?")[-1]
    [_, _, user_2, _] = tiny_manager.history(LOCAL_TENANT, sid)
    assert _stat(two, "turn") == "2"
    assert _stat(two, "restored_from") == "device"
    assert int(_stat(two, "reused_tokens")) == context_1
    assert int(_stat(two, "prefill_tokens")) == len(user_2.token_ids) < context_1
    assert [row[0] for row in two.stats_table] == [1, 2]
    assert len(two.chatbot) == 4
    assert "4 messages" in two.session_info


def test_selecting_a_session_shows_its_history(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Remember me")[-1]
    sid = done.state.session_id
    assert sid is not None
    other_tab = ui.on_load(ViewState())
    assert other_tab.chatbot == [] and other_tab.state.session_id is None
    assert _choice_ids(other_tab) == [sid]
    opened = ui.select_session(sid, other_tab.state)
    assert opened.chatbot == done.chatbot
    assert opened.state.session_id == sid
    assert opened.state.shown == done.state.shown
    assert opened.error_line == ""


def test_selecting_an_offloaded_session_prefetches_its_cache(tiny_manager: SessionManager) -> None:
    from app.http.prefetch import Prefetcher

    prefetcher = Prefetcher(tiny_manager)
    ui = ChatUI(tiny_manager, local=True, prefetcher=prefetcher)
    done = _send(ui, ui.on_load(ViewState()).state, "Remember me")[-1]
    sid = done.state.session_id
    assert sid is not None
    tenant = done.state.tenant
    tiny_manager.evict_session(tenant, sid, "disk")
    ui.select_session(sid, ui.on_load(ViewState()).state)
    prefetcher.close()  # waits for the restore under way
    assert tiny_manager.session_info(tenant, sid).tier == "device"
    reply = tiny_manager.chat(tenant, sid, "And now?", max_new_tokens=4)
    assert reply.stats.restored_from == "device"


def test_new_session_with_title_and_system_prompt(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    view = ui.new_session(" Trip ", "You are terse.", state)
    sid = view.state.session_id
    assert sid is not None
    assert view.session_picker["value"] == sid
    [(label, value)] = view.session_picker["choices"]
    assert value == sid and label.startswith("Trip · ")
    assert "system prompt: You are terse." in view.session_info
    info = tiny_manager.session_info(LOCAL_TENANT, sid)
    assert (info.title, info.system_prompt) == ("Trip", "You are terse.")
    untitled = ui.new_session("", "  ", state).state.session_id
    assert untitled is not None
    assert tiny_manager.session_info(LOCAL_TENANT, untitled).system_prompt is None


def test_manager_errors_become_one_line_and_nothing_is_stored(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.new_session("", "", ui.on_load(ViewState()).state).state
    assert state.session_id is not None
    too_long = _send(ui, state, "hi", max_new_tokens=100_000)[-1]
    assert re.fullmatch(
        r'<div class="chatkv-error" role="alert">reply too long for the context: the turn needs \d+ tokens of context '
        r"\(\d+ in the prompt, up to 100000 in the reply\), the limit is \d+: lower max tokens to \d+ or less"
        r"</div>",
        too_long.error_line,
    )
    assert too_long.message["value"] == "hi"  # given back to the user to edit
    assert too_long.chatbot == []
    assert tiny_manager.history(LOCAL_TENANT, state.session_id) == []

    title = ui.new_session("x" * 201, "", state)
    assert title.error_line == error_html("title longer than 200 characters")
    assert title.state == state

    empty = _send(ui, state, "   ")
    assert [v.error_line for v in empty] == [error_html("type a message first")]


@pytest.mark.parametrize(
    ("max_new_tokens", "temperature", "message"),
    [
        (float("nan"), 0.0, "max_new_tokens must be a positive integer, got nan"),
        (float("inf"), 0.0, "max_new_tokens must be a positive integer, got inf"),
        (6, float("nan"), "temperature must be a number >= 0, got nan"),
        (6, float("-inf"), "temperature must be a number >= 0, got -inf"),
    ],
)
def test_slider_values_that_are_not_finite_numbers_are_one_line_errors(
    tiny_manager: SessionManager, max_new_tokens: float, temperature: float, message: str
) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    [view] = ui.send("hi", max_new_tokens, temperature, state)
    assert view.error_line == error_html(message)
    assert view.state == state  # no session started
    assert tiny_manager.list_sessions(LOCAL_TENANT) == []


def test_a_second_turn_in_flight_on_the_session_is_refused(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.new_session("", "", ui.on_load(ViewState()).state).state
    assert state.session_id is not None and state.tenant is not None
    # Closing the stream_chat generator releases the lease.
    in_flight = tiny_manager.stream_chat(state.tenant, state.session_id, "first", max_new_tokens=4)
    next(in_flight)  # holds the session's lease until closed
    try:
        busy = _send(ui, state, "second")[-1]
    finally:
        in_flight.close()
    assert busy.error_line == error_html(f"session {state.session_id} has a turn in flight; wait for its reply")
    assert _send(ui, state, "second")[-1].error_line == {"__type__": "update"}


def test_signed_out_tabs_can_do_nothing(tiny_manager: SessionManager) -> None:
    tiny_manager.open_session(tiny_manager.create_tenant("acme"))
    ui = ChatUI(tiny_manager, local=False)
    state = ViewState()
    sign_in_first = error_html("sign in first")
    assert [v.error_line for v in _send(ui, state, "hi")] == [sign_in_first]
    assert ui.refresh_sessions(state).error_line == sign_in_first
    assert ui.new_session("t", "", state).error_line == sign_in_first
    assert ui.select_session("s_000000000000000000000000", state).error_line == sign_in_first


def test_sign_out_clears_every_tenant_derived_output(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    ui = ChatUI(tiny_manager, local=False)
    state = ui.login(tiny_manager.issue_api_key(acme), ViewState()).state
    chatted = _send(ui, state, "hello")[-1]
    out = ui.sign_out(chatted.state)
    assert out.state == ViewState()
    assert (out.chatbot, out.stats_table, out.stats_line, out.session_info, out.tenant_line) == ([], [], "", "", "")
    assert out.session_picker["choices"] == []
    assert out.main_panel["visible"] is False


@pytest.mark.parametrize("local", [True, False])
def test_page_builds_with_stable_element_ids(tiny_manager: SessionManager, local: bool) -> None:
    from app.ui import build_ui

    config = build_ui(tiny_manager, local=local).get_config_file()
    ids = {c["props"].get("elem_id") for c in config["components"]}
    assert {"api-key", "login", "session-picker", "chat", "message", "send", "turn-stats", "chat-error"} <= ids


def test_clearing_the_chat_leaves_the_session_and_the_next_message_starts_another(
    tiny_manager: SessionManager,
) -> None:
    ui = ChatUI(tiny_manager, local=True)
    chatted = _send(ui, ui.on_load(ViewState()).state, "first")[-1]
    first_sid = chatted.state.session_id
    assert first_sid is not None
    left = ui.leave_session(chatted.state)
    assert left.state == ViewState(tenant=chatted.state.tenant)
    assert "previous one is kept in the Session list" in left.session_info
    assert (left.chatbot, left.session_picker["value"]) == ([], None)
    again = _send(ui, left.state, "second")[-1]
    second_sid = again.state.session_id
    assert second_sid is not None and second_sid != first_sid
    assert len(tiny_manager.history(LOCAL_TENANT, first_sid)) == 2
    assert sorted(_choice_ids(again)) == sorted([first_sid, second_sid])


# -- the key is checked on every event -------------------------------------------------------------


def test_rotating_or_deleting_the_api_key_signs_the_tab_out(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    ui = ChatUI(tiny_manager, local=False)
    old_key = tiny_manager.issue_api_key(acme)
    state = ui.new_session("plans", "", ui.login(old_key, ViewState()).state).state
    sid = state.session_id
    assert sid is not None and state.api_key == old_key
    assert old_key not in repr(state)  # the key stays out of logs and tracebacks

    new_key = tiny_manager.issue_api_key(acme)  # what `chatkv tenants rotate-api-key acme` does
    events = {
        "refresh": lambda: [ui.refresh_sessions(state)],
        "select": lambda: [ui.select_session(sid, state)],
        "new session": lambda: [ui.new_session("more plans", "", state)],
        "clear": lambda: [ui.leave_session(state)],
        "send": lambda: _send(ui, state, "hi"),
    }
    for name, event in events.items():
        [view] = event()
        assert view.state == ViewState(), name
        assert view.login_message == UNKNOWN_KEY_HTML, name
        assert view.main_panel["visible"] is False and view.login_panel["visible"] is True, name
        assert (view.chatbot, view.session_picker["choices"], view.tenant_line) == ([], [], ""), name
    assert [info.title for info in tiny_manager.list_sessions(acme)] == ["plans"]  # nothing was created
    assert tiny_manager.history(acme, sid) == []  # nothing was sent

    fresh = ui.login(new_key, ViewState()).state
    assert ui.refresh_sessions(fresh).state == fresh
    tiny_manager.delete_tenant(acme)  # a deleted tenant's tab is signed out the same way
    gone = ui.refresh_sessions(fresh)
    assert gone.state == ViewState() and gone.login_message == UNKNOWN_KEY_HTML


# -- turns run to completion in a worker thread ----------------------------------------------------


def test_a_turn_completes_and_is_stored_when_its_tab_goes_away(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    stream = ui.send("Hello there", 32, 0.0, ui.on_load(ViewState()).state)
    opening = next(stream)
    sid = opening.state.session_id
    assert sid is not None
    first_piece = next(stream)
    partial = first_piece.chatbot[-1]["content"]
    assert first_piece.chatbot[-1]["role"] == "assistant" and partial
    stream.close()  # the tab was reloaded or closed: Gradio closes the generator

    assert ui.wait_for_turns(timeout_s=120)
    [user, assistant] = tiny_manager.history(LOCAL_TENANT, sid)
    assert user.text == "Hello there"
    assert assistant.text.startswith(partial)
    control = tiny_manager.open_session(LOCAL_TENANT)  # greedy: the whole reply, as if the tab had stayed
    assert assistant.text == tiny_manager.chat(LOCAL_TENANT, control, "Hello there", max_new_tokens=32).text


def test_send_and_the_message_box_are_disabled_while_a_reply_streams(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    views = _send(ui, ui.on_load(ViewState()).state, "Hello there")
    assert views[0].message == {"__type__": "update", "value": "", "interactive": False}
    assert views[0].send_button == {"__type__": "update", "interactive": False}
    for streamed in views[1:-1]:  # left as they are (disabled) while pieces arrive
        assert streamed.message == streamed.send_button == {"__type__": "update"}
    assert views[-1].message["interactive"] is True and views[-1].send_button["interactive"] is True

    failed = _send(ui, views[-1].state, "again", max_new_tokens=100_000)
    assert failed[0].send_button["interactive"] is False
    assert "too long" in failed[-1].error_line
    assert failed[-1].message == {"__type__": "update", "value": "again", "interactive": True}
    assert failed[-1].send_button["interactive"] is True


# -- sessions in the picker ------------------------------------------------------------------------


def test_a_failed_first_turn_deletes_the_session_it_started(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    views = _send(ui, state, "hi", max_new_tokens=100_000)
    assert views[0].state.session_id is not None  # made by the turn's door, then deleted with it
    failed = views[-1]
    assert "reply too long for the context" in failed.error_line
    assert failed.state == state  # no session open
    assert failed.session_picker["choices"] == []
    assert tiny_manager.list_sessions(LOCAL_TENANT) == []
    # A session the user opened is kept when its turn fails (test_manager_errors_become_one_line...).


def test_a_message_refused_when_its_turn_starts_ends_the_tab_s_turn_with_one_line(tiny_manager: SessionManager) -> None:
    # The manager refuses a message over MAX_MESSAGE_CHARS at the stream_chat call itself, in the
    # turn's worker thread: the tab must still get the error (it waited for ever before).
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    views: list[View] = []
    worker = threading.Thread(target=lambda: views.extend(_send(ui, state, "x" * (MAX_MESSAGE_CHARS + 1))), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the tab never got the end of its turn"
    assert "characters" in views[-1].error_line and views[-1].state == state
    assert tiny_manager.list_sessions(LOCAL_TENANT) == []  # the session made for the send is gone
    assert ui.wait_for_turns(5)


def test_untitled_sessions_are_labelled_by_their_first_message(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    first = "Tell me   about the\nhistory of the Roman Empire in great detail"
    chatted = _send(ui, ui.on_load(ViewState()).state, first)[-1]
    chatted = _send(ui, chatted.state, "And Greece?")[-1]
    empty = ui.new_session("", "", chatted.state)
    titled = ui.new_session("Trip", "", empty.state)
    labels = {sid: label for label, sid in titled.session_picker["choices"]}
    assert labels[str(chatted.state.session_id)].startswith("Tell me about the history of the Roman… · ")
    assert labels[str(empty.state.session_id)].startswith("(empty) · ")
    assert labels[str(titled.state.session_id)].startswith("Trip · ")
    no_longer_empty = _send(ui, empty.state, "Hi")[-1]
    names = {sid: label.split(" · ")[0] for label, sid in no_longer_empty.session_picker["choices"]}
    assert names[str(empty.state.session_id)] == "Hi"


# -- stats ---------------------------------------------------------------------------------------


def test_stats_say_where_the_cache_came_from(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.new_session("", "You are terse.", ui.on_load(ViewState()).state).state
    one = _send(ui, state, "Hello")[-1]
    assert _stat(one, "restored_from") == "new" and _stat(one, "reused_tokens") == "0"
    assert "no cache yet</b> (first turn)" in one.stats_line
    assert "restore_ms" not in one.stats_line
    assert one.stats_table[-1][4:6] == ["nothing yet (first turn)", None]

    # Another session with the same system prompt reuses the tenant's shared prefix on its first turn.
    other = ui.new_session("", "You are terse.", one.state).state
    two = _send(ui, other, "Hi")[-1]
    assert _stat(two, "restored_from") == "new" and int(_stat(two, "reused_tokens")) > 0
    assert "shared system prompt" in two.stats_line
    assert two.stats_table[-1][4] == "shared system prompt"

    assert other.session_id is not None
    tiny_manager.evict_session(LOCAL_TENANT, other.session_id, "disk")
    three = _send(ui, two.state, "More")[-1]
    assert _stat(three, "restored_from") == "disk"
    assert "cache from <b>disk</b>, restored in" in three.stats_line
    restore_ms = float(_stat(three, "restore_ms"))
    assert restore_ms > 0 and three.stats_table[-1][4:6] == ["disk", restore_ms]
    assert [row[0] for row in three.stats_table] == [1, 2]


def test_a_redis_restore_shows_its_time_as_host_and_disk_restores_do() -> None:
    """A cache another replica left in Redis is restored like one from host memory or disk: the
    line and the table say where from and how long it took (they showed neither time before)."""
    stats = TurnStats(
        prefill_tokens=3, reused_tokens=40, ttft_s=0.05, decode_tokens=4, decode_s=0.1, restored_from="redis",
        restore_s=0.0123, cache_tokens=47,
    )  # fmt: skip
    line = stats_html(2, stats)
    assert 'data-stat="restored_from" data-value="redis">cache from <b>Redis (shared)</b>' in line
    assert 'restored in <b data-stat="restore_ms">12.3</b> ms' in line
    assert stats_row(2, stats)[4:6] == ("Redis (shared)", 12.3)
    for source in ("new", "device", "rebuilt"):
        assert "restore_ms" not in stats_html(1, replace(stats, restored_from=source))


def test_opening_a_session_says_stats_cover_this_page_visit(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Remember me")[-1]
    reopened = ui.select_session(done.state.session_id, ui.on_load(ViewState()).state)
    assert "this page visit" in reopened.stats_line and reopened.stats_table == []
    empty = ui.new_session("", "", reopened.state).state
    assert ui.select_session(empty.session_id, reopened.state).stats_line == ""


# -- stop, token limit, picker labels, the remembered session ----------------------------------------


def test_stop_discards_the_reply_and_frees_the_session_at_once(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.new_session("", "", ui.on_load(ViewState()).state).state
    sid = state.session_id
    assert sid is not None
    stream = ui.send("Tell me a long story", 1500, 0.0, state)
    opening = next(stream)
    assert opening.stop_button == {"__type__": "update", "visible": True, "interactive": True}
    assert opening.reply_note == ""
    streaming = next(stream)
    assert streaming.chatbot[-1]["role"] == "assistant" and streaming.chatbot[-1]["content"]

    assert ui.stop(streaming.state) == {"__type__": "update", "interactive": False}
    stopped = list(stream)[-1]
    assert stopped.reply_note == note_html(STOPPED_NOTE, kind="stopped")
    assert 'data-note="stopped"' in stopped.reply_note
    assert stopped.state == state  # the partial reply and the message are not on screen
    assert stopped.chatbot == [] and stopped.error_line == ""
    assert stopped.message == {"__type__": "update", "value": "Tell me a long story", "interactive": True}
    assert stopped.send_button["interactive"] is True
    assert stopped.stop_button == {"__type__": "update", "visible": False, "interactive": True}
    assert tiny_manager.history(LOCAL_TENANT, sid) == []  # nothing of the turn was stored

    again = _send(ui, stopped.state, "Hi")  # no SessionBusy: the session was free when the view came
    assert again[0].reply_note == "" and again[-1].error_line == {"__type__": "update"}
    assert tiny_manager.history(LOCAL_TENANT, sid)[0].text == "Hi"
    assert _stat(again[-1], "turn") == "1"


def test_stopping_a_first_turn_deletes_the_session_it_started(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    stream = ui.send("Tell me a long story", 1500, 0.0, state)
    opening = next(stream)
    assert opening.remembered == {"tenant": str(state.tenant.id), "session": opening.state.session_id}  # type: ignore[union-attr]
    ui.stop(next(stream).state)
    stopped = list(stream)[-1]
    assert 'data-note="stopped"' in stopped.reply_note
    assert stopped.state == state and stopped.session_picker["choices"] == []
    assert stopped.remembered is None
    assert tiny_manager.list_sessions(LOCAL_TENANT) == []


def test_stop_without_a_turn_in_flight_changes_nothing(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Hello")[-1]
    assert ui.stop(done.state) == {"__type__": "update", "interactive": False}
    assert ui.stop(ViewState()) == {"__type__": "update", "interactive": False}
    assert len(tiny_manager.history(LOCAL_TENANT, str(done.state.session_id))) == 2


def test_a_reply_cut_at_the_token_limit_says_so(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    cut = _send(ui, ui.on_load(ViewState()).state, "Hello", max_new_tokens=3)[-1]
    [_, assistant] = tiny_manager.history(LOCAL_TENANT, str(cut.state.session_id))
    assert len(assistant.token_ids) == 3  # the tiny model sampled no stop token: finish_reason "length"
    assert cut.reply_note == (
        '<div class="chatkv-note" data-note="length">The reply stopped at the 3-token limit (Max new tokens): '
        "raise it, or ask to continue.</div>"
    )
    assert cut.stop_button["visible"] is False
    assert _send(ui, cut.state, "More", max_new_tokens=3)[0].reply_note == ""  # cleared by the next send


def test_ago_says_how_long_ago_in_a_few_characters() -> None:
    now = datetime(2025, 6, 15, 12, 0, tzinfo=UTC)
    cases = {
        timedelta(seconds=20): "just now",
        timedelta(minutes=5, seconds=59): "5 min ago",
        timedelta(hours=3, minutes=10): "3 h ago",
        timedelta(days=1, hours=5): "yesterday",
        timedelta(days=4): "4 days ago",
        timedelta(days=30): "May 16",
        timedelta(days=400): "2024-05-11",
    }
    assert {delta: ago(now - delta, now) for delta in cases} == cases


def test_picker_labels_are_short_and_say_how_recent(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    long_title = "Quarterly planning for the infrastructure migration of the billing platform"
    view = ui.new_session(long_title, "", state)
    [(label, _)] = view.session_picker["choices"]
    assert label == "Quarterly planning for the infrastructu… · just now"
    assert len(label.split(" · ")[0]) == LABEL_CHARS


def test_the_open_session_is_remembered_for_the_next_page_load(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    chatted = _send(ui, ui.on_load(ViewState()).state, "Remember me")[-1]
    tenant, sid = chatted.state.tenant, chatted.state.session_id
    assert tenant is not None and sid is not None
    remembered = {"tenant": str(tenant.id), "session": sid}
    assert ui.select_session(sid, ui.leave_session(chatted.state).state).remembered == remembered

    reloaded = ui.on_load(ViewState(), remembered)  # a new tab state, the browser's stored value
    assert reloaded.state.session_id == sid and reloaded.state.shown == chatted.state.shown
    assert reloaded.chatbot == chatted.chatbot
    assert reloaded.session_picker["value"] == sid and reloaded.remembered == remembered
    assert "this page visit" in reloaded.stats_line

    # Another tenant's value, a deleted session or garbage from the browser: signed in, nothing open.
    for stale in ({"tenant": "tn_0000000000000000", "session": sid}, {"tenant": str(tenant.id), "session": "s_x"}, 7):
        fresh = ui.on_load(ViewState(), stale)
        assert fresh.state == ViewState(tenant=tenant) and fresh.chatbot == [] and fresh.error_line == ""
    assert ui.leave_session(chatted.state).remembered is None
    assert ui.select_session(None, chatted.state).remembered is None


def test_signing_in_reopens_the_remembered_session_of_that_tenant_only(tiny_manager: SessionManager) -> None:
    acme, beta = tiny_manager.create_tenant("acme"), tiny_manager.create_tenant("beta")
    acme_sid = tiny_manager.open_session(acme, title="acme plans")
    ui = ChatUI(tiny_manager, local=False)
    remembered = {"tenant": str(acme.id), "session": acme_sid}
    signed_in = ui.login(tiny_manager.issue_api_key(acme), ViewState(), remembered)
    assert signed_in.state.session_id == acme_sid and signed_in.session_picker["value"] == acme_sid
    other = ui.login(tiny_manager.issue_api_key(beta), ViewState(), remembered)
    assert other.state.session_id is None and other.session_picker["choices"] == []
    assert other.remembered == {"__type__": "update"}  # left for acme's next sign-in in this browser
    assert ui.sign_out(signed_in.state).remembered is None  # signing out forgets it


# -- forks: regenerate the last reply, edit a past message -------------------------------------------


def _regenerate(ui: ChatUI, state: ViewState, max_new_tokens: int = 6, temperature: float = 0.0) -> list[View]:
    return list(ui.regenerate(max_new_tokens, temperature, state))


def _edit(ui: ChatUI, state: ViewState, index: int, text: str, max_new_tokens: int = 6) -> list[View]:
    return list(ui.edit_message(index, text, max_new_tokens, 0.0, state))


def _short(text: str) -> str:
    """`text` as a label quotes it: whitespace runs as one space, at most `LABEL_CHARS` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= LABEL_CHARS else flat[: LABEL_CHARS - 1].rstrip() + "…"


def _transcript(manager: SessionManager, sid: str) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(m.role, m.text, m.token_ids) for m in manager.history(LOCAL_TENANT, sid)]


def test_regenerate_forks_before_the_last_turn_warm_and_keeps_the_original(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    one = _send(ui, ui.on_load(ViewState()).state, "Hello there")[-1]
    context_1 = int(_stat(one, "context_tokens"))
    two = _send(ui, one.state, "And then?")[-1]
    parent = two.state.session_id
    assert parent is not None
    before = _transcript(tiny_manager, parent)

    # Two more tokens than the reply it replaces: a reply of its own even at Temperature 0.
    views = _regenerate(ui, two.state, max_new_tokens=8)
    opening, done = views[0], views[-1]
    fork = done.state.session_id
    assert fork is not None and fork != parent and opening.state.session_id == fork
    # While it streams: the kept turn and the message run again, the input disabled, Stop shown.
    assert opening.chatbot == two.chatbot[:3]
    assert opening.message["interactive"] is False and opening.stop_button["visible"] is True
    assert opening.session_picker["value"] == fork and "fork of <code>" in opening.session_info

    info = tiny_manager.session_info(LOCAL_TENANT, fork)
    assert (info.parent_id, info.fork_turns, info.message_count) == (parent, 1, 4)
    [_, _, user_2, reply_2] = tiny_manager.history(LOCAL_TENANT, fork)
    assert user_2.text == "And then?"
    assert done.chatbot == [*two.chatbot[:3], {"role": "assistant", "content": reply_2.text}]
    # The fork's turn starts from the parent's KV through turn 1: only the message is prefilled.
    assert _stat(done, "turn") == "2"
    assert _stat(done, "restored_from") == "device"
    assert int(_stat(done, "reused_tokens")) == context_1
    assert int(_stat(done, "prefill_tokens")) == len(user_2.token_ids)
    assert [row[0] for row in done.stats_table] == [2]
    assert len(reply_2.token_ids) == 8 and reply_2.text != two.chatbot[-1]["content"]
    assert done.reply_note == note_html(  # the tiny model never samples a stop token
        "The reply stopped at the 8-token limit (Max new tokens): raise it, or ask to continue.", kind="length"
    )
    assert f"fork of <code>{parent}</code> at turn 2" in done.session_info
    assert opening.remembered == {"tenant": str(done.state.tenant.id), "session": fork}  # type: ignore[union-attr]

    # The original is untouched and still in the picker; the fork is listed under it, by its own reply.
    assert _transcript(tiny_manager, parent) == before
    assert done.session_picker["choices"] == [
        ("Hello there · just now", parent),
        (f"\u2003↳ fork at turn 2: new reply “{_short(reply_2.text)}” · just now", fork),
    ]
    assert done.session_picker["value"] == fork
    reopened = ui.select_session(parent, done.state)
    assert reopened.chatbot == two.chatbot and reopened.state.session_id == parent

    tiny_manager.delete_session(LOCAL_TENANT, parent)
    assert ui.refresh_sessions(done.state).session_picker["choices"] == [
        (f"↳ fork at turn 2 of a deleted session: new reply “{_short(reply_2.text)}” · just now", fork)
    ]


def test_editing_a_message_forks_before_it_and_sends_the_new_text(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    contexts = []
    for message in ("Name a colour.", "Name another one.", "And a third?"):
        done = _send(ui, state, message)[-1]
        contexts.append(int(_stat(done, "context_tokens")))
        state = done.state
    parent = state.session_id
    assert parent is not None
    before = _transcript(tiny_manager, parent)

    # The middle message (index 2 on screen: turn 2): the fork keeps turn 1, warm.
    middle = _edit(ui, state, 2, "Name a shape.")[-1]
    fork_1 = middle.state.session_id
    assert fork_1 not in (None, parent)
    info = tiny_manager.session_info(LOCAL_TENANT, fork_1)
    assert (info.parent_id, info.fork_turns, info.message_count) == (parent, 1, 4)
    assert [(role, text) for role, text, _ in _transcript(tiny_manager, fork_1)][:3] == [
        *[(role, text) for role, text, _ in before[:2]],
        ("user", "Name a shape."),
    ]
    assert _transcript(tiny_manager, fork_1)[:2] == before[:2]  # the kept turn's exact ids
    assert [m["content"] for m in middle.chatbot][:3] == ["Name a colour.", before[1][1], "Name a shape."]
    assert _stat(middle, "turn") == "2" and _stat(middle, "restored_from") == "device"
    assert int(_stat(middle, "reused_tokens")) == contexts[0]

    # The first message (through Gradio's event data): the fork keeps no turn.
    event = gr.EditData(None, {"index": 0, "value": "Name a fruit.", "previous_value": "Name a colour."})
    first = list(ui.edit(event, 6, 0.0, state))[-1]
    fork_0 = first.state.session_id
    assert fork_0 not in (None, parent, fork_1)
    info = tiny_manager.session_info(LOCAL_TENANT, fork_0)
    assert (info.parent_id, info.fork_turns, info.message_count) == (parent, 0, 2)
    assert first.chatbot[0] == {"role": "user", "content": "Name a fruit."} and len(first.chatbot) == 2
    assert _stat(first, "turn") == "1" and _stat(first, "restored_from") == "new"

    assert _transcript(tiny_manager, parent) == before

    # An edit in a fork forks the fork: listed under it, one level deeper, forks of one session
    # by their fork turn, each named by its own message.
    nested = _edit(ui, middle.state, 2, "Name a size.")[-1]
    fork_1_1 = nested.state.session_id
    assert tiny_manager.session_info(LOCAL_TENANT, str(fork_1_1)).parent_id == fork_1
    assert nested.session_picker["choices"] == [
        ("Name a colour. · just now", parent),
        ("\u2003↳ fork at turn 1: “Name a fruit.” · just now", fork_0),
        ("\u2003↳ fork at turn 2: “Name a shape.” · just now", fork_1),
        ("\u2003\u2003↳ fork at turn 2: “Name a size.” · just now", fork_1_1),
    ]


def test_bad_edits_and_regenerations_are_one_line_and_store_nothing(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Hello there")[-1]
    state, parent = done.state, str(done.state.session_id)
    sessions = [info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)]
    refusals = {
        "empty": (_edit(ui, state, 0, "  \n"), EMPTY_EDIT),
        "a reply": (_edit(ui, state, 1, "Something I would rather have said"), REPLY_NOT_EDITABLE),
        "no such message": (_edit(ui, state, 7, "Hi"), NO_SUCH_MESSAGE),
        "the slider": (list(ui.edit_message(0, "Hi", float("nan"), 0.0, state)), "max_new_tokens must be"),
    }
    for name, (views, message) in refusals.items():
        [view] = views
        assert view.error_line.startswith(error_html(message)[: -len("</div>")]), name
        assert view.state == state, name
        assert view.chatbot == done.chatbot, name  # redrawn: an edit the browser shows is undone
    empty = ui.new_session("", "", state).state
    [nothing] = _regenerate(ui, empty)
    assert nothing.error_line == error_html(NOTHING_TO_REGENERATE)
    assert sorted(info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)) == sorted([*sessions, empty.session_id])
    tiny_manager.delete_session(LOCAL_TENANT, str(empty.session_id))

    # While a reply streams on the session, neither an edit nor a regeneration starts.
    stream = ui.send("Tell me a long story", 1500, 0.0, state)
    streaming = next(stream)
    in_flight = error_html(f"session {parent} has a turn in flight; wait for its reply")
    [busy] = _edit(ui, streaming.state, 0, "Hi")
    assert busy.error_line == in_flight
    assert busy.chatbot == {"__type__": "update"}  # the streaming turn redraws it
    assert _regenerate(ui, streaming.state)[-1].error_line == in_flight
    ui.stop(streaming.state)
    list(stream)
    assert [info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)] == [parent]

    # A fork's turn that fails deletes the fork and opens the original again.
    failed = _edit(ui, state, 0, "Hi", max_new_tokens=100_000)
    assert failed[0].state.session_id != parent  # it ran on a fork
    assert "reply too long for the context" in failed[-1].error_line
    assert failed[-1].state == state and failed[-1].chatbot == done.chatbot
    assert failed[-1].session_picker["value"] == parent and _choice_ids(failed[-1]) == [parent]
    assert failed[-1].message["interactive"] is True and failed[-1].stop_button["visible"] is False
    assert [info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)] == [parent]
    assert len(tiny_manager.history(LOCAL_TENANT, parent)) == 2

    # The session deleted meanwhile (in another tab): refused before a fork is made, in one line.
    tiny_manager.delete_session(LOCAL_TENANT, parent)
    [gone] = _regenerate(ui, state)
    assert gone.error_line == error_html(f"session not found: {parent}")
    assert gone.state == state and gone.chatbot == done.chatbot
    assert tiny_manager.list_sessions(LOCAL_TENANT) == []


def test_stopping_a_regeneration_discards_its_fork(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Tell me a long story", max_new_tokens=3)[-1]
    parent = done.state.session_id
    stream = ui.regenerate(1500, 0.0, done.state)
    next(stream)
    ui.stop(next(stream).state)  # the fork is the tab's open session while it streams
    stopped = list(stream)[-1]
    assert stopped.reply_note == note_html(FORK_STOPPED_NOTE, kind="stopped")
    assert stopped.state == done.state and stopped.chatbot == done.chatbot
    assert stopped.message == {"__type__": "update", "interactive": True}  # the box was not used
    assert stopped.remembered == {"tenant": str(done.state.tenant.id), "session": parent}  # type: ignore[union-attr]
    assert [info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)] == [parent]


def test_the_page_offers_retry_on_the_last_reply_and_edit_on_user_messages(tiny_manager: SessionManager) -> None:
    from app.ui import build_ui

    config = build_ui(tiny_manager, local=True).get_config_file()
    [chat] = [c for c in config["components"] if c["props"].get("elem_id") == "chat"]
    assert chat["props"]["editable"] == "user" and chat["props"]["_retryable"] is True
    assert chat["props"]["_undoable"] is False
    triggers = {tuple(target) for dependency in config["dependencies"] for target in dependency["targets"]}
    assert {(chat["id"], "retry"), (chat["id"], "edit")} <= triggers
    # Gradio passes the edit's data by the parameter's type hint: it must resolve at run time.
    assert gradio.utils.get_type_hints(ChatUI.edit)["event"] is gr.EditData
