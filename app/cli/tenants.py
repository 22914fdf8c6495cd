"""`chatkv tenants ...`: create, list, show and delete tenants; rotate their API keys; set how long
their implicit sessions are kept."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from app.cli.groups import CLIError, CommandGroup
from app.cli.home import open_admin
from app.cli.options import JsonOption, ServerOption, YesOption
from app.cli.output import confirm, count, duration_text, print_data, print_pairs, print_table, when

if TYPE_CHECKING:
    from sessions import Json

tenants_app = typer.Typer(
    cls=CommandGroup,
    no_args_is_help=True,
    help="Create, list, show, delete tenants; rotate their API keys; set their retention.",
)


@tenants_app.command("create")
def tenants_create(ctx: typer.Context, name: str, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """Create a tenant and print its API key (shown once; only a salted hash is kept)."""
    with open_admin(ctx, server) as admin:
        tenant = admin.create_tenant(name)
    print_data(
        tenant,
        as_json,
        lambda t: print_pairs(
            [("tenant", f"{t['name']} ({t['id']})"), ("api key", t["api_key"]), ("", "store it now")]
        ),
    )


@tenants_app.command("list")
def tenants_list(ctx: typer.Context, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """List tenants with their session counts."""
    with open_admin(ctx, server) as admin:
        tenants = admin.list_tenants()
    print_data(
        tenants,
        as_json,
        lambda ts: print_table(
            ("tenant", "id", "sessions", "api key", "created"),
            [
                (t["name"], t["id"], t["sessions"], "yes" if t["has_api_key"] else "no", when(t["created_at"]))
                for t in ts
            ],
        ),
    )


@tenants_app.command("show")
def tenants_show(ctx: typer.Context, tenant: str, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """Show a tenant: sessions, tokens and sessions per tier."""
    with open_admin(ctx, server) as admin:
        info = admin.show_tenant(tenant)
    per_tier = ", ".join(f"{tier} {n}" for tier, n in info["sessions_by_tier"].items())
    print_data(
        info,
        as_json,
        lambda t: print_pairs(
            [
                ("tenant", t["name"]),
                ("id", t["id"]),
                ("created", when(t["created_at"])),
                ("sessions", t["sessions"]),
                ("tokens", t["tokens"]),
                ("caches", per_tier),
                ("api key", "issued" if t["has_api_key"] else "none"),
                ("master key id", t["master_key_id"]),
                ("retention", _retention_text(t)),
            ]
        ),
    )


def _retention_text(tenant: Json) -> str:
    """`7d idle (the tenant's own)`, or `30d idle (the default)`: how long its implicit sessions
    and uncontinued forks are kept."""
    own = tenant["implicit_retention_s"]
    if own is None:
        return f"implicit sessions {duration_text(tenant['default_implicit_retention_s'])} idle (the default)"
    return f"implicit sessions {duration_text(own)} idle (the tenant's own)"


def _retention_s(text: str) -> float | None:
    """`default` -> `None`; else a duration (`90`, `30m`, `12h`, `7d`) in seconds."""
    if text == "default":
        return None
    from sessions import parse_duration_s

    try:
        return parse_duration_s(text)
    except ValueError as exc:
        raise CLIError(f"{exc}, or 'default'", 2) from None


@tenants_app.command("retention")
def tenants_retention(
    ctx: typer.Context,
    tenant: str,
    ttl: Annotated[str, typer.Argument(metavar="DURATION|default", help="7d, 12h, 90 (seconds), or default.")],
    as_json: JsonOption = False,
    server: ServerOption = None,
) -> None:
    """Set how long a tenant's implicit sessions and uncontinued forks are kept idle.

    Sessions made for a posted history (stateless OpenAI clients) and forks nobody continued are
    deleted, caches in every tier first, once idle this long (a sliding TTL: every turn restarts
    it); `default` goes back to the server's CHATKV_IMPLICIT_RETENTION_S (30d unless set).
    Explicit and named sessions are kept. A server applies it at its next sweep (every 10 minutes).
    """
    retention_s = _retention_s(ttl)
    with open_admin(ctx, server) as admin:
        info = admin.set_tenant_retention(tenant, retention_s)
    print_data(info, as_json, lambda t: typer.echo(f"{t['name']}: {_retention_text(t)}"))


@tenants_app.command("delete")
def tenants_delete(ctx: typer.Context, tenant: str, yes: YesOption = False, server: ServerOption = None) -> None:
    """Delete a tenant and everything of it, for good.

    Its data key is destroyed first (crypto-shredding), so a cache blob that survives anywhere
    cannot be decrypted; then its caches, files and rows go. Asks for confirmation unless --yes.
    """
    with open_admin(ctx, server) as admin:
        info = admin.show_tenant(tenant)
        sessions = count(info["sessions"], "session")
        confirm(f"Delete tenant {info['name']} ({info['id']}) and its {sessions} for good?", yes)
        admin.delete_tenant(info["id"])
    typer.echo(f"deleted tenant {info['name']} ({info['id']})")


@tenants_app.command("rotate-api-key")
def tenants_rotate_api_key(
    ctx: typer.Context, tenant: str, as_json: JsonOption = False, server: ServerOption = None
) -> None:
    """Issue a new API key for a tenant; the old key stops working at once."""
    with open_admin(ctx, server) as admin:
        key = admin.rotate_api_key(tenant)
    print_data(key, as_json, lambda k: print_pairs([("tenant", f"{k['name']} ({k['id']})"), ("api key", k["api_key"])]))
