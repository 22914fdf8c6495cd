"""`chatkv replicas`: the replicas sharing this home's database, with their heartbeats, the sessions
each owns, the KV-cache bytes each holds and whether it drains; `chatkv replicas drain <id>` asks a
replica to hand its sessions over (docs/replicas.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from app.cli.groups import CommandGroup
from app.cli.home import open_admin
from app.cli.options import JsonOption, ServerOption
from app.cli.output import print_data, print_pairs, print_table, when

if TYPE_CHECKING:
    from sessions import Json

replicas_app = typer.Typer(cls=CommandGroup, invoke_without_command=True, no_args_is_help=False)


@replicas_app.callback()
def replicas_command(ctx: typer.Context, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """List the replicas registered in the database: id, URL, last heartbeat, state, sessions owned,
    cache bytes, turns queued.

    A replica whose heartbeat is older than one ownership lease (CHATKV_OWNERSHIP_LEASE_S) is shown
    as gone: its sessions pass to the next replica asked for them. A draining one hands its
    sessions over and takes no new ones. Read from the database, so any replica's --server, or a
    home configured with the shared CHATKV_DATABASE_URL, shows them all.
    """
    if ctx.invoked_subcommand is not None:
        return
    with open_admin(ctx, server) as admin:
        listing = admin.replicas()
    print_data(listing, as_json, _render_replicas)


@replicas_app.command("drain")
def drain_command(
    ctx: typer.Context,
    replica_id: Annotated[str, typer.Argument(help="The replica's id (`chatkv replicas` lists them).")],
    as_json: JsonOption = False,
    server: ServerOption = None,
) -> None:
    """Ask a replica to drain: it hands each of its sessions over (published to Redis, released) as
    soon as no turn uses it, other replicas stop forwarding turns to it, and its /healthz answers
    503 so a load balancer stops sending it requests. It reads the request from the database
    within a third of a lease. Stopping a replica (SIGTERM) drains it too; a restarted one does not.
    """
    with open_admin(ctx, server) as admin:
        answer = admin.drain_replica(replica_id)
    print_data(answer, as_json, lambda a: print_pairs([("replica", a["id"]), ("draining", "yes")]))


def _render_replicas(listing: Json) -> None:
    rows = [
        (
            r["id"],
            r["url"] or "-",
            f"{when(r['last_heartbeat'])} ({r['heartbeat_age_s']:.1f} s ago)",
            r["state"],
            r["sessions_owned"],
            r["cache_bytes"],
            r["queued_turns"],
        )
        for r in listing["replicas"]
    ]
    if not rows:
        note = "" if listing["replica_mode"] else " (this home runs as a single process: SQLite without Redis)"
        typer.echo(f"no replicas registered{note}")
        return
    print_table(("replica", "url", "last heartbeat", "state", "sessions owned", "cache bytes", "queued turns"), rows)
