"""Progress bars of long work (``sbx image pull``, ``image import``, ``replay``): rich, on
stderr, and only when stderr is a terminal and the output is not ``--json`` (a pipe, a
log file or a program reading the JSON never sees one)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


def wanted(*, as_json: bool = False, quiet: bool = False) -> bool:
    return not (as_json or quiet) and sys.stderr.isatty()


def display(*columns: Any) -> Any:
    """A ``rich.progress.Progress`` drawing on stderr (default columns if none given)."""
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(stderr=True), transient=False)


@contextlib.contextmanager
def counting(description: str, unit: str, *, shown: bool) -> Iterator[Callable[[int, int], None]]:
    """A bar of ``done`` out of ``total`` (a callback ``(done, total)``), or a callback
    that does nothing when ``shown`` is false."""
    if not shown:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    columns = (BarColumn(), MofNCompleteColumn(), TextColumn(unit), TimeElapsedColumn())
    bar = display(TextColumn("{task.description}"), *columns)
    task = bar.add_task(description, total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)
