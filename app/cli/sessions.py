"""`chatkv sessions ...`: list, inspect, show (the conversation), evict, restore, delete and export
sessions.

Each command asks `sessions.admin` (directly or through a server's admin API, see `app.cli.home`)
and renders its JSON answer here; what a command shows beyond that answer belongs in the
`_render_*` function beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from app.cli.groups import CLIError, CommandGroup
from app.cli.home import open_admin
from app.cli.options import JsonOption, ServerOption, TenantOption, YesOption
from app.cli.output import confirm, count, print_data, print_pairs, print_table, shown, when
from sessions import EVICT_TARGETS, TIERS

if TYPE_CHECKING:
    from sessions import Json

ORIGINS = {
    "explicit": "explicit (opened by id)",
    "named": "named (its client chose the id)",
    "implicit": "implicit (made for a posted history)",
}

sessions_app = typer.Typer(
    cls=CommandGroup, no_args_is_help=True, help="List, inspect, show, evict, restore, delete and export sessions."
)


def _duration_s(text: str) -> float:
    from sessions import parse_duration_s

    try:
        return parse_duration_s(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@sessions_app.command("list")
def sessions_list(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Only this tenant's sessions.")] = None,
    tier: Annotated[
        str | None, typer.Option(metavar="device|host|disk", help="Only sessions cached in this tier.")
    ] = None,
    idle_for: Annotated[
        float | None,
        typer.Option(
            parser=_duration_s, metavar="DURATION", help="Only sessions idle at least this long (90, 30m, 7d)."
        ),
    ] = None,
    as_json: JsonOption = False,
    server: ServerOption = None,
) -> None:
    """List sessions, most recently active first; a fork's origin says what it was forked from."""
    if tier is not None and tier not in TIERS:
        raise CLIError("--tier must be device, host or disk", 2)
    with open_admin(ctx, server) as admin:
        sessions = admin.list_sessions(tenant=tenant, tier=tier, idle_for_s=idle_for)
    print_data(
        sessions,
        as_json,
        lambda ss: print_table(
            ("session", "tenant", "name", "origin", "tier", "tokens", "messages", "last active", "title"),
            [
                (
                    s["id"],
                    s["tenant"],
                    s["name"],
                    _origin_text(s) if s["parent_id"] is not None else s["origin"],
                    s["tier"],
                    s["token_count"],
                    s["message_count"],
                    when(s["last_active_at"]),
                    s["title"],
                )
                for s in ss
            ],
        ),
    )


def _render_inspect(detail: Json) -> None:
    s, t = detail["session"], detail["transcript"]
    ttft = detail["last_ttft_s"]
    print_pairs(
        [
            ("session", f"{s['id']} (tenant {s['tenant']})"),
            ("title", s["title"]),
            ("name", s["name"]),
            ("origin", _origin_text(s)),
            (
                "expires",
                "no idle TTL (explicit, named or a continued fork)"
                if s["expires_at"] is None
                else f"{when(s['expires_at'])} if idle",
            ),
            ("tier", s["tier"] or "none (the next turn rebuilds the cache)"),
            ("turns", f"{t['turns']} ({count(t['messages'], 'message')})"),
            # The rendered conversation (chat template included) up to the last reply token, not
            # the sum of the messages' token ids: what the next turn continues from.
            ("context tokens", s["token_count"]),
            ("first message", t["first_user_message"]),
            ("last message", t["last_user_message"]),
            ("last reply", t["last_reply"]),
            ("fingerprint", detail["model_fingerprint"] + ("" if detail["model_fingerprint_matches"] else " (stale)")),
            ("last ttft", None if ttft is None else f"{ttft * 1000:.1f} ms"),
            ("cache bytes", detail["cache_bytes"]),
            *_per_head_pairs(detail),
            *_replica_pairs(detail),
        ]
    )
    rows = [
        (
            layer["kind"],
            "prefix" if layer["turn_index"] is None else layer["turn_index"],
            layer["tokens"],
            layer.get("evicted", 0),
            f"[{layer['positions'][0]}, {layer['positions'][1]})",
            layer["precision"],
            "shared pool" if layer["shared"] else layer["tier"],
            layer["bytes"],
        )
        for layer in detail["layers"]
    ]
    print_table(("layer", "turn", "tokens", "evicted", "positions", "precision", "tier", "bytes"), rows, title="layers")


def _origin_text(session: Json) -> str:
    """`fork of s_... at turn 3` (a fork, whichever face made it: a regenerate posted to chat
    completions too; the turn it redoes, counted from 1 as the chat page counts it: it keeps its
    parent's first `fork_turns` turns), `implicit (made for a posted history)`, ..."""
    origin: str = session["origin"]
    if session["parent_id"] is not None:
        return f"fork of {session['parent_id']} at turn {(session['fork_turns'] or 0) + 1}"
    return ORIGINS.get(origin, origin)


def _per_head_pairs(detail: Json) -> list[tuple[str, object]]:
    """Under per-head budgets, the spread of the KV heads' own tokens (the table shows their mean)."""
    held = detail.get("held_per_kv_head")
    if not held:
        return []
    return [
        ("held per KV head", f"{held['min']} to {held['max']} own tokens (per-head budgets; the table: their mean)")
    ]


def _replica_pairs(detail: Json) -> list[tuple[str, object]]:
    """The owner and the Redis copy, for a replica (absent from a single process's answer)."""
    if "owner" not in detail or (detail["owner"] is None and not detail["redis_copy"]):
        return []
    owner = detail["owner"]
    shown = "none (the next replica asked takes it)" if owner is None else owner
    if detail.get("owner_url"):
        shown += f" at {detail['owner_url']}"
    return [("owner", shown), ("redis copy", "yes" if detail["redis_copy"] else "no")]


