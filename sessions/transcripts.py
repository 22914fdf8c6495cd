"""The transcripts of recently active sessions, as turns need them.

A turn renders the whole conversation from its transcript (`sessions.transcript.Transcript`:
system prompt, past turns with their exact reply ids, pins, stream position). Reading it from the
database at every turn would cost a query and a parse of every message, so the transcripts of
recently active sessions are kept here, bounded (least recently used out first) so that a service
with many sessions does not keep every transcript in memory. A turn holds its session's lease
while it reads and replaces the transcript, so no two turns of one session race here.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from cache.ids import SessionId, TenantId
from sessions.turn.chat_template import PastTurn
from sessions.turn.transcript import Transcript
from storage.metadata_store import MessageRecord, MetadataStore, SessionRecord

log = logging.getLogger(__name__)

MAX_CACHED_TRANSCRIPTS = 4096


class Transcripts:
    """Transcripts by session, loaded on first use. Thread-safe.

    Args:
        metadata: where transcripts are read from.
        tokenizer: re-tokenises a reply whose stored ids are unusable (see `past_turns`).
        capacity: transcripts kept (least recently used dropped first).
    """

    def __init__(self, metadata: MetadataStore, tokenizer: Any, capacity: int = MAX_CACHED_TRANSCRIPTS) -> None:
        self._metadata = metadata
        self._tokenizer = tokenizer
        self.capacity = capacity
        self._cached: OrderedDict[tuple[TenantId, SessionId], Transcript] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tenant_id: TenantId, session_id: SessionId, record: SessionRecord) -> Transcript:
        """The session's transcript (`record`: its row, read by the caller)."""
        key = (tenant_id, session_id)
        with self._lock:
            cached = self._cached.get(key)
            if cached is not None:
                self._cached.move_to_end(key)
                return cached
        messages = self._metadata.messages(tenant_id=tenant_id, session_id=session_id) or []
        turns = past_turns(messages, self._tokenizer, len(self._tokenizer))
        transcript = Transcript(record.system_prompt, turns, set(record.pinned_turns), record.token_count)
        with self._lock:
            kept = self._cached.setdefault(key, transcript)
            self._trim()
            return kept

    def put(self, tenant_id: TenantId, session_id: SessionId, transcript: Transcript) -> None:
        """Keep `transcript` as the session's (after a turn: it is current even if the bounded
        cache dropped it while the turn ran)."""
        key = (tenant_id, session_id)
        with self._lock:
            self._cached[key] = transcript
            self._cached.move_to_end(key)
            self._trim()

    def pin(self, tenant_id: TenantId, session_id: SessionId, turn_index: int) -> None:
        """Mark a turn pinned in the cached transcript, if there is one."""
        with self._lock:
            cached = self._cached.get((tenant_id, session_id))
            if cached is not None:
                cached.pinned.add(turn_index)

    def drop(self, tenant_id: TenantId, session_id: SessionId) -> None:
        with self._lock:
            self._cached.pop((tenant_id, session_id), None)

    def drop_tenant(self, tenant_id: TenantId) -> None:
        with self._lock:
            for key in [k for k in self._cached if k[0] == tenant_id]:
                del self._cached[key]

    def _trim(self) -> None:
        while len(self._cached) > self.capacity:
            self._cached.popitem(last=False)


def past_turns(messages: list[MessageRecord], tokenizer: Any, vocab_size: int) -> list[PastTurn]:
    """Completed turns of a transcript. A reply whose stored ids are missing or out of the
    vocabulary (an edited row) is re-tokenised from its text, with a warning, so the session stays
    usable; its cache then no longer matches and is rebuilt."""
    turns = []
    pending_user: MessageRecord | None = None
    for record in messages:
        if record.role == "user":
            pending_user = record
        elif record.role == "assistant" and pending_user is not None:
            ids = record.token_ids
            if not ids or not all(0 <= i < vocab_size for i in ids):
                log.warning("message %d has unusable token ids; re-tokenising its text", record.index)
                ids = tuple(tokenizer.encode(record.text, add_special_tokens=False))
            turns.append(PastTurn(pending_user.text, record.text, ids))
            pending_user = None
    return turns
