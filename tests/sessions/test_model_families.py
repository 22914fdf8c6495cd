"""The family matrix: chatkv's replies on tiny random models of every family it serves equal
transformers' own greedy `generate` over the same conversation, token for token.

Per family: a first turn longer than the sliding window, warm follow-ups, a turn restored from
disk, a fork at an earlier turn, four sessions batched together, and the `turns` window policy.
The reference is a separate copy of the model that chatkv never touched (its own attention
implementation), given the conversation's ids as the session holds them: the template's pieces
with every earlier reply's generated ids spliced in (chatkv keeps generated ids; re-tokenised
text could differ by design).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.model_source import load_model
from sessions.turn.chat_template import PastTurn
from tests.conftest import MODEL_CACHE, make_settings
from tests.model_families import FAMILIES, WINDOW, save_family_model

SYSTEM = "You are a helpful assistant who answers in short sentences."
MESSAGES = [
    "Tell me a story about a fox who lives in a forest near a river and a mountain.",
    "What did the fox eat for breakfast on the first day of spring?",
    "Where does the river go after it leaves the forest?",
]
NEW_TOKENS = 10


class Family:
    """One family's engine (chatkv's copy of the model) and reference (an untouched copy)."""

    def __init__(self, path: Path) -> None:
        self.engine = Engine(load_model(str(path), MODEL_CACHE, "cpu", "float32"))
        self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def expected(self, manager: SessionManager, past: list[PastTurn], message: str) -> list[int]:
        ids = manager.internals.template.conversation(SYSTEM, past, message).token_ids
        inputs = torch.tensor([list(ids)])
        out = self.reference.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        return out[0, inputs.shape[1] :].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Family:
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    return Family(save_family_model(request.param, tokenizer, tmp_path_factory.mktemp(request.param)))


@pytest.fixture
def manager(tmp_path: Path, family: Family) -> Iterator[SessionManager]:
    with SessionManager(make_settings(tmp_path / "home"), engine=family.engine) as manager:
        yield manager


def chat(manager: SessionManager, tenant: Any, sid: str, message: str) -> Any:
    return manager.chat(tenant, sid, message, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def test_warm_turns_a_disk_restore_and_a_fork_equal_generate(family: Family, manager: SessionManager) -> None:
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    past: list[PastTurn] = []
    for turn, message in enumerate(MESSAGES):
        if turn == 2:
            assert manager.evict_session(tenant, sid, "disk") == "disk"
        reply = chat(manager, tenant, sid, message)
        assert list(reply.token_ids) == family.expected(manager, past, message), f"turn {turn} differs"
        assert reply.stats.restored_from == ("new", "device", "disk")[turn]
        if turn == 0:
            assert reply.stats.prefill_tokens > WINDOW  # the first turn already crosses the window
        past.append(PastTurn(message, reply.text, reply.token_ids))
    fork = manager.fork(tenant, sid, at_turn=1)
    edited = "What did the fox eat for dinner that evening?"
    reply = chat(manager, tenant, fork, edited)
    assert list(reply.token_ids) == family.expected(manager, past[:1], edited), "the fork's turn differs"
    again = chat(manager, tenant, sid, "And the mountain?")  # the parent goes on untouched
    assert list(again.token_ids) == family.expected(manager, past, "And the mountain?")


def test_four_sessions_batched_together_each_equal_generate(family: Family, manager: SessionManager) -> None:
    tenant = manager.create_tenant("acme")
    sessions = [manager.open_session(tenant, system_prompt=SYSTEM) for _ in range(4)]
    firsts = [chat(manager, tenant, sid, f"{MESSAGES[0]} Number {i}.") for i, sid in enumerate(sessions)]
    replies: dict[int, Any] = {}
    ready = threading.Barrier(4)

    def run(index: int) -> None:
        ready.wait()
        replies[index] = chat(manager, tenant, sessions[index], MESSAGES[1 + index % 2])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, first in enumerate(firsts):
        past = [PastTurn(f"{MESSAGES[0]} Number {index}.", first.text, first.token_ids)]
        expected = family.expected(manager, past, MESSAGES[1 + index % 2])
        assert list(replies[index].token_ids) == expected, f"session {index} differs when batched"


def test_turns_window_policy_replies_equal_generate_over_the_kept_window(family: Family, tmp_path: Path) -> None:
    """Whole turns demoted by re-prefilling the kept ones: the reply equals `generate` over what
    the window holds (base and kept turns), whatever the attention kinds."""
    engine = Engine(family.engine.loaded)  # its own runner, so re-rotation can be turned off here
    engine.runner.rope_layout = None
    with SessionManager(make_settings(tmp_path / "home", context_budget_tokens=100), engine=engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        key = manager.internals.tiers_key(tenant, sid)
        demoted = 0
        for message in [*MESSAGES, "Thanks, and what happened next?"]:
            reply = chat(manager, tenant, sid, message)
            cache = manager.internals.tiers.peek(key)
            assert cache is not None
            demoted += bool(reply.stats.demoted_tokens)
            # What the window holds (demoted turns are gone from it), less the reply's fed ids.
            prompt = torch.tensor([list(cache.token_ids[: cache.total_tokens - (NEW_TOKENS - 1)])])
            with torch.inference_mode():
                out = family.reference.generate(
                    prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
                )
            assert list(reply.token_ids) == out[0, prompt.shape[1] :].tolist()
        assert demoted >= 1


def test_sliding_layers_hold_only_their_window(family: Family, manager: SessionManager) -> None:
    """A sliding layer keeps the last W - 1 tokens of a conversation many windows long; a full
    layer every token; the cache's bytes are exactly those tensors."""
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    for message in MESSAGES:
        chat(manager, tenant, sid, message)
    cache = manager.internals.tiers.peek(manager.internals.tiers_key(tenant, sid))
    assert cache is not None
    windows = family.engine.layout.windows
    held = [cache.own_keys[index].shape[-2] for index in range(len(windows))]
    assert held == [cache.own_tokens if window is None else window - 1 for window in windows]
    assert cache.own_nbytes == sum(held) * family.engine.layout.layer_bytes_per_token
