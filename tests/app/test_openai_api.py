"""The OpenAI-compatible API with the official `openai` client against a real `chatkv serve` process
(tiny model: these behaviours do not depend on the model). One server for the module."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from sessions.engine import Engine
from sessions.manager import SessionManager
from tests.app.server_process import ServerProcess, chatkv_serve, child_env
from tests.conftest import REPO, make_settings

SYSTEM = "You are a terse assistant."
SAMPLED = {"temperature": 1.0, "seed": 11}
"""The tiny model's greedy replies repeat one token; seeded samples are varied and repeatable."""


@dataclass(frozen=True)
class Api:
    server: ServerProcess
    model: str
    keys: dict[str, str]

    def client(self, tenant: str = "acme") -> OpenAI:
        return OpenAI(base_url=self.server.v1, api_key=self.keys[tenant], max_retries=0, timeout=120)

    def native(self, tenant: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        return httpx.request(method, f"{self.server.v1}{path}", headers=headers, timeout=60, **kwargs)

    def messages(self, tenant: str, session_id: str) -> list[tuple[str, str]]:
        answer = self.native(tenant, "GET", f"/sessions/{session_id}")
        assert answer.status_code == 200, answer.text
        return [(m["role"], m["content"]) for m in answer.json()["messages"]]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_engine: Engine) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("openai-api")
    home = root / "home"
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        keys = {name: manager.issue_api_key(manager.create_tenant(name)) for name in ("acme", "beta")}
        model = manager.model_name
    with chatkv_serve(home, str(tiny_model_dir), root / "server.log") as server:
        yield Api(server, model, keys)


def _create(client: OpenAI, messages: list[dict[str, str]], **kwargs: Any) -> tuple[str, Any]:
    """One completion; returns the X-Session-ID header and the parsed completion."""
    raw = client.chat.completions.with_raw_response.create(messages=messages, **kwargs)  # type: ignore[call-overload]
    return raw.headers["x-session-id"], raw.parse()


def _stream(client: OpenAI, messages: list[dict[str, str]], **kwargs: Any) -> tuple[str, list[Any]]:
    with client.chat.completions.with_streaming_response.create(messages=messages, stream=True, **kwargs) as raw:  # type: ignore[call-overload]
        return raw.headers["x-session-id"], list(raw.parse())


def test_the_served_model_is_listed_and_another_is_not_found(api: Api) -> None:
    client = api.client()
    assert [m.id for m in client.models.list().data] == [api.model]
    assert client.models.retrieve(api.model).owned_by == "chatkv"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.code == "model_not_found"


def test_a_stateless_conversation_continues_one_session_from_its_cache(api: Api) -> None:
    client = api.client()
    messages = [{"role": "system", "content": SYSTEM}]
    sessions, cached = [], []
    token_count_before = 0
    for turn, text in enumerate(["Hello there", "Tell me more", "And finally?"]):
        messages.append({"role": "user", "content": text})
        session_id, completion = _create(client, messages, model=api.model, max_tokens=8, **SAMPLED)
        sessions.append(session_id)
        usage = completion.usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if turn:
            # Everything fed before this turn came from the cache: the session's tokens so far.
            assert cached[-1] == token_count_before
        token_count_before = api.native("acme", "GET", f"/sessions/{session_id}").json()["token_count"]
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})
    assert len(set(sessions)) == 1
    assert cached[1] > 0 and cached[2] > cached[1]
    assert api.messages("acme", sessions[0]) == [(m["role"], m["content"]) for m in messages[1:]]


