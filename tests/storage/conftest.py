"""Database fixtures of the storage tests: every test that takes `db_url` runs on a fresh SQLite file
and, when `CHATKV_TEST_POSTGRES_URL` names a server that answers, on a fresh PostgreSQL schema.

PostgreSQL runs get a schema of their own (`ckv_test_<random>`, reached through `search_path` in
the URL's `options`), dropped afterwards, so concurrent runs on one server never see each other's
tables.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from storage.database import open_database, upgrade
from storage.metadata_store import MetadataStore

POSTGRES_ENV = "CHATKV_TEST_POSTGRES_URL"


def _postgres_admin_url() -> str:
    """The server URL, or skip with the reason shown in the `-ra` summary."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(f"PostgreSQL run skipped: {POSTGRES_ENV} is not set")
    return url


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[Engine]:
    """An engine on the test server (session-scoped); skips when the server does not answer."""
    engine = create_engine(_postgres_admin_url(), pool_pre_ping=True, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        engine.dispose()
        pytest.skip(
            f"PostgreSQL run skipped: the server in {POSTGRES_ENV} does not answer ({str(exc.orig).splitlines()[0]})"
        )
    yield engine
    engine.dispose()


def fresh_schema(admin: Engine) -> Iterator[str]:
    """The URL of a fresh PostgreSQL schema that the processes of one test share, dropped after."""
    schema = f"ckv_rep_{secrets.token_hex(6)}"
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield _with_search_path(str(admin.url.render_as_string(hide_password=False)), schema)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


def _with_search_path(url: str, schema: str) -> str:
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}options={quote(f'-csearch_path={schema}')}"


@pytest.fixture
def postgres_url(postgres_admin: Engine) -> Iterator[str]:
    """The URL of a fresh, empty schema on the test server, dropped after the test."""
    yield from fresh_schema(postgres_admin)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty database: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db' / 'chatkv.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def db_engine(db_url: str) -> Iterator[Engine]:
    """An engine on `db_url` with every migration applied."""
    engine = open_database(db_url)
    upgrade(db_url, engine)
    yield engine
    engine.dispose()


@pytest.fixture
def metadata(db_engine: Engine) -> MetadataStore:
    return MetadataStore(db_engine)


def add_session(metadata: MetadataStore, tenant_id: str, session_id: str, fingerprint: str = "fp-a") -> None:
    """A tenant (created if absent) with one empty session: the rows cache blobs hang off."""
    if metadata.get_tenant(tenant_id=tenant_id) is None:
        metadata.create_tenant(tenant_id=tenant_id, name=f"name-{tenant_id}")
    metadata.create_session(
        tenant_id=tenant_id, session_id=session_id, title=None, system_prompt=None, model_fingerprint=fingerprint
    )


@dataclass(frozen=True)
class Key:
    """A blob store key (`cache.tiers.CacheKey`'s shape) for the store tests."""

    tenant_id: str
    name: str


S1, S2, BASE = Key("tn_a", "s_1"), Key("tn_a", "s_2"), Key("tn_a", "base-0123abcd")
OTHER = Key("tn_b", "s_3")


@pytest.fixture
def rows(metadata: MetadataStore) -> MetadataStore:
    """The metadata store with tenants `tn_a` (sessions s_1, s_2) and `tn_b` (s_3)."""
    add_session(metadata, "tn_a", "s_1")
    add_session(metadata, "tn_a", "s_2")
    add_session(metadata, "tn_b", "s_3")
    return metadata
