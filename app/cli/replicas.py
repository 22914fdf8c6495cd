"""`chatkv replicas`: the replicas sharing this home's database, with their heartbeats, the sessions
each owns and the KV-cache bytes each holds (docs/replicas.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from app.cli.home import open_admin
from app.cli.options import JsonOption, ServerOption
from app.cli.output import print_data, print_table, when

if TYPE_CHECKING:
    from sessions import Json


def replicas_command(ctx: typer.Context, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """List the replicas registered in the database: id, URL, last heartbeat, sessions owned, cache bytes.

    A replica whose heartbeat is older than one ownership lease (CHATKV_OWNERSHIP_LEASE_S) is shown
    as gone: its sessions pass to the next replica asked for them. Read from the database, so any
    replica's --server, or a home configured with the shared CHATKV_DATABASE_URL, shows them all.
    """
    with open_admin(ctx, server) as admin:
        listing = admin.replicas()
    print_data(listing, as_json, _render_replicas)


def _render_replicas(listing: Json) -> None:
    rows = [
        (
            r["id"],
            r["url"] or "-",
            f"{when(r['last_heartbeat'])} ({r['heartbeat_age_s']:.1f} s ago)",
            "alive" if r["alive"] else "gone",
            r["sessions_owned"],
            r["cache_bytes"],
        )
        for r in listing["replicas"]
    ]
    if not rows:
        note = "" if listing["replica_mode"] else " (this home runs as a single process: SQLite without Redis)"
        typer.echo(f"no replicas registered{note}")
        return
    print_table(("replica", "url", "last heartbeat", "state", "sessions owned", "cache bytes"), rows)
