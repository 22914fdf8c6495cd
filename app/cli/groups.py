"""The Click groups behind the `chatkv` command line: help that reads well, and every failure as
one line on stderr with the exit codes listed in `app.cli`."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import httpx
import typer
from typer.core import TyperGroup, TyperOption

from app.cli.admin_client import AdminRequestFailed
from sessions import HomeLocked


class CLIError(Exception):
    """A failure to report as one line with `exit_code` (1: operation failed, 2: bad input)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Cancelled(Exception):
    """The user declined a confirmation prompt (exit code 1, `cancelled` on stderr)."""


def _fail(message: str, exit_code: int) -> None:
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    sys.exit(exit_code)


def _unwrap(text: str | None) -> str | None:
    """Help text with each paragraph on one line, so the terminal wraps it (Typer keeps the source
    line breaks of every paragraph after the first, which breaks sentences on narrow terminals)."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _no_flag_values(params: list[Any]) -> list[Any]:
    """Show no value placeholder (Typer's `<bool>`) after a flag such as `--json` in help."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class CommandGroup(TyperGroup):
    """A command group whose help, and its commands' help, reads well: paragraphs unwrapped (see
    `_unwrap`) and no value shown after flags."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            command.help = _unwrap(command.help)
            _no_flag_values(command.get_params(ctx))  # also creates the command's cached --help option
        return command

    def get_params(self, ctx: Any) -> Any:
        return _no_flag_values(super().get_params(ctx))


class OneLineErrorsGroup(CommandGroup):
    """Turns usage errors and the errors of the layers below into one line on stderr and an exit
    code, instead of Click's usage block or a traceback. Unexpected exceptions (bugs) still raise."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except typer.TyperException as exc:  # Click's usage errors: bad flags and values (exit 2)
            if not exc.format_message():  # a group run without a command: Typer printed its help
                sys.exit(exc.exit_code)
            _fail(exc.format_message(), exc.exit_code)
        except (typer.Abort, Cancelled):  # a declined prompt, Ctrl-C or end of input at one
            typer.echo("cancelled", err=True)
            sys.exit(1)
        except CLIError as exc:
            _fail(str(exc), exc.exit_code)
        except HomeLocked as exc:
            _fail(held_for_admin(exc), 2)
        except AdminRequestFailed as exc:
            _fail(str(exc), 2 if exc.status < 500 else 1)
        except httpx.ConnectError as exc:
            _fail(f"the server{_at(exc)} cannot be reached: {exc}", 1)
        except httpx.HTTPError as exc:  # timeouts, dropped connections
            _fail(f"the request to the server failed: {exc}", 1)
        except UnicodeError:
            _fail("arguments must be valid UTF-8 text", 2)
        except OSError as exc:
            _fail(str(exc), 1)
        sys.exit(code if isinstance(code, int) else 0)


def _at(exc: httpx.RequestError) -> str:
    """` at http://host:port` for the request that failed (`--server`, CHATKV_SERVER), else ``."""
    try:
        url = exc.request.url
    except RuntimeError:  # an error raised outside a request carries none
        return ""
    return f" at {url.scheme}://{url.netloc.decode()}"


def held_by_server(exc: HomeLocked) -> str:
    return f"{exc.holder} holds this home; stop it or use another CHATKV_HOME ({exc.recovery})"


def held_for_admin(exc: HomeLocked) -> str:
    """An admin command refused a home: a server's admin API is the way in; an embedding process has none."""
    if exc.url:
        advice = f"use --server {exc.url} (or CHATKV_SERVER) to go through its admin API"
    else:
        advice = "stop it first, or serve the home with `chatkv serve` and use --server URL"
    return f"{exc.holder} holds this home; {advice} ({exc.recovery})"
