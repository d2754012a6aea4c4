"""A progress bar for the tuning layer's long work (calibration, autotuning): rich, on stderr,
gone when done."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(show: bool, title: str, total: int) -> Iterator[Callable[[str], None]]:
    """Yields step(label): call it as each of `total` items starts; nothing is shown unless `show`."""
    if not show:
        yield lambda label: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=total)
        first = True

        def step(label: str) -> None:
            nonlocal first
            bar.update(task, description=f"{title}: {label}", advance=0 if first else 1)
            first = False

        yield step
        bar.update(task, completed=total)
