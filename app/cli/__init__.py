"""The `chatkv` command line: serve the UI, chat in the terminal, and operate a chatkv home.

Admin commands (`tenants`, `sessions`, `stats`, `keys`, `gc`) run through a server's admin API when
`--server URL` (or `CHATKV_SERVER`) is given, before the subcommand or after it, so an eviction
really frees the server's device; else they work on the home's database and stores directly, and
refuse while another process (a server, or one with a `SessionManager` open) holds the home.
Either way they print the same answers (`sessions.admin`); every listing takes `--json`.

Exit codes: 0 success; 1 the operation failed (model, I/O, a server error) or a confirmation was
declined (`cancelled`); 2 bad input or not found. Every failure is one line on stderr.

Where things live: this module is the table of contents (the root app, its global options, and every
command and command group registered in the order `--help` lists them). Each top-level command or
group has its own module (`app.cli.serve`, `app.cli.chat`, `app.cli.ops`, `app.cli.tenants`,
`app.cli.sessions`, `app.cli.keys`, `app.cli.db`): a new group such as `chatkv replicas` gets an
`app/cli/replicas.py` with its `typer.Typer(cls=CommandGroup)` and is added below; a new line in
`sessions inspect` goes in `app.cli.sessions._render_inspect`. Shared parts: `app.cli.groups` (help
formatting, one-line errors and exit codes), `app.cli.home` (reaching a home directly or through
`--server`), `app.cli.options` (`--json`, `--server`, `--tenant`, `--yes`) and `app.cli.output`
(tables, JSON, pairs, prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.chat import chat_command
from app.cli.db import db_app
from app.cli.groups import OneLineErrorsGroup
from app.cli.home import Target
from app.cli.keys import keys_app
from app.cli.ops import gc_command, stats_command
from app.cli.replicas import replicas_app
from app.cli.serve import serve_command
from app.cli.sessions import sessions_app
from app.cli.tenants import tenants_app

__all__ = ["app", "main"]

app = typer.Typer(
    cls=OneLineErrorsGroup,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=False,
    help="chatkv: chat sessions that keep their KV cache, and the tools to operate them.",
)
app.command("serve")(serve_command)
app.command("chat")(chat_command)
app.command("stats")(stats_command)
app.command("gc")(gc_command)
app.add_typer(replicas_app, name="replicas")
app.add_typer(tenants_app, name="tenants")
app.add_typer(sessions_app, name="sessions")
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")


def main() -> None:
    """Console-script entry point (`chatkv`)."""
    app()


@app.callback()
def _options(
    ctx: typer.Context,
    home: Annotated[
        Path | None,
        typer.Option(
            envvar="CHATKV_HOME", show_default=False, help="The chatkv home (default: the per-user data directory)."
        ),
    ] = None,
    server: Annotated[
        str | None,
        typer.Option(envvar="CHATKV_SERVER", help="Run admin commands through this server's admin API."),
    ] = None,
    admin_token: Annotated[
        str | None,
        typer.Option(
            envvar="CHATKV_ADMIN_TOKEN",
            show_default=False,
            help="Admin token for --server (default: read from HOME/admin.token).",
        ),
    ] = None,
) -> None:
    ctx.obj = Target(home, server or None, admin_token or None)
