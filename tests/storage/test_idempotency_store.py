"""Idempotency keys on SQLite and PostgreSQL: a claim lives as long as the process that holds it
(its own, or a replica incarnation that heartbeats), a claim of a dead holder is taken over and
its late release frees nothing, and a stored response is its key's answer from the transaction
that stores it until it, or the conversation it was made in, is deleted."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import Engine

from storage.conversation_store import Caps, ConversationStore
from storage.errors import SessionGone
from storage.idempotency_store import Claimed, IdempotencyStore, InProgress, KeyReused, Replay
from storage.metadata_store import MetadataStore
from storage.replica_store import ReplicaStore
from storage.response_store import ResponseRecord, ResponseStore
from storage.schema import utcnow
from tests.storage.conftest import add_session

LIVE_S = 5.0


@pytest.fixture
def keys(db_engine: Engine, metadata: MetadataStore) -> IdempotencyStore:
    add_session(metadata, "tn_a", "s_1")
    return IdempotencyStore(db_engine, ttl_s=3600, stale_s=900, live_within_s=LIVE_S)


def _register(db_engine: Engine, incarnation: str, heartbeat_unix_s: float) -> None:
    ReplicaStore(db_engine).register(
        replica_id=f"r_{incarnation}",
        incarnation=incarnation,
        url="http://127.0.0.1:1",
        hostname="h",
        pid=1,
        now_unix_s=heartbeat_unix_s,
        live_within_s=LIVE_S,
    )


def test_a_claim_lives_while_its_holder_heartbeats_and_is_taken_over_once_it_is_dead(
    keys: IdempotencyStore, db_engine: Engine
) -> None:
    claim = {"tenant_id": "tn_a", "request_digest": "d1"}
    assert keys.claim(key="k", holder="single", **claim) == Claimed("tn_a", "k", "single")
    assert keys.claim(key="k", holder="single", **claim) == InProgress()  # its own process runs it
    # Another incarnation: "single" heartbeats nowhere (a single process that died), so its claim is free.
    assert keys.claim(key="k", holder="next", **claim) == Claimed("tn_a", "k", "next")
    keys.release(Claimed("tn_a", "k", "single"))  # the dead holder's late release frees nothing
    assert keys.claim(key="k", holder="other", **claim) == Claimed("tn_a", "k", "other")
    assert keys.claim(key="k", holder="next", request_digest="d2", tenant_id="tn_a") == KeyReused()

    _register(db_engine, "live", time.time())
    assert keys.claim(key="r", holder="live", **claim) == Claimed("tn_a", "r", "live")
    assert keys.claim(key="r", holder="peer", **claim) == InProgress()  # "live" heartbeats
    ReplicaStore(db_engine).heartbeat(
        replica_id="r_live", incarnation="live", cache_bytes=0, now_unix_s=time.time() - 2 * LIVE_S
    )
    assert keys.claim(key="r", holder="peer", **claim) == Claimed("tn_a", "r", "peer")
    keys.complete(Claimed("tn_a", "r", "live"), response='{"late": true}', session_id="s_1")  # records nothing
    keys.complete(Claimed("tn_a", "r", "peer"), response='{"ok": true}', session_id="s_1")
    assert keys.claim(key="r", holder="third", **claim) == Replay('{"ok": true}', "s_1")


def test_a_response_stored_with_its_key_is_the_answer_until_the_response_is_deleted(
    keys: IdempotencyStore, db_engine: Engine
) -> None:
    responses = ResponseStore(db_engine)
    held = keys.claim(tenant_id="tn_a", key="k", request_digest="d", holder="p")
    assert isinstance(held, Claimed)
    record = ResponseRecord("resp_1", "tn_a", "s_1", 0, None, '{"id": "resp_1"}', "[]", utcnow())
    with pytest.raises(SessionGone):  # nothing stored: the key is still this process's claim
        responses.add(ResponseRecord("resp_0", "tn_a", "s_gone", 0, None, "{}", "[]", utcnow()), answers=held)
    assert keys.claim(tenant_id="tn_a", key="k", request_digest="d", holder="p") == InProgress()
    responses.add(record, answers=held)
    assert keys.claim(tenant_id="tn_a", key="k", request_digest="d", holder="q") == Replay('{"id": "resp_1"}', "s_1")
    responses.delete(tenant_id="tn_a", response_id="resp_1")
    assert keys.claim(tenant_id="tn_a", key="k", request_digest="d", holder="q") == Claimed("tn_a", "k", "q")


def test_a_key_answered_in_a_conversation_goes_with_the_conversation(keys: IdempotencyStore, db_engine: Engine) -> None:
    caps = Caps(max_items=10, max_bytes=10_000)
    ConversationStore(db_engine).add(conversation_id="conv_1", tenant_id="tn_a", metadata="{}", items=[], caps=caps)
    held = keys.claim(tenant_id="tn_a", key="k", request_digest="d", holder="p")
    assert isinstance(held, Claimed)
    record = ResponseRecord("resp_1", "tn_a", "s_1", 0, None, "{}", "[]", utcnow())
    ResponseStore(db_engine).add(record, answers=held, conversation_id="conv_1")
    assert isinstance(keys.claim(tenant_id="tn_a", key="k", request_digest="d", holder="q"), Replay)
    ConversationStore(db_engine).delete(tenant_id="tn_a", conversation_id="conv_1")
    assert keys.claim(tenant_id="tn_a", key="k", request_digest="d", holder="q") == Claimed("tn_a", "k", "q")
