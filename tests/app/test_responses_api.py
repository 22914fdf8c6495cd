"""The Responses API with the official `openai` client against a real `chatkv serve` process (tiny
model: these behaviours do not depend on the model; seeded samples are the exact reference). One
server for the module; the last test restarts it on the same home."""

from __future__ import annotations

import secrets
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from sessions.engine import Engine
from sessions.manager import SessionManager
from tests.app.server_process import start_serve
from tests.conftest import make_settings

SYSTEM = "You are a terse assistant."
SEED = {"temperature": 1.0, "extra_body": {"seed": 11}}
"""The tiny model's greedy replies repeat one token; seeded samples are varied and repeatable."""


@dataclass
class Api:
    home: Path
    log: Path
    model_dir: str
    model: str
    keys: dict[str, str]
    url: str = ""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.url, self.process = start_serve(self.home, self.model_dir, self.log, {})

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            assert self.process.wait(timeout=60) == 0, self.log.read_text()
            self.process = None

    def client(self, tenant: str = "acme") -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0, timeout=120)

    def native(self, tenant: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}", **kwargs.pop("headers", {})}
        return httpx.request(method, f"{self.url}/v1{path}", headers=headers, timeout=60, **kwargs)

    def sessions(self, tenant: str = "acme") -> set[str]:
        return {s["id"] for s in self.native(tenant, "GET", "/sessions").json()["data"]}

    def create(self, tenant: str = "acme", **kwargs: Any) -> Any:
        return self.client(tenant).responses.create(model=self.model, max_output_tokens=8, **SEED, **kwargs)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_engine: Engine) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("responses-api")
    home = root / "home"
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        keys = {name: manager.issue_api_key(manager.create_tenant(name)) for name in ("acme", "beta")}
        model = manager.model_name
    served = Api(home, root / "server.log", str(tiny_model_dir), model, keys)
    served.start()
    try:
        yield served
    finally:
        served.stop()


def test_a_chain_continues_one_session_from_its_cache(api: Api) -> None:
    before = api.sessions()
    first = api.create(input="Hello there", instructions=SYSTEM, metadata={"ticket": "42"})
    second = api.create(input="Tell me more", previous_response_id=first.id)
    third = api.create(input="And finally?", previous_response_id=second.id)
    assert len(api.sessions() - before) == 1  # the chain is one session
    assert first.usage.input_tokens_details.cached_tokens < second.usage.input_tokens_details.cached_tokens
    # Everything of the chain before the third turn came from the cache (all but the last reply
    # token, which no forward pass has fed yet).
    assert third.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1
    assert third.previous_response_id == second.id and first.metadata == {"ticket": "42"}
    client = api.client()
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    items = client.responses.input_items.list(second.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "Tell me more")]


def test_a_branch_from_an_older_response_is_warm_and_replies_as_a_fresh_chain(api: Api) -> None:
    first = api.create(input="Pick a colour", instructions=SYSTEM)
    second = api.create(input="Why that one?", previous_response_id=first.id)
    branch = api.create(input="Pick another", previous_response_id=first.id)
    assert branch.usage.input_tokens_details.cached_tokens > 0  # the fork starts from the chain's KV
    fresh_first = api.create(input="Pick a colour", instructions=SYSTEM)
    assert fresh_first.output_text == first.output_text
    fresh = api.create(input="Pick another", previous_response_id=fresh_first.id)
    assert branch.output_text == fresh.output_text
    # The parent chain is untouched: its latest response still continues it.
    after = api.create(input="Go on", previous_response_id=second.id)
    assert after.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1


def test_other_instructions_start_a_new_session_holding_the_earlier_turns(api: Api) -> None:
    first = api.create(input="Hello", instructions=SYSTEM)
    before = api.sessions()
    same = api.create(input="Again", instructions=SYSTEM, previous_response_id=first.id)
    assert api.sessions() == before  # the same instructions continue the chain's session
    other = api.create(input="Again", instructions="You are verbose.", previous_response_id=first.id)
    assert len(api.sessions() - before) == 1
    # The new session holds the first turn under the new system prompt: not served from a cache.
    assert other.usage.input_tokens > first.usage.total_tokens > other.usage.input_tokens_details.cached_tokens
    assert same.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1


