"""Options shared by the `chatkv` commands (`--json`, `--server`, `--tenant`, `--yes`)."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ServerOption = Annotated[
    str | None,
    typer.Option(
        "--server",
        show_default=False,
        help="Run through this server's admin API (as `chatkv --server URL ...`; given here, it wins).",
    ),
]
"""`--server` after the subcommand (`chatkv sessions list --server URL`), like the global one before it."""
TenantOption = Annotated[str, typer.Option("--tenant", "-t", help="Tenant name or id.")]

YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
