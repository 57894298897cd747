"""What every ``sim2edge`` command prints through: the console, one-line errors, listings, JSON."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

console = Console()


def listing(headers: list[str], rows: list[list[str]], ids: int = 1) -> Table:
    """A table whose first ``ids`` columns are identifiers: never wrapped nor cut; the other columns fold."""
    table = Table()
    for i, header in enumerate(headers):
        if i < ids:
            table.add_column(header, no_wrap=True, min_width=max(len(header), *(len(r[i]) for r in rows)))
        else:
            table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_listing(table: Table, out: Console = console) -> None:
    """A terminal gets the table fitted to its width; a pipe or file gets it whole, as wide as it is."""
    if not out.is_terminal:
        out = Console(width=out.measure(table, options=out.options.update_width(1 << 20)).maximum, file=out.file)
    out.print(table)


def print_json(value: object) -> None:
    """Plain JSON on stdout (no wrapping, no colour), for scripts."""
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def fail(message: str, code: int = 2) -> None:
    console.print(Text.assemble(("error", "red"), f": {message}"), soft_wrap=True)
    raise typer.Exit(code)



def check_task(task: str) -> None:
    from stages.sim.registry import load

    try:
        load(task)
    except (KeyError, ImportError, AttributeError, ValueError) as e:
        fail(f"--task: {str(e).strip(chr(34))}")
