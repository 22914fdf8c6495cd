"""The chat page's text and HTML: messages, error lines and notes, the session line, and each
turn's stats (one line of figures with `data-stat` attributes, and a row of the stats table)."""

from __future__ import annotations

import html

from app.ui.view import Shown, StatsRow
from sessions import ChatKVError, Reply, SessionInfo, TurnStats

STATS_HEADERS = [
    "turn",
    "TTFT (ms)",
    "prefilled tokens",
    "reused tokens",
    "cache from",
    "restore (ms)",
    "decode tokens/s",
    "context tokens",
]
"""Columns of the stats table, in the order of `stats_row`."""
STATS_COLUMN_WIDTHS: list[str | int] = ["7%", "11%", "12%", "12%", "20%", "12%", "13%", "13%"]
"""Shares of the table's width: "cache from" holds words, the others figures under two-word headers."""
STATS_TABLE_LABEL = "Turns sent in this page visit"
_SOURCE_NAMES = {"device": "device", "host": "host memory", "disk": "disk", "redis": "Redis (shared)"}
_NOT_RESTORED = ("new", "device", "rebuilt")
"""Sources a turn does not restore a cache from; every other (a lower tier: host, disk, Redis) has
a restore time, shown as `chatkv chat` shows it."""


def chat_messages(shown: Shown) -> list[dict[str, str]]:
    """The messages on screen as the chatbot component's `{"role", "content"}` dicts."""
    return [{"role": role, "content": text} for role, text in shown]


def error_html(message: str) -> str:
    """One error line (escaped), announced to screen readers."""
    return f'<div class="chatkv-error" role="alert">{html.escape(message)}</div>'


def failure_message(failure: Exception | None) -> str:
    """The one line shown for a turn that failed."""
    if isinstance(failure, ChatKVError):
        return str(failure)
    return "the turn failed (internal error, see the server log); nothing was stored"  # a bug, logged by the worker


def note_html(message: str, kind: str | None = None) -> str:
    """A quiet line; with `kind` a note about the reply (`stopped`, `length`: its `data-note`)."""
    if kind is None:
        return f'<div class="chatkv-stats">{html.escape(message)}</div>'
    return f'<div class="chatkv-note" data-note="{kind}">{html.escape(message)}</div>'


def length_note(reply: Reply) -> str:
    limit = len(reply.token_ids)
    return note_html(
        f"The reply stopped at the {limit}-token limit (Max new tokens): raise it, or ask to continue.",
        kind="length",
    )


def session_info_html(info: SessionInfo) -> str:
    """The session line: id, title, where a fork comes from, size, cache tier, activity, system
    prompt. A fork's title is its parent's, copied when forked: the line does not show it as the
    fork's own (the picker names a fork by what it changed)."""
    parts = [f"session <code>{html.escape(str(info.id))}</code>"]
    if info.title and info.parent_id is None:
        parts.append(html.escape(info.title))
    if info.parent_id is not None:
        turn = (info.fork_turns or 0) + 1
        parts.append(f"fork of <code>{html.escape(str(info.parent_id))}</code> at turn {turn}")
    parts.append(f"{info.message_count} messages, {info.token_count} tokens, cache: {info.tier or 'none'}")
    parts.append(f"last active {info.last_active_at:%Y-%m-%d %H:%M} UTC")
    if info.system_prompt:
        prompt = info.system_prompt if len(info.system_prompt) <= 120 else info.system_prompt[:117] + "..."
        parts.append(f"system prompt: {html.escape(prompt)}")
    return " · ".join(parts)


def _source_text(stats: TurnStats) -> str:
    """Where the turn's cache came from, in words (the stats table's "cache from")."""
    source = stats.restored_from
    if source == "new":
        return "shared system prompt" if stats.base_reused_tokens else "nothing yet (first turn)"
    if source == "rebuilt":
        return "rebuilt from the transcript"
    return _SOURCE_NAMES.get(source, source)


def _restore_ms(stats: TurnStats) -> float | None:
    """Time to bring the cache back from a lower tier (host memory, disk, Redis); `None` for other
    sources."""
    return None if stats.restored_from in _NOT_RESTORED else round(stats.restore_s * 1000, 1)


def stats_row(turn: int, stats: TurnStats) -> StatsRow:
    rate = stats.decode_tokens / stats.decode_s if stats.decode_s > 0 else None
    return (
        turn,
        round(stats.ttft_s * 1000, 1),
        stats.prefill_tokens,
        stats.reused_tokens,
        _source_text(stats),
        _restore_ms(stats),
        None if rate is None else round(rate, 1),
        stats.cache_tokens,
    )


def stats_html(turn: int, stats: TurnStats) -> str:
    """One readable line; each figure carries a `data-stat` attribute for tests and scrapers (the
    cache source also a `data-value` with the `TurnStats.restored_from` value)."""
    _, ttft_ms, prefill, reused, source_text, restore_ms, rate, context = stats_row(turn, stats)
    rate_text = "-" if rate is None else f"{rate:.1f}"
    source = html.escape(stats.restored_from)
    if stats.restored_from == "new" and stats.base_reused_tokens:
        cache = "cache: the tenant's <b>shared system prompt</b>"
    elif stats.restored_from == "new":
        cache = "<b>no cache yet</b> (first turn)"
    elif stats.restored_from == "rebuilt":
        cache = "cache <b>rebuilt</b> from the transcript"
    else:
        cache = f"cache from <b>{html.escape(source_text)}</b>"
    if restore_ms is not None:
        cache += f', restored in <b data-stat="restore_ms">{restore_ms:.1f}</b> ms'
    return (
        f'<div class="chatkv-stats">Turn <b data-stat="turn">{turn}</b>'
        f' · TTFT <b data-stat="ttft_ms">{ttft_ms:.1f}</b> ms'
        f' · prefilled <b data-stat="prefill_tokens">{prefill}</b> tokens'
        f' · reused <b data-stat="reused_tokens">{reused}</b> tokens'
        f' · <span data-stat="restored_from" data-value="{source}">{cache}</span>'
        f' · decode <b data-stat="decode_tokens_per_s">{rate_text}</b> tokens/s'
        f' · context <b data-stat="context_tokens">{context}</b> tokens</div>'
    )
