"""How `chatkv` commands print: a table or JSON (`--json`), label/value pairs, and the short forms
of times, durations and counts; and the confirmation prompt of the destructive commands."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from app.cli.groups import Cancelled


def print_data(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """Print `data` as indented JSON with `as_json`, else as `render` shows it."""
    if as_json:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        render(data)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    """A borderless table; `None` cells print as `-`."""
    cells = [["-" if value is None else str(value) for value in row] for row in rows]
    table = Table(title=title, title_justify="left", box=None)
    for column in columns:
        table.add_column(column, no_wrap=True)
    for row in cells:
        table.add_row(*row)
    # Wide enough that rich never truncates an id (operators copy them); a narrow terminal wraps lines.
    width = sum(max([len(c), *(len(r[i]) for r in cells)]) + 2 for i, c in enumerate(columns))
    Console(width=max(width, len(title or ""))).print(table)


def print_pairs(pairs: Sequence[tuple[str, object]]) -> None:
    """One `label  value` line per pair, labels padded to one width; `None` prints as `-`."""
    width = max(len(label) for label, _ in pairs)
    for label, value in pairs:
        typer.echo(f"{label:<{width}}  {'-' if value is None else value}")


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
