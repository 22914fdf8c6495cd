"""Alembic environment: models and URL from chatkv, so autogenerate compares against the models.

The URL is the Alembic config's `sqlalchemy.url` (`storage.database.upgrade` sets it, and hands
over its connection); plain `alembic` from a shell falls back to the environment
(`storage.database.database_url_from_env`).
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from storage.database import database_url_from_env, open_database
from storage.schema import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name)

target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    return database_url_from_env()  # only when run as plain `alembic` from a shell


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(
            connection=connection, target_metadata=target_metadata, compare_type=True, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = open_database(_url())
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, compare_type=True, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
