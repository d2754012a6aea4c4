"""A progress bar for the tuning layer's long work (calibration, autotuning): rich, on stderr,
gone when done."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(show: bool, title: str, total: int) -> Iterator[Callable[..., None]]:
    """Yields step(label, done=1): call it as each of `total` items starts (`done`: how many items
    ended since the last call; 0 only relabels the bar); nothing is shown unless `show`."""
    if not show:
        yield lambda label, done=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=total)
        first = True

        def step(label: str, done: int = 1) -> None:
            nonlocal first
            bar.update(task, description=f"{title}: {label}", advance=0 if first else done)
            first = first and done == 0

        yield step
        bar.update(task, completed=total)