def test_streamed_chunks_joined_equal_the_reply(api: Api) -> None:
    client = api.client()
    messages = [{"role": "user", "content": "Stream something"}]
    session_id, chunks = _stream(
        client, messages, model=api.model, max_tokens=24, stream_options={"include_usage": True}, **SAMPLED
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert api.messages("acme", session_id) == [("user", "Stream something"), ("assistant", text)]
    _, completion = _create(client, messages, model=api.model, max_tokens=24, **SAMPLED)
    assert completion.choices[0].message.content == text  # the same seeded samples, not streamed


def test_a_stop_string_ends_the_reply_before_it(api: Api) -> None:
    client = api.client()
    messages = [{"role": "user", "content": "Say something long"}]
    _, free = _create(client, messages, model=api.model, max_tokens=40, **SAMPLED)
    text = free.choices[0].message.content
    stop = text[10:14]
    session_id, cut = _create(client, messages, model=api.model, max_tokens=40, stop=stop, **SAMPLED)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed_id, chunks = _stream(client, messages, model=api.model, max_tokens=40, stop=[stop, "zzz"], **SAMPLED)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[: text.index(stop)]
    # The sessions stored the reply as their client saw it, and are found by it (the most
    # recently active first: both have this history).
    for sid in (session_id, streamed_id):
        assert api.messages("acme", sid) == [("user", "Say something long"), ("assistant", text[: text.index(stop)])]
    follow = [*messages, {"role": "assistant", "content": cut.choices[0].message.content}]
    follow.append({"role": "user", "content": "Go on"})
    found, completion = _create(client, follow, model=api.model, max_tokens=4)
    assert found == streamed_id and completion.usage.prompt_tokens_details.cached_tokens > 0


def test_an_edited_history_starts_a_new_session(api: Api) -> None:
    client = api.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My name is Ada"}]
    first, completion = _create(client, messages, model=api.model, max_tokens=6, **SAMPLED)
    reply = completion.choices[0].message.content
    edited = [messages[0], {"role": "user", "content": "My name is Bob"}, {"role": "assistant", "content": reply}]
    edited.append({"role": "user", "content": "What is my name?"})
    second, answer = _create(client, edited, model=api.model, max_tokens=6, **SAMPLED)
    assert second != first
    assert api.messages("acme", first) == [("user", "My name is Ada"), ("assistant", reply)]
    assert api.messages("acme", second)[:2] == [("user", "My name is Bob"), ("assistant", reply)]
    # Only the pooled system prompt was served from cache: the history was prefilled afresh.
    base = answer.usage.prompt_tokens_details.cached_tokens
    kept = [messages[0], messages[1], {"role": "assistant", "content": reply}, edited[-1]]
    _, continued = _create(client, kept, model=api.model, max_tokens=6, **SAMPLED)
    assert continued.usage.prompt_tokens_details.cached_tokens > base


def test_tenants_never_see_each_others_sessions(api: Api) -> None:
    acme, beta = api.client("acme"), api.client("beta")
    messages = [{"role": "system", "content": "Acme's prompt."}, {"role": "user", "content": "Acme's secret"}]
    acme_session, completion = _create(acme, messages, model=api.model, max_tokens=6, **SAMPLED)
    messages += [{"role": "assistant", "content": completion.choices[0].message.content}]
    messages += [{"role": "user", "content": "More"}]
    # Beta posting acme's exact history gets a session of its own, with nothing from acme's cache.
    beta_session, beta_completion = _create(beta, messages, model=api.model, max_tokens=4)
    assert beta_session != acme_session
    assert beta_completion.usage.prompt_tokens_details.cached_tokens == 0
    listed = api.native("beta", "GET", "/sessions").json()["data"]
    assert acme_session not in {s["id"] for s in listed}
    for session_id in (acme_session, "s_000000000000000000000000"):
        with pytest.raises(openai.NotFoundError) as missing:
            beta.chat.completions.create(
                model=api.model,
                messages=[{"role": "user", "content": "Hi"}],
                extra_headers={"X-Session-ID": session_id},
            )
        assert missing.value.message.replace(session_id, "<id>").endswith("session not found: <id>")
        assert api.native("beta", "GET", f"/sessions/{session_id}").status_code == 404
    assert len(api.messages("acme", acme_session)) == 2


def test_explicit_sessions_take_only_the_new_message(api: Api) -> None:
    client = api.client()
    created = api.native("acme", "POST", "/sessions", json={"system_prompt": SYSTEM, "title": "explicit"})
    assert created.status_code == 201
    session_id = created.json()["id"]
    header = {"X-Session-ID": session_id}
    one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First"}]
    assert _create(client, one, model=api.model, max_tokens=4, extra_headers=header)[0] == session_id
    two = [{"role": "user", "content": "Second"}]
    sid, completion = _create(client, two, model=api.model, max_tokens=4, extra_body={"session_id": session_id})
    assert sid == session_id and completion.usage.prompt_tokens_details.cached_tokens > 0
    assert [role for role, _ in api.messages("acme", session_id)] == ["user", "assistant"] * 2


def test_eight_streaming_clients_in_their_own_processes_all_complete(api: Api) -> None:
    prompts = [f"Client {i}: tell me about the number {i}." for i in range(8)]
    command = [sys.executable, "-m", "tests.app.stream_client", api.server.v1, api.keys["acme"], api.model]
    clients = [
        subprocess.Popen([*command, prompt, "16"], env=child_env(), cwd=REPO, stdout=subprocess.PIPE, text=True)
        for prompt in prompts
    ]
    results = []
    for process in clients:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0
        results.append(json.loads(out))
    assert len({r["session_id"] for r in results}) == 8
    for prompt, result in zip(prompts, results, strict=True):
        assert result["finish_reason"] in ("stop", "length")
        assert api.messages("acme", result["session_id"]) == [("user", prompt), ("assistant", result["text"])]


def _idle(api: Api) -> bool:
    """No turn running or waiting on the server (its `/metrics`)."""
    metrics = httpx.get(f"{api.server.url}/metrics", timeout=10).text
    counts = [
        line.split()[-1]
        for line in metrics.splitlines()
        if line.startswith(("chatkv_requests_running{", "chatkv_requests_waiting{"))
    ]
    return all(float(count) == 0 for count in counts)


def test_a_request_the_client_gave_up_on_is_not_stored_and_its_retry_is_not_stored_twice(api: Api) -> None:
    """The official client times out and retries (by default): each abandoned attempt is cancelled,
    so the transcript never holds the message twice (issue 18)."""
    created = api.native("acme", "POST", "/sessions", json={"system_prompt": SYSTEM})
    session_id = created.json()["id"]
    impatient = OpenAI(base_url=api.server.v1, api_key=api.keys["acme"], max_retries=1, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(
            model=api.model,
            messages=[{"role": "user", "content": "Tell me everything"}],
            max_tokens=3000,
            extra_headers={"X-Session-ID": session_id},
            **SAMPLED,
        )
    deadline = time.monotonic() + 30
    while not _idle(api):
        assert time.monotonic() < deadline, "a turn kept running after its client went away"
        time.sleep(0.1)
    time.sleep(0.5)  # a turn that had completed would be stored by now
    assert api.messages("acme", session_id) == []
    # With an Idempotency-Key, a completed request's retry is its recorded answer: one turn.
    patient = api.client()
    key = {"X-Session-ID": session_id, "Idempotency-Key": "ask-once"}
    answers = [
        patient.chat.completions.with_raw_response.create(
            model=api.model, messages=[{"role": "user", "content": "Once"}], max_tokens=4, extra_headers=key
        )
        for _ in range(2)
    ]
    assert answers[0].parse().model_dump() == answers[1].parse().model_dump()
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert len(api.messages("acme", session_id)) == 2
