"""The `chatkv` command line: serve the UI, chat in the terminal, and operate a chatkv home.

Admin commands (`tenants`, `sessions`, `stats`, `keys`, `gc`) run through a server's admin API when
`--server URL` (or `CHATKV_SERVER`) is given, before the subcommand or after it, so an eviction
really frees the server's device; else they work on the home's database and stores directly, and
refuse while another process (a server, or one with a `SessionManager` open) holds the home.
Either way they print the same answers (`app.admin_ops`); every listing takes `--json`.

Exit codes: 0 success; 1 the operation failed (model, I/O, a server error) or a confirmation was
declined (`cancelled`); 2 bad input or not found. Every failure is one line on stderr.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup, TyperOption

from app.admin_client import AdminClient, AdminRequestFailed
from storage.home_lock import HomeLockedError, check_unlocked, describe_owner, read_owner, recovery_hint

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from app.admin_ops import AdminOps, Json
    from sessions.manager import SessionManager
    from sessions.records import Reply
    from sessions.settings import Settings

# `sessions`, `cache` and `app.admin_ops` import torch and transformers (seconds): they are imported
# where a command works on a home, so `--server` commands start as fast as an HTTP client.

ADMIN_TOKEN_FILE = "admin.token"  # written by `app.server.admin_token` on the server's first start
TIERS = ("device", "host", "disk")
EVICT_TARGETS = ("host", "disk", "drop")


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


class _Group(TyperGroup):
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


class _OneLineErrors(_Group):
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
        except HomeLockedError as exc:
            _fail(_held_for_admin(exc), 2)
        except AdminRequestFailed as exc:
            _fail(str(exc), 2 if exc.status < 500 else 1)
        except httpx.ConnectError as exc:
            _fail(f"the server cannot be reached: {exc}", 1)
        except httpx.HTTPError as exc:  # timeouts, dropped connections
            _fail(f"the request to the server failed: {exc}", 1)
        except UnicodeError:
            _fail("arguments must be valid UTF-8 text", 2)
        except OSError as exc:
            _fail(str(exc), 1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=False,
    help="chatkv: chat sessions that keep their KV cache, and the tools to operate them.",
)
tenants_app = typer.Typer(
    cls=_Group, no_args_is_help=True, help="Create, list, show, delete tenants; rotate their API keys."
)
sessions_app = typer.Typer(
    cls=_Group, no_args_is_help=True, help="List, inspect, evict, restore, delete and export sessions."
)
keys_app = typer.Typer(cls=_Group, no_args_is_help=True, help="Encryption keys.")
db_app = typer.Typer(cls=_Group, no_args_is_help=True, help="The metadata database's schema (Alembic migrations).")
app.add_typer(tenants_app, name="tenants")
app.add_typer(sessions_app, name="sessions")
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")


def main() -> None:
    """Console-script entry point (`chatkv`)."""
    app()


# -- global options and the two ways to reach a home ---------------------------------------------


@dataclass(frozen=True)
class _Target:
    home: Path | None
    server: str | None
    admin_token: str | None


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
    ctx.obj = _Target(home, server or None, admin_token or None)


def _settings(target: _Target, **overrides: Any) -> Settings:
    from sessions.settings import Settings

    try:
        return Settings.from_env(home=target.home, **overrides)
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None


@contextmanager
def _domain_errors() -> Iterator[None]:
    """Turn the errors of the layers below into `CLIError`s: bad input and unknown names exit 2,
    failures of the model, the key ring or the database exit 1."""
    from sqlalchemy.exc import OperationalError

    from sessions.errors import ChatKVError, ModelUnavailable
    from storage.keyring import BadMasterKey, KeyRingError

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
    except UnicodeError:  # an argument with bytes that are not UTF-8 (the shell passed them through)
        raise CLIError("arguments must be valid UTF-8 text", 2) from None
    except ValueError as exc:  # settings or a database URL that cannot work
        raise CLIError(str(exc), 2) from None


def _load_manager(settings: Settings) -> SessionManager:
    """A manager on `settings.home`; call inside `_domain_errors`."""
    from sessions.manager import SessionManager

    try:
        return SessionManager(settings)
    except ValueError as exc:  # documented: settings that cannot work with this model
        raise CLIError(str(exc), 2) from None


def _home(target: _Target) -> Path:
    """`--home`/`CHATKV_HOME`, else the default (importing `sessions` only then: it loads torch)."""
    if target.home is not None:
        return target.home.expanduser()
    from sessions.settings import default_home

    return default_home()


def _admin_token(target: _Target) -> str:
    if target.admin_token:
        return target.admin_token
    path = _home(target) / ADMIN_TOKEN_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise CLIError(f"no admin token: pass --admin-token, set CHATKV_ADMIN_TOKEN, or create {path}", 2) from None


@contextmanager
def _admin(ctx: typer.Context, server: str | None = None) -> Iterator[AdminOps | AdminClient]:
    """The server's admin API with `--server` (`server`: the command's own `--server`, which wins
    over the global one), else the home itself (unless another process holds it)."""
    target: _Target = ctx.obj
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
    check_unlocked(_home(target))  # refuse before loading anything
    settings = _settings(target)
    with _domain_errors():
        from app.admin_ops import AdminOps

        with AdminOps.open_home(settings, lambda: _load_manager(settings)) as ops:
            yield ops


# -- output ------------------------------------------------------------------------------------

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


def _print(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        render(data)


def _table(columns: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    cells = [["-" if value is None else str(value) for value in row] for row in rows]
    table = Table(title=title, title_justify="left", box=None)
    for column in columns:
        table.add_column(column, no_wrap=True)
    for row in cells:
        table.add_row(*row)
    # Wide enough that rich never truncates an id (operators copy them); a narrow terminal wraps lines.
    width = sum(max([len(c), *(len(r[i]) for r in cells)]) + 2 for i, c in enumerate(columns))
    Console(width=max(width, len(title or ""))).print(table)


def _pairs(pairs: Sequence[tuple[str, object]]) -> None:
    width = max(len(label) for label, _ in pairs)
    for label, value in pairs:
        typer.echo(f"{label:<{width}}  {'-' if value is None else value}")


def _duration_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _when(iso: str) -> str:
    return iso[:19].replace("T", " ")


def _count(n: int, noun: str) -> str:
    """`1 session`, `2 sessions`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _confirm(question: str, yes: bool) -> None:
    """Ask `question` unless `yes`; raises `Cancelled` when the answer is no."""
    if not yes and not typer.confirm(question):
        raise Cancelled()


YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


# -- serve and chat ----------------------------------------------------------------------------


@app.command("serve")
def serve_command(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 7860,
    local: Annotated[bool, typer.Option("--local", help="Single-tenant local mode: no API key asked.")] = False,
    model: Annotated[
        str | None, typer.Option(help="'default' (bundled SmolLM2-135M-Instruct) or a local model directory.")
    ] = None,
) -> None:
    """Serve the chat UI at /, the admin API under /admin/ and Prometheus metrics at /metrics.

    Runs until Ctrl-C or SIGTERM (exit code 0): turns in flight complete, caches are persisted so the
    next start resumes warm, and the home's lock is released.
    """
    from app.server import ListenError, bind_sockets, serve

    try:
        check_unlocked(_home(ctx.obj))  # before a manager touches stores that a live server owns
        # Before the model loads (seconds): a taken port fails at once. Held until uvicorn listens.
        sockets = bind_sockets(host, port)
    except HomeLockedError as exc:
        raise CLIError(_held_by_server(exc), 2) from None
    except ListenError as exc:
        raise CLIError(str(exc), 1) from None
    try:
        settings = _settings(ctx.obj, model=model)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("app").setLevel(logging.INFO)
        with _domain_errors():
            serve(_load_manager(settings), host=host, port=port, local=local, sockets=sockets)
    except HomeLockedError as exc:  # a server took the home while the model loaded
        raise CLIError(_held_by_server(exc), 2) from None
    except ListenError as exc:
        raise CLIError(str(exc), 1) from None
    finally:
        for sock in sockets:
            sock.close()


def _held_by_server(exc: HomeLockedError) -> str:
    return f"{exc.holder} holds this home; stop it or use another CHATKV_HOME ({exc.recovery})"


def _held_for_admin(exc: HomeLockedError) -> str:
    """An admin command refused a home: a server's admin API is the way in; an embedding process has none."""
    if exc.owner.url:
        advice = f"use --server {exc.owner.url} (or CHATKV_SERVER) to go through its admin API"
    else:
        advice = "stop it first, or serve the home with `chatkv serve` and use --server URL"
    return f"{exc.holder} holds this home; {advice} ({exc.recovery})"


