"""The OpenAI-compatible API on the real default model, with the official `openai` client against a
real `chatkv serve` process: a stateless conversation gives the same greedy replies as the embedded
manager and reuses exactly what it reuses; streamed CJK and emoji replies join to the reply."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from sessions.engine import Engine
from sessions.manager import SessionManager
from tests.app.server_process import ServerProcess, chatkv_serve
from tests.conftest import make_settings

pytestmark = pytest.mark.real_model

SYSTEM = "You are a concise assistant."
TURNS = ["What is the capital of France?", "Give me two facts about it.", "And one about its river?"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, real_engine: Engine) -> Iterator[tuple[ServerProcess, str]]:
    root = tmp_path_factory.mktemp("openai-real")
    with SessionManager(make_settings(root / "home"), engine=real_engine) as manager:
        key = manager.issue_api_key(manager.create_tenant("acme"))
    with chatkv_serve(root / "home", "default", root / "server.log") as server:
        yield server, key


def test_a_stateless_conversation_equals_the_embedded_manager_turn_for_turn(
    served: tuple[ServerProcess, str], real_engine: Engine, tmp_path: Path
) -> None:
    server, key = served
    client = OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    with SessionManager(make_settings(tmp_path / "embedded"), engine=real_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, SYSTEM)
        messages = [{"role": "system", "content": SYSTEM}]
        sessions = set()
        for turn, text in enumerate(TURNS):
            messages.append({"role": "user", "content": text})
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=24,
                temperature=0,
            )
            sessions.add(raw.headers["x-session-id"])
            completion = raw.parse()
            embedded = manager.chat(tenant, sid, text, max_new_tokens=24)
            content = completion.choices[0].message.content
            assert content == embedded.text, f"turn {turn}"
            assert completion.choices[0].finish_reason == embedded.finish_reason
            usage = completion.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == embedded.stats.reused_tokens
            assert usage.prompt_tokens == embedded.stats.prefill_tokens + embedded.stats.reused_tokens
            assert usage.completion_tokens == len(embedded.token_ids)
            if turn:
                assert usage.prompt_tokens_details.cached_tokens > 0
            messages.append({"role": "assistant", "content": content or ""})
    assert len(sessions) == 1


@pytest.mark.parametrize(
    ("prompt", "script"),
    [
        ("Translate 'hello world' to Chinese and add a party emoji.", "cjk"),
        ("Write 你好 three times, then 🎉.", "emoji"),
    ],
)
def test_streamed_cjk_and_emoji_join_to_the_reply(served: tuple[ServerProcess, str], prompt: str, script: str) -> None:
    server, key = served
    client = OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": prompt}]
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0, stream=True)  # type: ignore[arg-type]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)  # type: ignore[arg-type]
    assert streamed == whole.choices[0].message.content
    if script == "cjk":
        assert any("\u4e00" <= c <= "\u9fff" for c in streamed), streamed
    else:
        assert any(ord(c) >= 0x1F300 for c in streamed), streamed


def test_min_tokens_and_ignore_eos_keep_a_short_reply_going(served: tuple[ServerProcess, str]) -> None:
    """vLLM's extensions, as a benchmark client sends them (`extra_body`): greedy, the model ends
    this reply after a few tokens; `min_tokens` past that continues the same reply to at least
    that many tokens (a stop string inside them does not cut it), `min_tokens` under it changes
    nothing, and `ignore_eos` runs the reply to `max_tokens`."""
    server, key = served
    client = OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Reply with one word: is the sky blue?"}]

    def reply(cut: bool = False, **extra: object) -> tuple[str, int, str]:
        completion = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=20,
            temperature=0,
            stop=["blue"] if cut else None,
            extra_body=extra,
        )
        assert completion.usage is not None
        choice = completion.choices[0]
        return choice.message.content or "", completion.usage.completion_tokens, choice.finish_reason

    text, tokens, finish = reply()
    assert finish == "stop" and "blue" in text and tokens < 12
    assert reply(min_tokens=tokens - 1) == (text, tokens, finish)
    longer = reply(min_tokens=tokens + 5)
    assert longer[0].startswith(text) and longer[1] >= tokens + 5
    assert reply(min_tokens=tokens + 5, cut=True) == longer  # "blue" ends inside the minimum
    assert reply(cut=True)[0] == text[: text.index("blue")]
    whole, whole_tokens, whole_finish = reply(ignore_eos=True)
    assert (whole_tokens, whole_finish) == (20, "length") and whole.startswith(text)


def test_a_responses_branch_is_warm_and_replies_as_a_fresh_post_of_its_history(
    served: tuple[ServerProcess, str],
) -> None:
    server, key = served
    client = OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    greedy = {"model": model, "max_output_tokens": 24, "temperature": 0}
    first = client.responses.create(instructions=SYSTEM, input=TURNS[0], **greedy)
    client.responses.create(previous_response_id=first.id, input=TURNS[1], **greedy)  # the chain moves on
    branch = client.responses.create(previous_response_id=first.id, input=TURNS[2], **greedy)
    assert branch.usage is not None and branch.usage.input_tokens_details.cached_tokens > 0  # from the chain's KV
    history = [
        {"role": "user", "content": TURNS[0]},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": TURNS[2]},
    ]
    fresh = client.responses.create(instructions=SYSTEM, input=history, **greedy)  # type: ignore[arg-type]
    assert branch.output_text == fresh.output_text
