"""Top-level operations commands: `chatkv stats` and `chatkv gc`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from app.cli.home import open_admin
from app.cli.options import JsonOption, ServerOption
from app.cli.output import count, duration_text, print_data, print_pairs, print_table, when

if TYPE_CHECKING:
    from sessions import Json


def _render_stats(stats: Json) -> None:
    rows = [
        (tier, t["sessions"], t.get("copies", 0), t["bytes"], t["budget_bytes"], f"{t['budget_used']:.1%}")
        for tier, t in stats["tiers"].items()
    ]
    print_table(("tier", "sessions", "+ copies", "bytes", "budget", "used"), rows)
    # Without this, disk bytes beside 0 sessions read like a leak: they are the write-back's copies.
    typer.echo(
        "sessions: placed in the tier; + copies: write-back copies of sessions placed higher; "
        "bytes: both, and base layers"
    )
    if not stats.get("live", True):  # offline: tiers as stored, no turn counters
        print_pairs([("tenants", stats["tenants"]), ("sessions", stats["sessions"]), ("model", stats["model"])])
        typer.echo(f"note: {stats['note']}")
        return
    evictions = ", ".join(f"{move} {int(n)}" for move, n in stats["evictions"].items()) or "none"
    # Where each fork's cache came from: a tier of its parent, or `rebuilt` by prefill.
    forks = ", ".join(f"{source} {int(n)}" for source, n in stats.get("forks", {}).items()) or "none"
    print_pairs(
        [
            ("tenants", stats["tenants"]),
            ("sessions", stats["sessions"]),
            ("cache hit rate", f"{stats['cache_hit_rate_tokens']:.1%} of prompt tokens"),
            ("prefill tokens", f"{int(stats['prefill_tokens'])} run, {int(stats['prefill_tokens_saved'])} saved"),
            ("evictions", evictions),
            ("integrity failures", int(stats["integrity_failures"])),
            ("forks by source", forks),
            ("model", f"{stats['model']} ({stats['model_fingerprint']})"),
        ]
    )
    by_tenant = stats.get("prompt_tokens_by_tenant", {})
    if by_tenant:
        tenant_rows = [
            (
                t["tenant"] or f"{tenant_id} (deleted)",
                int(t["cached_tokens"]),
                int(t["prefilled_tokens"]),
                f"{t['hit_rate_tokens']:.1%}",
            )
            for tenant_id, t in sorted(by_tenant.items(), key=lambda item: item[1]["tenant"] or item[0])
        ]
        print_table(("tenant", "from cache", "prefilled", "hit rate"), tenant_rows, title="prompt tokens by tenant")


def stats_command(ctx: typer.Context, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """Sessions and bytes per tier, budgets used, cache hit rate, prefill tokens saved, evictions.

    With --server: the running server's tiers, and its turn counters since it started: hit rate,
    prefill tokens, evictions, forks by the tier their cache came from, and per tenant the prompt
    tokens served from cache and prefilled. Without: the tiers as stored in the home (every cache
    on disk), without turn counters, and without loading the model.
    """
    with open_admin(ctx, server) as admin:
        stats = admin.stats()
    print_data(stats, as_json, _render_stats)


def gc_command(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
    as_json: JsonOption = False,
    server: ServerOption = None,
) -> None:
    """Delete expired implicit sessions, and sessions idle longer than CHATKV_SESSION_RETENTION_S.

    Implicit sessions (made for a posted history) and forks nobody continued go once idle longer
    than their tenant's retention (`chatkv tenants retention`, else CHATKV_IMPLICIT_RETENTION_S,
    30d): what `chatkv serve` does by itself every 10 minutes. Any session goes once idle longer
    than CHATKV_SESSION_RETENTION_S (e.g. 90d; unset: kept). The settings are the server's with
    --server, else this environment's. Disk orphans (crash leftovers, files without a row, blobs of
    another model) are removed whenever a manager starts: by the server at its start, or by this
    command without --server when it deletes something.
    """
    with open_admin(ctx, server) as admin:
        report = admin.gc(dry_run=dry_run)
    print_data(report, as_json, _render_gc)


def _render_gc(report: Json) -> None:
    verb = "would remove" if report["dry_run"] else "removed"
    implicit = report["expired_implicit_sessions"]
    ttl = duration_text(report["implicit_retention_s"])
    typer.echo(
        f"{verb} {count(len(implicit), 'implicit session')} or uncontinued forks idle longer than "
        f"their tenant's retention (default {ttl})"
    )
    _list_expired(implicit)
    if report["retention_s"] is None:
        typer.echo("no retention set (CHATKV_SESSION_RETENTION_S, e.g. 30d): other sessions are kept")
        return
    expired = report["expired_sessions"]
    typer.echo(f"{verb} {count(len(expired), 'session')} idle longer than {duration_text(report['retention_s'])}")
    _list_expired(expired)


def _list_expired(sessions: list[Json]) -> None:
    for s in sessions:
        typer.echo(f"  {s['id']}  tenant {s['tenant']}  last active {when(s['last_active_at'])}")
