"""`chatkv chat`: a terminal REPL on one tenant's session, with the model in this process."""

from __future__ import annotations

import io
import sys
from contextlib import closing
from typing import TYPE_CHECKING, Annotated

import typer

from app.cli.groups import CLIError
from app.cli.home import domain_errors, home_dir, load_services, settings_for
from app.cli.options import TenantOption
from app.cli.output import count
from sessions import MAX_MESSAGE_CHARS, check_text, describe_owner, read_owner, recovery_hint

if TYPE_CHECKING:
    from sessions import PlannedTurn, Reply, SessionManager, TurnStats


def chat_command(
    ctx: typer.Context,
    tenant: TenantOption,
    session: Annotated[str | None, typer.Option(help="Continue this session (id or name; default: a new one).")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt of the new session.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per reply.")] = 256,
) -> None:
    """Chat in the terminal with a tenant's session; the model runs in this process.

    Replies stream as they are generated, followed by the turn's TTFT, prefilled and reused tokens
    and where the cache came from (new session, device, host, disk, Redis, or rebuilt from the
    transcript). Without --session the first message starts a new session, kept once its reply is
    stored: leaving before that leaves nothing behind. Type /quit or press Ctrl-D to leave.

    While `chatkv serve` holds the home this command is refused (the server's process owns the
    model and the sessions): chat in its web UI or through its HTTP API instead.
    """
    home = home_dir(ctx.obj)
    owner = read_owner(home)
    if owner is not None:
        where = f"chat in its UI at {owner.url}" if owner.url else "stop it first"
        raise CLIError(f"{describe_owner(owner)} holds this home: {where} ({recovery_hint(home, owner)})", 2)
    if session is not None and system is not None:
        raise CLIError("--system applies to a new session: omit --session", 2)
    with domain_errors():
        # Checked before the model loads, as the new session would at the first message: refused
        # there, every message would be refused in turn for the same --system (bytes that are not
        # UTF-8 reach Python as lone surrogates).
        if system is not None:
            check_text(system, "--system", MAX_MESSAGE_CHARS)
    settings = settings_for(ctx.obj)
    with domain_errors(), load_services(settings).manager as manager:
        tenant_id = manager.get_tenant(tenant).id
        if session is None:
            typer.echo("new session: your first message starts it")
        else:
            info = manager.session_info(tenant_id, session)
            turns = count(info.message_count // 2, "turn")
            typer.echo(f"session {session}: {turns}, cache {info.tier or 'not stored'}")
        _repl(manager, tenant_id, session, system, max_new_tokens)


def _repl(
    manager: SessionManager, tenant_id: str, session: str | None, system: str | None, max_new_tokens: int
) -> None:
    """Read messages until /quit or end of input. Without `session` the first message's turn makes
    a new session (it is kept only if that turn completes) and the others continue it."""
    from sessions import ChatKVError, ContextTooLong, TurnOptions, TurnTarget

    options = TurnOptions(max_new_tokens=max_new_tokens)
    if isinstance(sys.stdin, io.TextIOWrapper):
        # Typed bytes that are not UTF-8 become lone surrogates, so that message is refused and
        # the REPL goes on (as in Python's UTF-8 mode); strict decoding (a UTF-8 locale) ended
        # the command, blaming its arguments.
        sys.stdin.reconfigure(errors="surrogateescape")
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
        target = TurnTarget(system, new_session=True) if session is None else TurnTarget(session=session)
        try:
            turn = manager.run_turn(tenant_id, target, message, options)
            reply = _stream_turn(turn)
        except ChatKVError as exc:  # the REPL survives a rejected message (too long, busy session)
            if session is None and isinstance(exc, ContextTooLong) and exc.what == "system prompt":
                # Not this message's fault: every message would be refused for the same --system.
                raise CLIError(f"{exc} (--system)", 2) from None
            typer.echo(f"error: {exc}", err=True)
            continue
        if session is None:
            session = str(turn.session_id)
            typer.echo(f"session {session} (new)")
        s = reply.stats
        typer.secho(
            f"ttft {s.ttft_s * 1000:.0f} ms | prefilled {s.prefill_tokens} | reused {s.reused_tokens} | "
            f"{_cache_text(s)} | {s.decode_tokens} tokens in {s.decode_s:.2f} s",
            dim=True,
        )


def _cache_text(stats: TurnStats) -> str:
    """Where a turn's cache came from, in words: `new session` (its first turn; `..., shared
    system prompt` when the tenant's prefix pool had it), `cache from device`, `cache from disk,
    restored in 12 ms` (host, disk, redis), `cache rebuilt from the transcript`."""
    source = stats.restored_from
    if source == "new":
        return "new session, shared system prompt" if stats.base_reused_tokens else "new session"
    if source == "rebuilt":
        return "cache rebuilt from the transcript"
    if source == "device":
        return "cache from device"
    return f"cache from {source}, restored in {stats.restore_s * 1000:.0f} ms"


def _stream_turn(turn: PlannedTurn) -> Reply:
    """Print the turn's pieces as they come; its `Reply`."""
    from sessions import Reply

    reply = None
    # Closed explicitly so that Ctrl-C mid-reply gives the session's lease back at once (nothing is
    # stored, and a session made for the turn goes again).
    with closing(turn):
        for item in turn:
            if isinstance(item, Reply):
                reply = item
            else:
                typer.echo(item, nl=False)
    typer.echo()
    if reply is None:
        raise RuntimeError("bug: a turn ended without a reply")
    return reply
