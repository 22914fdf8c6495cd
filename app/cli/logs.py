"""How `chatkv serve` logs: the level (`--log-level`, `CHATKV_LOG_LEVEL`) and the format (`--log-format`,
`CHATKV_LOG_FORMAT`: `text` lines or one JSON object per line through python-json-logger).

chatkv's own loggers (`app`, `sessions`, `cache`, `storage`) and uvicorn's (its access log among
them: one line per HTTP request at `info`) log at the chosen level; other libraries only from
`warning` up, so `info` is not drowned in their chatter. At `info` each completed turn is one line
from `sessions.turns` (tenant, session, prefilled and cached tokens, where the cache came from, TTFT,
decode tokens/s); in JSON those are fields of their own.
"""

from __future__ import annotations

import logging
import sys
from enum import StrEnum
from typing import TextIO


class LogLevel(StrEnum):
    """`--log-level` values (the CLI's choices)."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"


class LogFormat(StrEnum):
    """`--log-format` values (the CLI's choices)."""

    text = "text"
    json = "json"


LOG_LEVELS = tuple(level.value for level in LogLevel)
LOG_FORMATS = tuple(fmt.value for fmt in LogFormat)

OWN_LOGGERS = ("app", "sessions", "cache", "storage", "uvicorn")
"""Loggers that log at the chosen level; `uvicorn` covers `uvicorn.error` and `uvicorn.access`."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"


def configure_logging(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Send every log record to `stream` (default stderr) as `log_format` (`text` or `json`), with
    chatkv's and uvicorn's loggers at `level` and the others at `warning` or above.

    Raises:
        ValueError: for a level or format not in `LOG_LEVELS` / `LOG_FORMATS` (the CLI refuses them first).
    """
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(_json_formatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT, TIME_FORMAT))
    numeric = logging.getLevelName(level.upper())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(numeric)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted, not the stream it was when the
    handler was made: a caller that swaps stderr for a while (a test runner capturing a command's
    output) and closes its stand-in must not leave the root logger writing into a closed file."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always sys.stderr


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.core import RESERVED_ATTRS
    from pythonjsonlogger.json import JsonFormatter

    # `extra=` fields of a record (a turn's tenant, session, token counts) become keys of their own;
    # uvicorn's `color_message` (the message again, with terminal colour codes) is not one.
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],
        timestamp=False,
    )
