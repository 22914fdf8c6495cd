"""`chatkv keys ...`: the encryption keys."""

from __future__ import annotations

from typing import Annotated

import typer

from app.cli.groups import CommandGroup
from app.cli.home import open_admin
from app.cli.options import ServerOption

keys_app = typer.Typer(cls=CommandGroup, no_args_is_help=True, help="Encryption keys.")


@keys_app.command("rotate-master")
def keys_rotate_master(
    ctx: typer.Context,
    new_key: Annotated[
        str | None,
        typer.Option(help="Base64 of 32 bytes; generated (into HOME/master.key) when omitted.", show_default=False),
    ] = None,
    server: ServerOption = None,
) -> None:
    """Re-wrap every tenant's data key under a new master key; cache blobs are not rewritten."""
    with open_admin(ctx, server) as admin:
        result = admin.rotate_master_key(new_key)
    typer.echo(f"master key rotated: new key id {result['master_key_id']}")
    if result["from_env"]:
        typer.echo("set CHATKV_MASTER_KEY to the new key before the next start")
