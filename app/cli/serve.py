"""`chatkv serve`: the chat UI, the `/v1/` API, the admin API and metrics over one home."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from app.cli.groups import CLIError, held_by_server
from app.cli.home import domain_errors, home_dir, load_services, settings_for
from app.cli.logs import LogFormat, LogLevel, configure_logging
from sessions import HomeLocked, check_unlocked

log = logging.getLogger(__name__)


def serve_command(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 7860,
    local: Annotated[
        bool,
        typer.Option("--local", help="Single-tenant local mode: the web UI asks for no API key (the HTTP API does)."),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="'default' (bundled SmolLM2-135M-Instruct), a local Hugging Face model folder, a .gguf file, "
            "or a hub id such as HuggingFaceTB/SmolLM2-360M-Instruct (downloaded into the Hugging Face cache)."
        ),
    ] = None,
    log_level: Annotated[
        LogLevel,
        typer.Option(
            envvar="CHATKV_LOG_LEVEL",
            case_sensitive=False,
            help="chatkv's and uvicorn's log level; 'info' logs each HTTP request and one line per turn.",
        ),
    ] = LogLevel.info,
    log_format: Annotated[
        LogFormat,
        typer.Option(
            envvar="CHATKV_LOG_FORMAT",
            case_sensitive=False,
            help="'text' lines, or 'json': one JSON object per line (a turn's figures as fields).",
        ),
    ] = LogFormat.text,
) -> None:
    """Serve the chat UI at /, the OpenAI-compatible API under /v1/ (chat completions, Responses,
    sessions), the admin API under /admin/ and Prometheus metrics at /metrics.

    Runs until Ctrl-C or SIGTERM (exit code 0): turns in flight complete, caches are persisted so the
    next start resumes warm, and the home's lock is released.
    """
    from app.http.server import ListenError, bind_sockets, serve

    try:
        check_unlocked(home_dir(ctx.obj))  # before a manager touches stores that a live server owns
        # Before the model loads (seconds): a taken port fails at once. Held until uvicorn listens.
        sockets = bind_sockets(host, port)
    except HomeLocked as exc:
        raise CLIError(held_by_server(exc), 2) from None
    except ListenError as exc:
        raise CLIError(str(exc), 1) from None
    try:
        settings = settings_for(ctx.obj, model=model)
        configure_logging(log_level.value, log_format.value)
        # The seconds before the model loads go to importing torch and transformers: say so.
        log.info("chatkv starting on %s:%d (home %s): importing torch and transformers", host, port, settings.home)
        with domain_errors():
            serve(
                load_services(settings), host=host, port=port, local=local, sockets=sockets, log_level=log_level.value
            )
    except HomeLocked as exc:  # a server took the home while the model loaded
        raise CLIError(held_by_server(exc), 2) from None
    except ListenError as exc:
        raise CLIError(str(exc), 1) from None
    finally:
        for sock in sockets:
            sock.close()
