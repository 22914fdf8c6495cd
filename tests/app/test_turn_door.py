"""The door of a turn seen from the faces (`sessions.turn_door`): each request is planned once
(one prefix query, counted on the real database), and a fork looks the same whichever face made
it: a regenerate posted to `/v1/chat/completions`, a branch through `previous_response_id`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from app.cli.sessions import _origin_text
from app.http.server import build_app
from app.ui.sessions import SessionLabels
from sessions import Reply, SessionBusy, TurnOptions, TurnTarget
from sessions.manager import Services, SessionManager
from sessions.turn_door import PlannedTurn

TOKEN = "door-test-token"
SYSTEM = "You are terse."


@pytest.fixture
def client(tiny_services: Services) -> Iterator[TestClient]:
    with TestClient(build_app(tiny_services, local=True, token=TOKEN)) as client:
        yield client


def _auth(manager: SessionManager) -> dict[str, str]:
    tenant = manager.create_tenant("acme")
    return {"Authorization": f"Bearer {manager.issue_api_key(tenant)}"}


def _chat(client: TestClient, auth: dict[str, str], messages: list[dict[str, str]], **extra: Any) -> tuple[str, str]:
    """Post a chat completion; its session and reply text (none for a stream)."""
    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    answer = client.post("/v1/chat/completions", json=body, headers=auth)
    assert answer.status_code == 200, answer.text
    if extra.get("stream"):
        assert answer.text.endswith("data: [DONE]\n\n")
        return answer.headers["X-Session-ID"], ""
    return answer.headers["X-Session-ID"], answer.json()["choices"][0]["message"]["content"]


def test_each_chat_completion_runs_one_prefix_query(client: TestClient, tiny_manager: SessionManager) -> None:
    auth = _auth(tiny_manager)
    prefix_queries: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM turn_digests JOIN sessions" in statement:
            prefix_queries.append(statement)

    system = {"role": "system", "content": SYSTEM}
    first = {"role": "user", "content": "Hello"}
    event.listen(tiny_manager.internals.database, "before_cursor_execute", count)
    try:
        per_request = []
        session, reply = _chat(client, auth, [system, first])  # new
        per_request.append(len(prefix_queries))
        again = [system, first, {"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
        continued, _ = _chat(client, auth, again, stream=True)  # continue, streamed
        per_request.append(len(prefix_queries))
        forked, _ = _chat(client, auth, again)  # the same post again: a fork of the session
        per_request.append(len(prefix_queries))
    finally:
        event.remove(tiny_manager.internals.database, "before_cursor_execute", count)
    assert continued == session and forked != session
    # A first message has no earlier turns to look up; each later post looks its history up once
    # (routing and running used to look it up once each).
    assert per_request == [0, 1, 2]


def test_a_fork_reads_the_same_whichever_face_made_it(client: TestClient, tiny_manager: SessionManager) -> None:
    """A regenerate posted to chat completions, and a branch made through `previous_response_id`,
    are both listed as forks of their session at their turn: the HTTP session, the chat page's
    session tree and the CLI say so alike (as they do for a fork made in the chat page)."""
    auth = _auth(tiny_manager)
    model = tiny_manager.model_name
    system, first = {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}
    parent, reply = _chat(client, auth, [system, first])
    again = [system, first, {"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    assert _chat(client, auth, again)[0] == parent
    regenerated, _ = _chat(client, auth, again)  # regenerate the second reply

    def respond(**body: Any) -> Any:
        answer = client.post("/v1/responses", json={"model": model, "max_output_tokens": 4, **body}, headers=auth)
        assert answer.status_code == 200, answer.text
        return answer

    r1 = respond(instructions=SYSTEM, input="Hello")
    respond(previous_response_id=r1.json()["id"], input="More")
    branched = respond(previous_response_id=r1.json()["id"], input="More").headers["X-Session-ID"]
    response_parent = r1.headers["X-Session-ID"]

    sessions = {s["id"]: s for s in client.get("/v1/sessions", headers=auth).json()["data"]}
    for fork, its_parent in ((regenerated, parent), (branched, response_parent)):
        assert (sessions[fork]["parent_id"], sessions[fork]["fork_turns"]) == (its_parent, 1)
        assert _origin_text(sessions[fork]) == f"fork of {its_parent} at turn 2"
    tenant = tiny_manager.get_tenant("acme")
    infos = {str(info.id): info for info in tiny_manager.list_sessions(tenant)}
    labels = SessionLabels(tiny_manager)
    for fork, its_parent in ((regenerated, parent), (branched, response_parent)):
        assert labels.fork_line(tenant, infos[fork], infos[its_parent]).startswith("fork at turn 2: ")


def test_the_chat_page_s_turns_go_through_the_door(tiny_manager: SessionManager) -> None:
    """The chat page builds targets too: its first message makes an explicit session (kept until
    deleted, never found by a posted history), and its regenerate is a fork listed as every
    face's forks are."""
    from app.ui import ChatUI, ViewState
    from sessions.admin import AdminOps

    ui = ChatUI(tiny_manager, local=True)
    first = list(ui.send("Hello", 4, 0.0, ui.on_load(ViewState()).state))[-1]
    parent = str(first.state.session_id)
    regenerated = list(ui.regenerate(6, 0.0, first.state))[-1]
    fork = str(regenerated.state.session_id)
    assert fork != parent

    listed = {s["id"]: s for s in AdminOps.of(tiny_manager).list_sessions(tenant="local")}
    assert listed[parent]["origin"] == "explicit" and listed[parent]["parent_id"] is None
    assert (listed[fork]["origin"], listed[fork]["parent_id"], listed[fork]["fork_turns"]) == ("fork", parent, 0)
    assert _origin_text(listed[fork]) == f"fork of {parent} at turn 1"


def test_a_made_session_another_client_took_first_is_not_deleted_under_it(tiny_manager: SessionManager) -> None:
    """The session a turn makes is listed (and shown by the chat page through `on_made`) before
    that turn holds it: a client that starts a turn on it first makes this turn `SessionBusy`, and
    the door must not then delete the session under that client's turn."""
    manager = tiny_manager
    tenant = manager.create_tenant("acme").id
    options = TurnOptions(max_new_tokens=4, temperature=0)
    rivals: list[PlannedTurn] = []

    def another_client_first(session_id: str) -> None:
        rival = manager.run_turn(tenant, TurnTarget(session=session_id), "Me first.", options)
        assert isinstance(rival.start(), str)  # it holds the session now
        rivals.append(rival)

    turn = manager.run_turn(tenant, TurnTarget(SYSTEM, new_session=True), "Hello.", options)
    turn.on_made = another_client_first
    with pytest.raises(SessionBusy):
        turn.start()
    (rival,) = rivals
    assert isinstance(list(rival)[-1], Reply)
    assert manager.session_info(tenant, str(rival.session_id)).message_count == 2
