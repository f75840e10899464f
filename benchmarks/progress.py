"""The benchmarks' progress bar (rich, on stderr so the figures on stdout stay clean)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def progress_bar() -> Progress:
    """Description, bar, done/total, elapsed; drawn only on a terminal and removed when done."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
