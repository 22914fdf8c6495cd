"""`chatkv db ...`: the metadata database's schema (Alembic migrations)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

from app.cli.groups import CLIError, CommandGroup
from app.cli.home import domain_errors, home_dir, settings_for
from sessions import check_unlocked

if TYPE_CHECKING:
    import sqlalchemy

    from sessions import Settings

db_app = typer.Typer(
    cls=CommandGroup, no_args_is_help=True, help="The metadata database's schema (Alembic migrations)."
)


@contextmanager
def _database(settings: Settings) -> Iterator[sqlalchemy.Engine]:
    from sessions import open_database

    try:
        database = open_database(settings.resolved_database_url)
    except ValueError as exc:  # not a database URL
        raise CLIError(f"CHATKV_DATABASE_URL: {exc}", 2) from None
    try:
        with domain_errors():
            yield database
    finally:
        database.dispose()


@db_app.command("upgrade")
def db_upgrade(ctx: typer.Context) -> None:
    """Apply every pending migration to the database."""
    from sessions import database_revision, upgrade_database

    check_unlocked(home_dir(ctx.obj))
    settings = settings_for(ctx.obj)
    with _database(settings) as database:
        upgrade_database(settings.resolved_database_url, database)
        typer.echo(f"database at revision {database_revision(database)} (head)")


@db_app.command("current")
def db_current(ctx: typer.Context) -> None:
    """Print the database's migration revision and the newest one."""
    from sessions import database_revision, head_revision

    with _database(settings_for(ctx.obj)) as database:
        current, head = database_revision(database), head_revision()
    if current == head:
        typer.echo(f"{current} (head)")
    else:
        typer.echo(f"{current or 'empty'} (head is {head}: run `chatkv db upgrade`)")
