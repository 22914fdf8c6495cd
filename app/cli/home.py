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
from sessions import ADMIN_TOKEN_FILE, check_unlocked

if TYPE_CHECKING:
    from sessions import AdminOps, Services, Settings

# `SessionManager` imports torch and transformers (seconds): it is imported where a command works
# on a home, so `--server` commands start as fast as an HTTP client.


@dataclass(frozen=True)
class Target:
    """Where the global options point: `--home`, `--server` and `--admin-token` (each `None` when not given)."""

    home: Path | None
    server: str | None
    admin_token: str | None


def settings_for(target: Target, **overrides: Any) -> Settings:
    """`Settings` from the environment for `target`'s home; raises `CLIError` (exit 2) for settings that cannot work."""
    from sessions import Settings

    try:
        return Settings.from_env(home=target.home, **overrides)
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None


@contextmanager
def domain_errors() -> Iterator[None]:
    """Turn the errors of the layers below into `CLIError`s: bad input and unknown names exit 2,
    failures of the model, the key ring or the database exit 1."""
    from sqlalchemy.exc import OperationalError

    from sessions import BackendUnavailable, ChatKVError, ModelNotFound, ModelUnavailable, UnsupportedModel

    try:
        yield
    except (ModelNotFound, UnsupportedModel) as exc:  # a --model value that names nothing reachable or usable
        raise CLIError(str(exc), 2) from None
    except (ModelUnavailable, BackendUnavailable) as exc:  # the key ring, a Redis Cluster
        raise CLIError(str(exc), 1) from None
    except ChatKVError as exc:  # `InvalidSettings` among them: a bad master key, a replica id in use
        raise CLIError(str(exc), 2) from None
    except OperationalError as exc:
        raise CLIError(f"database: {exc.orig}", 1) from None
    except UnicodeError:  # an argument with bytes that are not UTF-8 (the shell passed them through)
        raise CLIError("arguments must be valid UTF-8 text", 2) from None
    except ValueError as exc:  # settings or a database URL that cannot work
        raise CLIError(str(exc), 2) from None


def load_services(settings: Settings) -> Services:
    """A manager on `settings.home` with the services beside it; call inside `domain_errors`."""
    from sessions import open_services

    try:
        return open_services(settings)
    except ValueError as exc:  # documented: settings that cannot work with this model
        raise CLIError(str(exc), 2) from None


def home_dir(target: Target) -> Path:
    """`--home`/`CHATKV_HOME`, else the default (importing `sessions` only then: it loads torch)."""
    if target.home is not None:
        return target.home.expanduser()
    from sessions import default_home

    return default_home()


def _admin_token(target: Target) -> str:
    if target.admin_token:
        return target.admin_token
    path = home_dir(target) / ADMIN_TOKEN_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise CLIError(
            f"no admin token in {path}: is the server running on another home? Set CHATKV_HOME to the "
            "home its start-up log names, or pass --admin-token / set CHATKV_ADMIN_TOKEN",
            2,
        ) from None


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
        from sessions import AdminOps

        with AdminOps.open_home(settings, lambda: load_services(settings).manager) as ops:
            yield ops