def test_a_conversation_posted_as_items_is_one_response(api: Api) -> None:
    items = [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": "What now?"},
    ]
    response = api.create(input=items)
    listed = api.client().responses.input_items.list(response.id, order="asc")
    assert [(i.role, i.content[0].text) for i in listed.data] == [
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "What now?"),
    ]
    page = api.client().responses.input_items.list(response.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["What now?", "Hello!"] and page.has_more


def test_store_false_keeps_nothing(api: Api) -> None:
    stored = api.create(input="Keep this", instructions=SYSTEM)
    before = api.sessions()
    gone = api.create(input="Forget this", store=False)
    branch = api.create(input="Forget this too", previous_response_id=stored.id, store=False)
    assert gone.output_text and branch.usage.input_tokens_details.cached_tokens > 0
    assert api.sessions() == before
    for response_id in (gone.id, branch.id):
        with pytest.raises(openai.NotFoundError):
            api.client().responses.retrieve(response_id)
    # The stored chain was not moved on by the unstored turn: it continues from its own reply.
    after = api.create(input="Go on", previous_response_id=stored.id)
    assert after.usage.input_tokens_details.cached_tokens == stored.usage.total_tokens - 1


def test_store_false_input_leaves_no_byte_in_the_database_files(api: Api) -> None:
    unstored, stored = f"unstored-{secrets.token_hex(8)}", f"stored-{secrets.token_hex(8)}"
    history = [
        {"role": "user", "content": f"First {unstored}"},
        {"role": "assistant", "content": f"Reply {unstored}"},
        {"role": "user", "content": f"Then {unstored}"},
    ]
    api.create(input=f"Forget {unstored}", store=False)
    api.create(input=history, store=False)
    chain = api.create(input="Keep this", instructions=SYSTEM)
    events = api.client().responses.create(
        model=api.model, input=f"Streamed {unstored}", previous_response_id=chain.id, store=False, stream=True
    )
    assert [e.type for e in events][-1] in ("response.completed", "response.incomplete")
    api.create(input=f"Keep {stored}")  # the check below sees what is written
    files = [api.home / name for name in ("chatkv.db", "chatkv.db-wal", "chatkv.db-shm")]
    written = b"".join(path.read_bytes() for path in files if path.exists())
    assert stored.encode() in written and unstored.encode() not in written


def test_every_stored_responses_answer_names_its_session_in_x_session_id(api: Api) -> None:
    client = api.client()
    ask: dict[str, Any] = {"model": api.model, "input": "Name it", "max_output_tokens": 8, **SEED}
    raw = client.responses.with_raw_response.create(**ask, extra_headers={"Idempotency-Key": "named-session"})
    session_id = raw.headers["x-session-id"]
    assert session_id in api.sessions()
    first = raw.parse()
    with client.responses.with_streaming_response.create(
        model=api.model, input="Go on", previous_response_id=first.id, max_output_tokens=8, stream=True
    ) as streamed:
        assert streamed.headers["x-session-id"] == session_id  # the chain goes on in it
        list(streamed.iter_lines())
    replay = client.responses.with_raw_response.create(**ask, extra_headers={"Idempotency-Key": "named-session"})
    assert (replay.headers["idempotent-replayed"], replay.headers["x-session-id"]) == ("true", session_id)
    unstored = client.responses.with_raw_response.create(**ask, store=False)
    assert "x-session-id" not in unstored.headers  # `store: false` keeps no session to name


def test_streamed_events_come_in_order_and_join_to_the_stored_reply(api: Api) -> None:
    client = api.client()
    events = list(
        client.responses.create(model=api.model, input="Stream it", max_output_tokens=16, stream=True, **SEED)
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 0
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # it reached max_output_tokens
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    stored = client.responses.retrieve(events[0].response.id)
    assert stored.output_text == text == events[-1].response.output_text
    assert stored.incomplete_details.reason == "max_output_tokens" and stored.usage.output_tokens == 16
    assert stored.model_dump() == events[-1].response.model_dump()


def test_a_second_response_while_a_conversations_turn_is_in_flight_is_a_409_and_adds_nothing(api: Api) -> None:
    client = api.client()
    before = api.sessions()
    conversation = client.conversations.create(items=[{"type": "message", "role": "developer", "content": SYSTEM}])
    first = api.create(input="Hello", conversation=conversation.id)
    stream = client.responses.create(
        model=api.model, input="Go on", conversation=conversation.id, max_output_tokens=2000, stream=True
    )
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":  # the turn is in flight on the conversation's session
            with pytest.raises(openai.ConflictError) as busy:
                api.create(input="Meanwhile", conversation=conversation.id)
            assert busy.value.code == "session_busy"
            client.responses.cancel(events[0].response.id)
            events.extend(stream)
            break
    assert events[-1].type == "error" and events[-1].code == "response_cancelled"
    texts = [i.content[0].text for i in client.conversations.items.list(conversation.id, order="asc").data]
    assert texts == [SYSTEM, "Hello", first.output_text]  # nothing of either later request
    assert len(api.sessions() - before) == 1  # no second session made for the refused turn
    client.conversations.delete(conversation.id)
    client.responses.delete(first.id)
    assert api.sessions() == before


def test_a_streamed_response_in_flight_is_cancelled_and_stores_nothing(api: Api) -> None:
    client = api.client()
    before = api.sessions()
    stream = client.responses.create(model=api.model, input="Go on and on", max_output_tokens=2000, stream=True)
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            cancelled = client.responses.cancel(events[0].response.id)
            assert (cancelled.status, cancelled.id) == ("cancelled", events[0].response.id)
            events.extend(stream)
            break
    assert events[-1].type == "error" and events[-1].code == "response_cancelled"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(events[0].response.id)
    assert api.sessions() == before


def test_another_tenants_response_is_answered_like_a_missing_one(api: Api) -> None:
    mine = api.create(input="Private")
    other = api.client("beta")
    missing = "resp_" + "0" * 24
    for response_id in (mine.id, missing):
        with pytest.raises(openai.NotFoundError) as retrieved:
            other.responses.retrieve(response_id)
        assert retrieved.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(response_id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            other.responses.cancel(response_id)
        with pytest.raises(openai.NotFoundError):
            api.create("beta", input="Continue", previous_response_id=response_id)
    assert api.client().responses.retrieve(mine.id).output_text == mine.output_text


def test_deleting_a_response_mid_chain_keeps_the_later_ones_and_the_last_takes_the_session(api: Api) -> None:
    client = api.client()
    before = api.sessions()
    first = api.create(input="One", instructions=SYSTEM)
    second = api.create(input="Two", previous_response_id=first.id)
    third = api.create(input="Three", previous_response_id=second.id)
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        api.create(input="From two", previous_response_id=second.id)
    # Later responses keep their whole context: the chain goes on from its cache.
    assert client.responses.retrieve(third.id).output_text == third.output_text
    fourth = api.create(input="Four", previous_response_id=third.id)
    assert fourth.usage.input_tokens_details.cached_tokens == third.usage.total_tokens - 1
    assert len(api.sessions() - before) == 1
    for response in (first, third, fourth):
        client.responses.delete(response.id)
    assert api.sessions() == before  # no stored response left: the session went too


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"extra_body": {"n": 2}}, "n"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0]"),
        ({"truncation": "auto"}, "truncation"),
        ({"extra_body": {"moderation": {"model": "omni"}}}, "moderation"),
    ],
)
def test_an_unsupported_parameter_is_refused_by_name(api: Api, kwargs: dict[str, Any], param: str) -> None:
    arguments = {"input": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as refused:
        api.client().responses.create(model=api.model, **arguments)
    assert refused.value.code == "unsupported_parameter" and refused.value.param == param


def test_an_unknown_field_is_refused_by_name_and_labels_are_accepted(api: Api) -> None:
    client = api.client()
    before = api.sessions()
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=api.model, input="Hi", extra_body={"max_tokens": 8, "frequency_penalty": 1})
    assert refused.value.code == "unrecognized_request_argument" and refused.value.param == "max_tokens"
    assert "max_tokens, frequency_penalty" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.conversations.create(extra_body={"title": "x"})
    assert refused.value.code == "unrecognized_request_argument" and refused.value.param == "title"
    assert api.sessions() == before
    labelled = api.create(input="Hi", user="u-1", prompt_cache_key="k", truncation="disabled", store=False)
    assert labelled.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input": [{"role": "assistant", "content": "I speak first"}]},
        {"input": [{"role": "robot", "content": "Hi"}]},
        {"input": []},
        {"input": "   "},
        {"input": "Hi", "metadata": {f"k{i}": "v" for i in range(17)}},
        {"input": "Hi", "temperature": -1.0},
        {"input": "Hi", "extra_body": {"max_output_tokens": "many"}},
    ],
)
def test_bad_input_is_a_400_and_stores_nothing(api: Api, kwargs: dict[str, Any]) -> None:
    before = api.sessions()
    with pytest.raises(openai.BadRequestError):
        api.client().responses.create(model=api.model, **kwargs)
    assert api.sessions() == before


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/conversations", b'{"items": [{"type": "message", "role": "user", "content": "a\\ud83d b"}]}'),
        ("/conversations", b'{"metadata": {"k": "\\ud800"}}'),
        ("/responses", b'{"model": "$MODEL", "input": "Hi", "metadata": {"k": "\\ud800"}}'),
        ("/responses", b'{"model": "$MODEL", "input": [{"role": "user", "content": "a\\ud83d b"}]}'),
        (
            "/responses",
            b'{"model": "$MODEL", "input": [{"role": "user", "content": [{"type": "input_text", "text": "\\udfff"}]}]}',
        ),
    ],
)
def test_text_with_a_lone_surrogate_is_a_400_and_stores_nothing(api: Api, path: str, body: bytes) -> None:
    """The official client cannot send such text (it encodes UTF-8); a raw client can."""
    before = api.sessions()
    body = body.replace(b"$MODEL", api.model.encode())
    refused = api.native("acme", "POST", path, content=body, headers={"Content-Type": "application/json"})
    assert refused.status_code == 400 and "lone surrogate" in refused.json()["error"]["message"]
    assert api.sessions() == before


