"""Helpers of the offload and restart tests: references computed without the session cache, and
small readers of a manager's state."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DynamicCache

from cache.ids import SessionId, TenantId
from cache.tiers import CacheKey
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.turn.chat_template import PastTurn
from tests.conftest import make_settings


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread for a while. On a small shared CPU box two OpenMP threads per process
    oversubscribe the cores and a real-model turn takes 6x longer (measured: 0.85 s against 5-6 s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def open_manager(home: Path, engine: Engine, **overrides: object) -> SessionManager:
    return SessionManager(make_settings(home, **overrides), engine=engine)


def key_of(tenant_id: str, session_id: str) -> CacheKey:
    return CacheKey.for_session(TenantId(tenant_id), SessionId(session_id))


def past_turns(manager: SessionManager, tenant_id: str, session_id: str) -> list[PastTurn]:
    """The session's turns as stored in the database (exact generated ids)."""
    history = manager.history(tenant_id, session_id)
    users = [m for m in history if m.role == "user"]
    replies = [m for m in history if m.role == "assistant"]
    return [PastTurn(u.text, a.text, a.token_ids) for u, a in zip(users, replies, strict=True)]


@torch.inference_mode()
def greedy_from_scratch(engine: Engine, token_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """Plain `transformers` decoding on a fresh cache, the whole conversation in one prefill: the
    reply a session must give whatever happened to its cache (invariant 1)."""
    cache = DynamicCache(config=engine.model.config)
    inputs = torch.tensor([list(token_ids)], device=engine.device)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = engine.model(input_ids=inputs, cache=cache, use_cache=True).logits[0, -1]
        token = int(torch.argmax(logits))
        generated.append(token)
        if token in engine.stop_token_ids:
            break
        inputs = torch.tensor([[token]], device=engine.device)
    return tuple(generated)


def reference_reply(
    manager: SessionManager, tenant_id: str, session_id: str, message: str, max_new_tokens: int
) -> tuple[int, ...]:
    """The greedy reply to `message` after the session's stored transcript, by full re-prefill."""
    record = manager.session_info(tenant_id, session_id)
    conversation = manager.internals.template.conversation(
        record.system_prompt, past_turns(manager, tenant_id, session_id), message
    )
    return greedy_from_scratch(manager.internals.engine, conversation.token_ids, max_new_tokens)


def new_turn_tokens(manager: SessionManager, tenant_id: str, session_id: str, message: str) -> int:
    """Tokens a follow-up turn must prefill, counted without the turn runner: the end of the last
    reply the model never saw (its last token unless it was a stop token, and the template's
    closing) plus the new user turn up to the generation prompt."""
    past = past_turns(manager, tenant_id, session_id)
    tokenizer = manager.internals.engine.tokenizer
    closing = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    framing = tokenizer.encode(
        f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    unfed = 0 if past[-1].assistant_ids[-1] in manager.internals.engine.stop_token_ids else 1
    return unfed + len(closing) + len(framing)


def integrity_failures(manager: SessionManager) -> float:
    """`chatkv_integrity_failures_total`, summed over tiers."""
    registry = manager.internals.metrics.registry
    return sum(
        registry.get_sample_value("chatkv_integrity_failures_total", {"tier": tier}) or 0.0
        for tier in ("device", "host", "disk")
    )


def restores(manager: SessionManager, tier: str) -> float:
    return manager.internals.metrics.registry.get_sample_value("chatkv_restores_total", {"tier": tier}) or 0.0
