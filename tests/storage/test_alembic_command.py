"""Plain `alembic` from a shell in the repository: it migrates the database the chatkv settings
name (`CHATKV_DATABASE_URL`, else SQLite in the chatkv home), although `storage/` reads that URL
from the environment itself instead of importing `sessions.settings`."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from sessions.settings import Settings
from storage.database import database_url_from_env, head_revision
from tests.conftest import REPO


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"CHATKV_HOME": "/srv/chatkv"},
        {"CHATKV_HOME": "~/chatkv-home"},
        {"CHATKV_HOME": ""},
        {"CHATKV_HOME": "/srv/chatkv", "CHATKV_DATABASE_URL": "postgresql+psycopg://db.internal/chatkv"},
        {"CHATKV_DATABASE_URL": "sqlite:////var/lib/chatkv/other.db"},
        {"CHATKV_HOME": "/srv/chatkv", "CHATKV_DATABASE_URL": ""},
    ],
)
def test_the_url_from_the_environment_is_the_one_the_settings_resolve(environ: dict[str, str]) -> None:
    assert database_url_from_env(environ) == Settings.from_env(environ).resolved_database_url


def test_alembic_upgrade_head_from_the_repository_migrates_the_homes_database(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "CHATKV_DATABASE_URL"}
    environ.update(CHATKV_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with closing(sqlite3.connect(tmp_path / "home" / "chatkv.db")) as connection:
        assert connection.execute("SELECT version_num FROM alembic_version").fetchall() == [(head_revision(),)]