def test_with_a_previous_response_the_input_is_only_the_new_message(api: Api) -> None:
    first = api.create(input="Start")
    history = [
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Sure"},
        {"role": "user", "content": "More"},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        api.create(input=history, previous_response_id=first.id)
    assert "only the new user message" in refused.value.message


def test_a_retry_with_the_same_idempotency_key_gets_the_recorded_response(api: Api) -> None:
    headers = {"Idempotency-Key": "retry-responses-1"}
    first = api.create(input="Once only", extra_headers=headers)
    raw = api.client().responses.with_raw_response.create(
        model=api.model, input="Once only", max_output_tokens=8, **SEED, extra_headers=headers
    )
    assert raw.headers["idempotent-replayed"] == "true"
    assert raw.parse().model_dump() == first.model_dump()


def test_a_conversation_is_created_read_updated_and_deleted_with_its_items(api: Api) -> None:
    client = api.client()
    conversation = client.conversations.create(
        items=[
            {"type": "message", "role": "developer", "content": SYSTEM},
            {"type": "message", "role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": "Hello!"},
        ],
        metadata={"topic": "demo"},
    )
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": "demo"}
    assert client.conversations.update(conversation.id, metadata={"topic": "new"}).metadata == {"topic": "new"}
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [
        ("developer", SYSTEM),
        ("user", "Hi"),
        ("assistant", "Hello!"),
    ]
    added = client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "X"}]
    )
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id).content[0].text == "X"
    client.conversations.items.delete(items[1].id, conversation_id=conversation.id)
    left = client.conversations.items.list(conversation.id, order="asc").data
    assert [i.id for i in left] == [items[0].id, items[2].id, added.data[0].id]
    with pytest.raises(openai.NotFoundError):
        api.client("beta").conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        api.client("beta").conversations.items.list(conversation.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.conversations.items.create(
            conversation.id,
            items=[{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
        )
    assert refused.value.param == "items[0].content[0]"
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


def test_responses_in_a_conversation_append_to_it_and_continue_its_session(api: Api) -> None:
    client = api.client()
    before = api.sessions()
    conversation = client.conversations.create(items=[{"type": "message", "role": "developer", "content": SYSTEM}])
    first = api.create(input="Hello", conversation=conversation.id)
    second = api.create(input="More", conversation={"id": conversation.id})
    assert second.conversation.id == conversation.id
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1  # its session goes on
    texts = [(i.role, i.content[0].text) for i in client.conversations.items.list(conversation.id, order="asc").data]
    assert texts == [
        ("developer", SYSTEM),
        ("user", "Hello"),
        ("assistant", first.output_text),
        ("user", "More"),
        ("assistant", second.output_text),
    ]
    assert len(api.sessions() - before) == 1
    # Items added by the client: the next response runs on a new session holding all of them.
    extra = [
        {"type": "message", "role": "user", "content": "Aside"},
        {"type": "message", "role": "assistant", "content": "Ok"},
    ]
    client.conversations.items.create(conversation.id, items=extra)
    third = api.create(input="Next", conversation=conversation.id)
    assert third.usage.input_tokens > second.usage.total_tokens
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == 9
    with pytest.raises(openai.BadRequestError):
        api.create(input="Both", conversation=conversation.id, previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        api.create(input="Unstored", conversation=conversation.id, store=False)
    assert refused.value.param == "store"
    with pytest.raises(openai.NotFoundError):
        api.create("beta", input="Not mine", conversation=conversation.id)
    client.conversations.delete(conversation.id)
    for response in (first, second, third):
        client.responses.delete(response.id)
    assert api.sessions() == before  # nothing holds the conversation's sessions any more


def test_a_conversation_past_its_byte_cap_is_refused_and_keeps_its_items(api: Api) -> None:
    client = api.client()
    conversation = client.conversations.create()
    # 20 items of 350,000 characters: about 7 MB a request, under the 8 MiB body limit; two fit
    # the 16 MiB cap, a third does not.
    big = [{"type": "message", "role": "user", "content": "x" * 350_000} for _ in range(20)]
    client.conversations.items.create(conversation.id, items=big)  # type: ignore[arg-type]
    second = client.conversations.items.create(conversation.id, items=big)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as refused:
        client.conversations.items.create(conversation.id, items=big)  # type: ignore[arg-type]
    assert refused.value.code == "conversation_too_large"
    assert "at most 10,000 items and 16,777,216 bytes" in refused.value.message
    newest = client.conversations.items.list(conversation.id, limit=1).data
    assert [item.id for item in newest] == [second.data[-1].id]  # nothing of the refused request was added
    client.conversations.delete(conversation.id)


def test_responses_are_retrieved_after_a_restart_and_their_chain_goes_on(api: Api) -> None:
    first = api.create(input="Before the restart", instructions=SYSTEM)
    second = api.create(input="Still before", previous_response_id=first.id)
    api.stop()
    api.start()
    client = api.client()
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    assert [i.content[0].text for i in client.responses.input_items.list(first.id).data] == ["Before the restart"]
    after = api.create(input="After the restart", previous_response_id=second.id)
    assert after.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1  # warm