@app.command("chat")
def chat_command(
    ctx: typer.Context,
    tenant: TenantOption,
    session: Annotated[str | None, typer.Option(help="Continue this session (default: start a new one).")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt of the new session.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per reply.")] = 256,
) -> None:
    """Chat in the terminal with a tenant's session; the model runs in this process.

    Replies stream as they are generated, followed by the turn's TTFT, prefilled and reused tokens
    and where the cache came from. Type /quit or press Ctrl-D to leave.
    """
    home = _home(ctx.obj)
    owner = read_owner(home)
    if owner is not None:
        where = f"chat in its UI at {owner.url}" if owner.url else "stop it first"
        raise CLIError(f"{describe_owner(owner)} holds this home: {where} ({recovery_hint(home, owner)})", 2)
    if session is not None and system is not None:
        raise CLIError("--system applies to a new session: omit --session", 2)
    settings = _settings(ctx.obj)
    with _domain_errors(), _load_manager(settings) as manager:
        tenant_id = manager.get_tenant(tenant).id
        if session is None:
            session = manager.open_session(tenant_id, system_prompt=system)
            typer.echo(f"session {session} (new)")
        else:
            info = manager.session_info(tenant_id, session)
            turns = _count(info.message_count // 2, "turn")
            typer.echo(f"session {session}: {turns}, cache {info.tier or 'not stored'}")
        _repl(manager, tenant_id, session, max_new_tokens)


def _repl(manager: SessionManager, tenant_id: str, session_id: str, max_new_tokens: int) -> None:
    from sessions.errors import ChatKVError

    while True:
        try:
            message = input("you> ").strip()
        except EOFError:
            typer.echo()
            return
        if message in ("/quit", "/exit"):
            return
        if not message:
            continue
        try:
            reply = _stream_turn(manager, tenant_id, session_id, message, max_new_tokens)
        except ChatKVError as exc:  # the REPL survives a rejected message (too long, busy session)
            typer.echo(f"error: {exc}", err=True)
            continue
        s = reply.stats
        typer.secho(
            f"ttft {s.ttft_s * 1000:.0f} ms | prefilled {s.prefill_tokens} | reused {s.reused_tokens} | "
            f"restored from {s.restored_from} | {s.decode_tokens} tokens in {s.decode_s:.2f} s",
            dim=True,
        )


def _stream_turn(manager: SessionManager, tenant_id: str, session_id: str, message: str, max_new_tokens: int) -> Reply:
    from sessions.records import Reply

    reply = None
    # Closed explicitly so that Ctrl-C mid-reply gives the session's lease back at once (nothing is stored).
    with closing(manager.stream_chat(tenant_id, session_id, message, max_new_tokens=max_new_tokens)) as stream:
        for item in stream:
            if isinstance(item, Reply):
                reply = item
            else:
                typer.echo(item, nl=False)
    typer.echo()
    if reply is None:
        raise RuntimeError("bug: stream_chat ended without a reply")
    return reply


# -- tenants -----------------------------------------------------------------------------------


@tenants_app.command("create")
def tenants_create(ctx: typer.Context, name: str, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """Create a tenant and print its API key (shown once; only a salted hash is kept)."""
    with _admin(ctx, server) as admin:
        tenant = admin.create_tenant(name)
    _print(
        tenant,
        as_json,
        lambda t: _pairs([("tenant", f"{t['name']} ({t['id']})"), ("api key", t["api_key"]), ("", "store it now")]),
    )


@tenants_app.command("list")
def tenants_list(ctx: typer.Context, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """List tenants with their session counts."""
    with _admin(ctx, server) as admin:
        tenants = admin.list_tenants()
    _print(
        tenants,
        as_json,
        lambda ts: _table(
            ("tenant", "id", "sessions", "api key", "created"),
            [
                (t["name"], t["id"], t["sessions"], "yes" if t["has_api_key"] else "no", _when(t["created_at"]))
                for t in ts
            ],
        ),
    )


@tenants_app.command("show")
def tenants_show(ctx: typer.Context, tenant: str, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """Show a tenant: sessions, tokens and sessions per tier."""
    with _admin(ctx, server) as admin:
        info = admin.show_tenant(tenant)
    per_tier = ", ".join(f"{tier} {n}" for tier, n in info["sessions_by_tier"].items())
    _print(
        info,
        as_json,
        lambda t: _pairs(
            [
                ("tenant", t["name"]),
                ("id", t["id"]),
                ("created", _when(t["created_at"])),
                ("sessions", t["sessions"]),
                ("tokens", t["tokens"]),
                ("caches", per_tier),
                ("api key", "issued" if t["has_api_key"] else "none"),
                ("master key id", t["master_key_id"]),
            ]
        ),
    )


@tenants_app.command("delete")
def tenants_delete(ctx: typer.Context, tenant: str, yes: YesOption = False, server: ServerOption = None) -> None:
    """Delete a tenant and everything of it, for good.

    Its data key is destroyed first (crypto-shredding), so a cache blob that survives anywhere
    cannot be decrypted; then its caches, files and rows go. Asks for confirmation unless --yes.
    """
    with _admin(ctx, server) as admin:
        info = admin.show_tenant(tenant)
        sessions = _count(info["sessions"], "session")
        _confirm(f"Delete tenant {info['name']} ({info['id']}) and its {sessions} for good?", yes)
        admin.delete_tenant(info["id"])
    typer.echo(f"deleted tenant {info['name']} ({info['id']})")


@tenants_app.command("rotate-api-key")
def tenants_rotate_api_key(
    ctx: typer.Context, tenant: str, as_json: JsonOption = False, server: ServerOption = None
) -> None:
    """Issue a new API key for a tenant; the old key stops working at once."""
    with _admin(ctx, server) as admin:
        key = admin.rotate_api_key(tenant)
    _print(key, as_json, lambda k: _pairs([("tenant", f"{k['name']} ({k['id']})"), ("api key", k["api_key"])]))


# -- sessions ----------------------------------------------------------------------------------


def _duration_s(text: str) -> float:
    from sessions.settings import parse_duration_s

    try:
        return parse_duration_s(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@sessions_app.command("list")
def sessions_list(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Only this tenant's sessions.")] = None,
    tier: Annotated[
        str | None, typer.Option(metavar="device|host|disk", help="Only sessions cached in this tier.")
    ] = None,
    idle_for: Annotated[
        float | None,
        typer.Option(
            parser=_duration_s, metavar="DURATION", help="Only sessions idle at least this long (90, 30m, 7d)."
        ),
    ] = None,
    as_json: JsonOption = False,
    server: ServerOption = None,
) -> None:
    """List sessions, most recently active first."""
    if tier is not None and tier not in TIERS:
        raise CLIError("--tier must be device, host or disk", 2)
    with _admin(ctx, server) as admin:
        sessions = admin.list_sessions(tenant=tenant, tier=tier, idle_for_s=idle_for)
    _print(
        sessions,
        as_json,
        lambda ss: _table(
            ("session", "tenant", "tier", "tokens", "messages", "last active", "title"),
            [
                (
                    s["id"],
                    s["tenant"],
                    s["tier"],
                    s["token_count"],
                    s["message_count"],
                    _when(s["last_active_at"]),
                    s["title"],
                )
                for s in ss
            ],
        ),
    )


def _render_inspect(detail: Json) -> None:
    s, t = detail["session"], detail["transcript"]
    ttft = detail["last_ttft_s"]
    _pairs(
        [
            ("session", f"{s['id']} (tenant {s['tenant']})"),
            ("title", s["title"]),
            ("tier", s["tier"] or "none (the next turn rebuilds the cache)"),
            ("turns", f"{t['turns']} ({_count(t['messages'], 'message')}, {_count(s['token_count'], 'token')})"),
            ("first message", t["first_user_message"]),
            ("last message", t["last_user_message"]),
            ("last reply", t["last_reply"]),
            ("fingerprint", detail["model_fingerprint"] + ("" if detail["model_fingerprint_matches"] else " (stale)")),
            ("last ttft", None if ttft is None else f"{ttft * 1000:.1f} ms"),
            ("cache bytes", detail["cache_bytes"]),
        ]
    )
    rows = [
        (
            layer["kind"],
            "prefix" if layer["turn_index"] is None else layer["turn_index"],
            layer["tokens"],
            f"[{layer['positions'][0]}, {layer['positions'][1]})",
            layer["precision"],
            "shared pool" if layer["shared"] else layer["tier"],
            layer["bytes"],
        )
        for layer in detail["layers"]
    ]
    _table(("layer", "turn", "tokens", "positions", "precision", "tier", "bytes"), rows, title="layers")


@sessions_app.command("inspect")
def sessions_inspect(
    ctx: typer.Context, session_id: str, tenant: TenantOption, as_json: JsonOption = False, server: ServerOption = None
) -> None:
    """Show a session: transcript summary, layer table, model fingerprint, last TTFT.

    The layer table has one row per layer: kind (base or turn), turn, tokens, RoPE positions (a
    half-open range: [0, 21) is positions 0 to 20), precision, tier and bytes (the layer's share of
    the cache by tokens). The system-prompt prefix lives in the tenant's shared prefix pool. A
    stored cache is decrypted to read its layers.
    """
    with _admin(ctx, server) as admin:
        detail = admin.inspect_session(tenant, session_id)
    _print(detail, as_json, _render_inspect)


@sessions_app.command("show")
def sessions_show(
    ctx: typer.Context, session_id: str, tenant: TenantOption, as_json: JsonOption = False, server: ServerOption = None
) -> None:
    """Alias of `sessions inspect`."""
    sessions_inspect(ctx, session_id, tenant, as_json, server)


@sessions_app.command("evict")
def sessions_evict(
    ctx: typer.Context,
    session_id: str,
    tenant: TenantOption,
    to: Annotated[str, typer.Option(metavar="host|disk|drop", help="Target tier, or drop the cache.")],
    server: ServerOption = None,
) -> None:
    """Move an idle session's cache down to host memory or disk, or drop it.

    A dropped cache is rebuilt from the transcript by the next turn. With --server this frees the
    server's device; without one, every stored cache is on disk already.
    """
    if to not in EVICT_TARGETS:
        raise CLIError("--to must be host, disk or drop", 2)
    with _admin(ctx, server) as admin:
        result = admin.evict_session(tenant, session_id, to)
    typer.echo(f"{session_id}: {'dropped' if to == 'drop' else result['tier']}")


@sessions_app.command("restore")
def sessions_restore(ctx: typer.Context, session_id: str, tenant: TenantOption, server: ServerOption = None) -> None:
    """Bring a session's cache up to the server's device ahead of its next turn.

    Needs --server: without a server no process keeps a cache on the device.
    """
    if not (server or ctx.obj.server):
        raise CLIError("sessions restore needs --server (or CHATKV_SERVER)", 2)
    with _admin(ctx, server) as admin:
        result = admin.restore_session(tenant, session_id)
    if result["tier"] is None:
        why = "the stored cache was unusable and was discarded" if result["rejected"] else "nothing stored"
        typer.echo(f"{session_id}: {why}; the next turn rebuilds it from the transcript")
        return
    source = result["restored_from"] or result["tier"]
    typer.echo(f"{session_id}: {result['tier']} (from {source}, {result['restore_s'] * 1000:.1f} ms)")


@sessions_app.command("delete")
def sessions_delete(
    ctx: typer.Context, session_id: str, tenant: TenantOption, yes: YesOption = False, server: ServerOption = None
) -> None:
    """Delete a session for good: transcript, caches in every tier and files. Asks for confirmation
    unless --yes."""
    with _admin(ctx, server) as admin:
        found = [s for s in admin.list_sessions(tenant=tenant) if s["id"] == session_id]
        if not found:
            raise CLIError(f"session not found: {session_id}", 2)
        session = found[0]
        title = f" ({session['title']})" if session["title"] else ""
        turns = _count(session["message_count"] // 2, "turn")
        _confirm(f"Delete session {session_id}{title} of tenant {session['tenant']}, {turns}, for good?", yes)
        admin.delete_session(tenant, session_id)
    typer.echo(f"deleted session {session_id}")


@sessions_app.command("export")
def sessions_export(ctx: typer.Context, session_id: str, tenant: TenantOption, server: ServerOption = None) -> None:
    """Print a session's transcript as JSON (every message with its exact token ids)."""
    with _admin(ctx, server) as admin:
        transcript = admin.export_session(tenant, session_id)
    _print(transcript, True, print)


# -- operations --------------------------------------------------------------------------------


def _render_stats(stats: Json) -> None:
    rows = [
        (tier, t["sessions"], t["bytes"], t["budget_bytes"], f"{t['budget_used']:.1%}")
        for tier, t in stats["tiers"].items()
    ]
    _table(("tier", "sessions", "bytes", "budget", "used"), rows)
    if not stats.get("live", True):  # offline: tiers as stored, no turn counters
        _pairs([("tenants", stats["tenants"]), ("sessions", stats["sessions"]), ("model", stats["model"])])
        typer.echo(f"note: {stats['note']}")
        return
    evictions = ", ".join(f"{move} {int(n)}" for move, n in stats["evictions"].items()) or "none"
    _pairs(
        [
            ("tenants", stats["tenants"]),
            ("sessions", stats["sessions"]),
            ("cache hit rate", f"{stats['cache_hit_rate_tokens']:.1%} of prompt tokens"),
            ("prefill tokens", f"{int(stats['prefill_tokens'])} run, {int(stats['prefill_tokens_saved'])} saved"),
            ("evictions", evictions),
            ("integrity failures", int(stats["integrity_failures"])),
            ("model", f"{stats['model']} ({stats['model_fingerprint']})"),
        ]
    )


@app.command("stats")
def stats_command(ctx: typer.Context, as_json: JsonOption = False, server: ServerOption = None) -> None:
    """Sessions and bytes per tier, budgets used, cache hit rate, prefill tokens saved, evictions.

    With --server: the running server's tiers, and its turn counters (hit rate, prefill tokens,
    evictions) since it started. Without: the tiers as stored in the home (every cache on disk),
    without turn counters, and without loading the model.
    """
    with _admin(ctx, server) as admin:
        stats = admin.stats()
    _print(stats, as_json, _render_stats)


@keys_app.command("rotate-master")
def keys_rotate_master(
    ctx: typer.Context,
    new_key: Annotated[
        str | None,
        typer.Option(help="Base64 of 32 bytes; generated (into HOME/master.key) when omitted.", show_default=False),
    ] = None,
    server: ServerOption = None,
) -> None:
    """Re-wrap every tenant's data key under a new master key; cache blobs are not rewritten."""
    with _admin(ctx, server) as admin:
        result = admin.rotate_master_key(new_key)
    typer.echo(f"master key rotated: new key id {result['master_key_id']}")
    if result["from_env"]:
        typer.echo("set CHATKV_MASTER_KEY to the new key before the next start")


@app.command("gc")
def gc_command(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
    as_json: JsonOption = False,
    server: ServerOption = None,
) -> None:
    """Delete sessions idle longer than the retention (CHATKV_SESSION_RETENTION_S, e.g. 30d).

    The retention is the server's with --server, else this environment's. Disk orphans (crash
    leftovers, files without a row, blobs of another model) are removed whenever a manager starts:
    by the server at its start, or by this command without --server (unless --dry-run).
    """
    with _admin(ctx, server) as admin:
        report = admin.gc(dry_run=dry_run)
    _print(report, as_json, _render_gc)


def _render_gc(report: Json) -> None:
    if report["retention_s"] is None:
        typer.echo("no retention set (CHATKV_SESSION_RETENTION_S, e.g. 30d): sessions are kept")
        return
    verb = "would remove" if report["dry_run"] else "removed"
    expired = report["expired_sessions"]
    sessions = _count(len(expired), "session")
    typer.echo(f"{verb} {sessions} idle longer than {_duration_text(report['retention_s'])}")
    for s in expired:
        typer.echo(f"  {s['id']}  tenant {s['tenant']}  last active {_when(s['last_active_at'])}")


@contextmanager
def _database(settings: Settings) -> Iterator[Engine]:
    from storage.database import make_engine

    try:
        engine = make_engine(settings.resolved_database_url)
    except ValueError as exc:  # not a database URL
        raise CLIError(f"CHATKV_DATABASE_URL: {exc}", 2) from None
    try:
        with _domain_errors():
            yield engine
    finally:
        engine.dispose()


@db_app.command("upgrade")
def db_upgrade(ctx: typer.Context) -> None:
    """Apply every pending migration to the database."""
    from storage.database import current_revision, upgrade

    check_unlocked(_home(ctx.obj))
    settings = _settings(ctx.obj)
    with _database(settings) as engine:
        upgrade(settings.resolved_database_url, engine)
        typer.echo(f"database at revision {current_revision(engine)} (head)")


@db_app.command("current")
def db_current(ctx: typer.Context) -> None:
    """Print the database's migration revision and the newest one."""
    from storage.database import current_revision, head_revision

    with _database(_settings(ctx.obj)) as engine:
        current, head = current_revision(engine), head_revision()
    if current == head:
        typer.echo(f"{current} (head)")
    else:
        typer.echo(f"{current or 'empty'} (head is {head}: run `chatkv db upgrade`)")
