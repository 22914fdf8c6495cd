"""The two ways a `chatkv` command reaches a home: through a server's admin API (`--server`), or
on the home's database and stores directly (refused while another process holds the home)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from app.cli.admin_client import AdminClient
from app.cli.groups import CLIError
from storage.home_lock import check_unlocked

if TYPE_CHECKING:
    from sessions.admin import AdminOps
    from sessions.manager import SessionManager
    from sessions.settings import Settings

# `sessions` and `cache` import torch and transformers (seconds): they are imported
# where a command works on a home, so `--server` commands start as fast as an HTTP client.

ADMIN_TOKEN_FILE = "admin.token"  # written by `app.http.server.admin_token` on the server's first start


@dataclass(frozen=True)
class Target:
    """Where the global options point: `--home`, `--server` and `--admin-token` (each `None` when not given)."""

    home: Path | None
    server: str | None
    admin_token: str | None


def settings_for(target: Target, **overrides: Any) -> Settings:
    """`Settings` from the environment for `target`'s home; raises `CLIError` (exit 2) for settings that cannot work."""
    from sessions.settings import Settings

    try:
        return Settings.from_env(home=target.home, **overrides)
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None


@contextmanager
def domain_errors() -> Iterator[None]:
    """Turn the errors of the layers below into `CLIError`s: bad input and unknown names exit 2,
    failures of the model, the key ring or the database exit 1."""
    from sqlalchemy.exc import OperationalError

    from sessions.errors import ChatKVError, ModelUnavailable
    from storage.keyring import BadMasterKey, KeyRingError
    from storage.redis_store import RedisUnavailable
    from storage.replica_store import ReplicaIdInUse

    try:
        yield
    except ModelUnavailable as exc:
        raise CLIError(str(exc), 1) from None
    except ChatKVError as exc:
        raise CLIError(str(exc), 2) from None
    except BadMasterKey as exc:
        raise CLIError(f"master key: {exc}", 2) from None
    except KeyRingError as exc:
        raise CLIError(f"key ring: {exc}", 1) from None
    except OperationalError as exc:
        raise CLIError(f"database: {exc.orig}", 1) from None
    except RedisUnavailable as exc:  # a Redis Cluster must answer at start-up (its slot map)
        raise CLIError(f"redis: {exc}", 1) from None
    except ReplicaIdInUse as exc:
        raise CLIError(str(exc), 2) from None
    except UnicodeError:  # an argument with bytes that are not UTF-8 (the shell passed them through)
        raise CLIError("arguments must be valid UTF-8 text", 2) from None
    except ValueError as exc:  # settings or a database URL that cannot work
        raise CLIError(str(exc), 2) from None


def load_manager(settings: Settings) -> SessionManager:
    """A manager on `settings.home`; call inside `domain_errors`."""
    from sessions.manager import SessionManager

    try:
        return SessionManager(settings)
    except ValueError as exc:  # documented: settings that cannot work with this model
        raise CLIError(str(exc), 2) from None


def home_dir(target: Target) -> Path:
    """`--home`/`CHATKV_HOME`, else the default (importing `sessions` only then: it loads torch)."""
    if target.home is not None:
        return target.home.expanduser()
    from sessions.settings import default_home

    return default_home()


def _admin_token(target: Target) -> str:
    if target.admin_token:
        return target.admin_token
    path = home_dir(target) / ADMIN_TOKEN_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise CLIError(f"no admin token: pass --admin-token, set CHATKV_ADMIN_TOKEN, or create {path}", 2) from None


@contextmanager
def open_admin(ctx: typer.Context, server: str | None = None) -> Iterator[AdminOps | AdminClient]:
    """The server's admin API with `--server` (`server`: the command's own `--server`, which wins
    over the global one), else the home itself (unless another process holds it)."""
    target: Target = ctx.obj
    if server:
        target = replace(target, server=server)
    if target.server:
        try:
            client = AdminClient.connect(target.server, _admin_token(target))
        except ValueError as exc:
            raise CLIError(str(exc), 2) from None
        with client:
            yield client
        return
    check_unlocked(home_dir(target))  # refuse before loading anything
    settings = settings_for(target)
    with domain_errors():
        from sessions.admin import AdminOps

        with AdminOps.open_home(settings, lambda: load_manager(settings)) as ops:
            yield ops
