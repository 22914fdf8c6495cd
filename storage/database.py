"""Opening the database (a SQLAlchemy `Engine`: its connection pool) and schema migrations (Alembic,
run programmatically).

SQLite gets WAL journaling (readers do not block the writer) and enforced foreign keys;
PostgreSQL works unchanged; other databases are refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import platformdirs
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
MIGRATION_LOCK_ID = 0x63686174_6B76
"""PostgreSQL advisory lock key that serialises migrations of replicas sharing one database."""
ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"


class Repository:
    """Base of the stores over one SQLAlchemy database: each method is one unit of work.

    Args:
        database: the SQLAlchemy engine of the database (`open_database`).
    """

    def __init__(self, database: Engine) -> None:
        self.database = database
        self._sessionmaker = sessionmaker(database, expire_on_commit=False)

    @contextmanager
    def _unit(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self._sessionmaker.begin() as session:
            yield session


def open_database(url: str) -> Engine:
    """The SQLAlchemy engine (connection pool) of the database at `url`; for SQLite, creates the
    parent folder and turns on WAL and foreign keys.

    Raises:
        ValueError: if `url` is not a valid SQLAlchemy URL, or names neither SQLite nor PostgreSQL.
    """
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(f"not a database URL: {url!r}") from exc
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        # The blob rows are written with an upsert, which SQLAlchemy spells per dialect.
        raise ValueError(f"chatkv's database is SQLite or PostgreSQL, not {parsed.get_backend_name()}: {url!r}")
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            path = Path(parsed.database).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            # Transcripts are plain text: the file (and the -wal/-shm files SQLite creates with the
            # same mode) is readable by the owner only, whatever the umask.
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            path.chmod(0o600)
        engine = create_engine(parsed, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    try:
        return create_engine(parsed, pool_pre_ping=True)
    except ImportError as exc:  # the URL names a backend whose driver is not installed
        raise ValueError(
            f"no database driver for {parsed.drivername!r} installed ({exc}): chatkv uses PostgreSQL "
            "through psycopg 3, a `postgresql+psycopg://` URL with the `postgres` extra installed "
            "(pip install -e '.[postgres]')"
        ) from exc


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    # Deleted rows (a destroyed tenant's wrapped data key) are overwritten, not just unlinked.
    cursor.execute("PRAGMA secure_delete=ON")
    cursor.close()


def secure_erase_freed_pages(engine: Engine) -> bool:
    """After deleting secrets: on SQLite, checkpoint and truncate the WAL so no old page holding
    them survives in `-wal` (`secure_delete` already zeroes freed pages in the main file, and the
    checkpoint copies the zeroed pages there). The checkpoint waits (up to the connection's busy
    timeout) for readers of older snapshots to finish. Returns `False` if it could not finish
    (readers kept it busy: the WAL still holds old pages until the next checkpoint); a warning is
    logged then. Other backends keep dead tuples until VACUUM; that is their operator's concern."""
    if engine.dialect.name != "sqlite":
        return True
    with engine.connect() as connection:
        busy, _, _ = connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
    if busy:
        log.warning("the write-ahead log could not be truncated (readers kept it busy); it is at the next checkpoint")
    return not busy


def database_url_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """The database URL that plain `alembic` (run from a shell in the repository) migrates:
    `CHATKV_DATABASE_URL`, else SQLite at `chatkv.db` in the chatkv home (`CHATKV_HOME`, else the
    per-user data directory). The same URL `sessions.settings.Settings` resolves from the same
    environment; it is spelled out here because `storage/` does not import `sessions/`, and a
    test keeps the two in step."""
    url = environ.get("CHATKV_DATABASE_URL")
    if url:
        return url
    home = environ.get("CHATKV_HOME")
    home_path = Path(home) if home else Path(platformdirs.user_data_dir("chatkv", appauthor=False))
    return f"sqlite:///{home_path.expanduser() / 'chatkv.db'}"


def alembic_config(url: str) -> Config:
    """Alembic configuration pointing at the packaged migrations, for `url`."""
    config = Config(str(ALEMBIC_INI)) if ALEMBIC_INI.is_file() else Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["configure_logger"] = False
    return config


def upgrade(url: str, engine: Engine | None = None) -> None:
    """Apply every pending migration (`chatkv db upgrade`; also run at start-up)."""
    config = alembic_config(url)
    if engine is None:
        engine = open_database(url)
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            # Replicas starting together would otherwise race to create the same tables; the lock
            # is held until this transaction commits, so the second one finds the schema current.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})")
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def current_revision(engine: Engine) -> str | None:
    """The database's migration revision, or `None` for an empty database."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