@sessions_app.command("inspect")
def sessions_inspect(
    ctx: typer.Context, session_id: str, tenant: TenantOption, as_json: JsonOption = False, server: ServerOption = None
) -> None:
    """Show a session: transcript summary, layer table, model fingerprint, last TTFT.

    The layer table has one row per layer: kind (base or turn), turn, tokens held per KV head,
    tokens evicted per head (window_policy attention or agnostic; under per-head budgets both are
    means over the KV heads, whose spread a 'held per KV head' line gives), RoPE positions (a half-open range: [0, 21)
    is positions 0 to 20), precision, tier and bytes (the layer's share of the cache by tokens).
    The system-prompt prefix lives in the tenant's shared prefix pool. A stored cache is decrypted
    to read its layers.
    """
    with open_admin(ctx, server) as admin:
        detail = admin.inspect_session(tenant, session_id)
    print_data(detail, as_json, _render_inspect)


@sessions_app.command("show")
def sessions_show(
    ctx: typer.Context, session_id: str, tenant: TenantOption, as_json: JsonOption = False, server: ServerOption = None
) -> None:
    """Print a session's conversation: the system prompt, then each message with its role and time.

    --json prints the same as data (`session`, `system_prompt`, `messages` with index, role, text
    and created_at); `sessions export` adds each message's token ids, `sessions inspect` shows the
    cache.
    """
    with open_admin(ctx, server) as admin:
        export = admin.export_session(tenant, session_id)
    transcript = {
        "session": export["session"],
        "system_prompt": export["system_prompt"],
        "messages": [{k: v for k, v in m.items() if k != "token_ids"} for m in export["messages"]],
    }
    print_data(transcript, as_json, _render_transcript)


def _render_transcript(transcript: Json) -> None:
    """A header line, then one block per message: `[role · time]` and its text as written."""
    s = transcript["session"]
    turns = count(sum(1 for m in transcript["messages"] if m["role"] == "user"), "turn")
    typer.echo(f"session {s['id']} (tenant {s['tenant']}), {turns}, cache {s['tier'] or 'not stored'}")
    if s["title"]:
        typer.echo(f"title: {shown(s['title'])}")
    if s["parent_id"] is not None:
        typer.echo(_origin_text(s))
    blocks: list[tuple[str, str | None, str]] = []
    if transcript["system_prompt"]:
        blocks.append(("system", None, transcript["system_prompt"]))
    blocks += [(m["role"], when(m["created_at"]), m["text"]) for m in transcript["messages"]]
    if not blocks:
        typer.echo("\n(no messages yet)")
    for role, at, text in blocks:
        typer.echo(f"\n[{role}{'' if at is None else ' · ' + at}]")
        typer.echo(shown(text, lines=True))


@sessions_app.command("evict")
def sessions_evict(
    ctx: typer.Context,
    session_id: str,
    tenant: TenantOption,
    to: Annotated[str, typer.Option(metavar="host|disk|drop", help="Target tier, or drop the cache.")],
    server: ServerOption = None,
) -> None:
    """Move an idle session's cache down to host memory or disk, or drop it.

    A dropped cache is rebuilt from the transcript by the next turn. With --server this frees the
    server's device; without one, every stored cache is on disk already.
    """
    if to not in EVICT_TARGETS:
        raise CLIError("--to must be host, disk or drop", 2)
    with open_admin(ctx, server) as admin:
        result = admin.evict_session(tenant, session_id, to)
    if to == "drop":
        typer.echo(f"{session_id}: dropped")
    elif result["tier"] is None:
        typer.echo(f"{session_id}: no cache stored here; the next turn rebuilds it from the transcript")
    else:
        typer.echo(f"{session_id}: {result['tier']}")


@sessions_app.command("restore")
def sessions_restore(ctx: typer.Context, session_id: str, tenant: TenantOption, server: ServerOption = None) -> None:
    """Bring a session's cache up to the server's device ahead of its next turn.

    Needs --server: without a server no process keeps a cache on the device.
    """
    if not (server or ctx.obj.server):
        raise CLIError("sessions restore needs --server (or CHATKV_SERVER)", 2)
    with open_admin(ctx, server) as admin:
        result = admin.restore_session(tenant, session_id)
    if result["tier"] is None:
        why = "the stored cache was unusable and was discarded" if result["rejected"] else "nothing stored"
        typer.echo(f"{session_id}: {why}; the next turn rebuilds it from the transcript")
        return
    source = result["restored_from"] or result["tier"]
    typer.echo(f"{session_id}: {result['tier']} (from {source}, {result['restore_s'] * 1000:.1f} ms)")


@sessions_app.command("delete")
def sessions_delete(
    ctx: typer.Context, session_id: str, tenant: TenantOption, yes: YesOption = False, server: ServerOption = None
) -> None:
    """Delete a session for good: transcript, caches in every tier and files. Asks for confirmation
    unless --yes."""
    with open_admin(ctx, server) as admin:
        found = [s for s in admin.list_sessions(tenant=tenant) if s["id"] == session_id]
        if not found:
            raise CLIError(f"session not found: {session_id}", 2)
        session = found[0]
        title = f" ({session['title']})" if session["title"] else ""
        turns = count(session["message_count"] // 2, "turn")
        confirm(f"Delete session {session_id}{title} of tenant {session['tenant']}, {turns}, for good?", yes)
        admin.delete_session(tenant, session_id)
    typer.echo(f"deleted session {session_id}")


@sessions_app.command("export")
def sessions_export(ctx: typer.Context, session_id: str, tenant: TenantOption, server: ServerOption = None) -> None:
    """Print a session's transcript as JSON (every message with its exact token ids)."""
    with open_admin(ctx, server) as admin:
        transcript = admin.export_session(tenant, session_id)
    print_data(transcript, True, print)
