"""How `chatkv` commands print: a table or JSON (`--json`), label/value pairs, and the short forms
of times, durations and counts; and the confirmation prompt of the destructive commands."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from app.cli.groups import Cancelled


def print_data(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """Print `data` as indented JSON with `as_json`, else as `render` shows it."""
    if as_json:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        render(data)


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROLS_AND_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def shown(text: str, *, lines: bool = False) -> str:
    """Text that tenants wrote (titles, messages), safe to print on an operator's terminal: control
    characters (terminal escape sequences among them) as `\\xNN`; line breaks and tabs kept only
    in `lines` text, so a one-line field cannot forge the lines after it."""
    pattern = _CONTROLS if lines else _CONTROLS_AND_BREAKS
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    """A borderless table; `None` cells print as `-`."""
    cells = [["-" if value is None else shown(str(value)) for value in row] for row in rows]
    table = Table(title=title, title_justify="left", box=None)
    for column in columns:
        table.add_column(column, no_wrap=True)
    for row in cells:
        table.add_row(*(Text(cell) for cell in row))  # Text: a title like "[red]x" is not markup
    # Wide enough that rich never truncates an id (operators copy them); a narrow terminal wraps lines.
    width = sum(max([len(c), *(len(r[i]) for r in cells)]) + 2 for i, c in enumerate(columns))
    Console(width=max(width, len(title or ""))).print(table)


def print_pairs(pairs: Sequence[tuple[str, object]]) -> None:
    """One `label  value` line per pair, labels padded to one width; `None` prints as `-`."""
    width = max(len(label) for label, _ in pairs)
    for label, value in pairs:
        typer.echo(f"{label:<{width}}  {'-' if value is None else shown(str(value))}")


def duration_text(seconds: float) -> str:
    """`30d`, `2h`, `90s`: the largest unit that divides `seconds` exactly."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def when(iso: str) -> str:
    """An ISO 8601 timestamp as `YYYY-MM-DD HH:MM:SS`."""
    return iso[:19].replace("T", " ")


def count(n: int, noun: str) -> str:
    """`1 session`, `2 sessions`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def confirm(question: str, yes: bool) -> None:
    """Ask `question` unless `yes`; raises `Cancelled` when the answer is no."""
    if not yes and not typer.confirm(question):
        raise Cancelled()
