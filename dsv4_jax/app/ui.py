"""Terminal output of the command line: `rich` tables and progress bars when
the optional `cli` extra is installed, plain text otherwise (or with --plain).

The library never imports this module; only the command line (`dsv4_jax.app.cli`
and the benchmarks it runs, `dsv4_jax.app.bench`) does.
"""
from __future__ import annotations

import contextlib
import sys
import time


def _rich():
    try:
        import rich.console  # noqa: F401
        import rich.progress  # noqa: F401
        import rich.table  # noqa: F401
        return True
    except ImportError:
        return False


class UI:
    """Prints tables, lines and progress, through rich when it is there."""

    def __init__(self, plain: bool = False, file=None):
        self.file = file or sys.stdout
        self.rich = not plain and _rich()
        if self.rich:
            from rich.console import Console
            self.console = Console(file=self.file, highlight=False)
            if not self.console.is_terminal:    # logs and pipes: do not wrap at 80 columns
                self.console.width = max(self.console.width, 132)

    def line(self, text: str = "") -> None:
        if self.rich:
            self.console.print(text, markup=False)
        else:
            print(text, file=self.file, flush=True)

    def table(self, title: str, columns: list[str], rows: list[list], numeric=True) -> None:
        """With `numeric`, columns after the first are right-aligned."""
        cells = [[str(c) for c in row] for row in rows]
        if self.rich:
            from rich.table import Table
            t = Table(title=title, title_justify="left")
            for i, c in enumerate(columns):
                t.add_column(c, justify="right" if numeric and i else "left")
            for row in cells:
                t.add_row(*row)
            self.console.print(t)
            return
        widths = [max([len(columns[i])] + [len(r[i]) for r in cells]) for i in range(len(columns))]

        def fmt(row):
            return "  ".join(v.rjust(w) if numeric and i else v.ljust(w)
                             for i, (v, w) in enumerate(zip(row, widths))).rstrip()
        self.line(title)
        self.line(fmt(columns))
        self.line("  ".join("-" * w for w in widths))
        for row in cells:
            self.line(fmt(row))

    @contextlib.contextmanager
    def progress(self, description: str, total: int):
        """Context manager yielding `advance(n=1)`."""
        if self.rich and self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=self.console, transient=False) as p:
                task = p.add_task(description, total=total)
                yield lambda n=1: p.advance(task, n)
            return
        # Not a terminal (a log, a test): one line at the start and one at the end.
        done = [0]
        t0 = time.perf_counter()
        self.line(f"{description}: {total} steps ...")

        def advance(n=1):
            done[0] += n
        yield advance
        self.line(f"{description}: {done[0]}/{total} steps in {time.perf_counter() - t0:.2f} s")
