"""Progress bars for the long commands (verify, export-hf, gc), drawn by rich on stderr.

Only on a terminal: in a pipe or a log file the bars would be noise between the lines a script
parses, so they are off there (and with ``--quiet``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def enabled(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty()


@contextmanager
def bar(*, bytes_: bool = False, quiet: bool = False) -> Iterator[Progress]:
    """A rich Progress on stderr; add tasks with ``.add_task(description, total=...)``."""
    counter = DownloadColumn() if bytes_ else MofNCompleteColumn()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), counter, TimeElapsedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True,
                  disable=not enabled(quiet)) as progress:
        yield progress
