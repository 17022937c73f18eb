"""The terminal view of a run: a rich progress bar while generating (ready groups / GBS, tokens/s, partial
rows) and the one-line summary per iteration. The bar only appears on a terminal (stdout is a TTY)."""
from __future__ import annotations

import sys
from typing import Callable

BAR_WIDTH = 12


def progress_fields(progress: dict, partial_rows: int) -> dict:
    """on_round's progress dict -> the bar's fields. tokens/s over the iteration's generation so far."""
    elapsed = max(float(progress.get("elapsed_s", 0.0)), 1e-9)
    return {"completed": int(progress.get("ready_groups", 0)), "total": max(1, int(progress.get("target_groups", 1))),
            "tokens_per_s": float(progress.get("tokens", 0)) / elapsed,
            "partial_rows": int(progress.get("partial_rows", partial_rows)), "round": int(progress.get("round", 0))}


class TerminalProgress:
    """One bar per iteration's generation, removed when the iteration's summary line is printed."""

    def __init__(self, enabled: bool, echo: Callable[[str], None], stream=None):
        stream = stream if stream is not None else sys.stdout
        self.echo = echo
        self.enabled = bool(enabled) and hasattr(stream, "isatty") and stream.isatty()
        self._progress = None
        self._task = None
        self._stream = stream

    def _ensure(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self._progress is None:
            # fits 80 columns: rich drops what does not fit, and the ready/GBS count went first
            self._progress = Progress(
                TextColumn("[bold]iter {task.fields[iteration]:>4}[/]"), BarColumn(bar_width=BAR_WIDTH),
                MofNCompleteColumn(), TextColumn("ready"),
                TextColumn("{task.fields[tokens_per_s]:>6.0f} tok/s"),
                TextColumn("partial {task.fields[partial_rows]:>4}"),
                TextColumn("round {task.fields[round]}"), TimeElapsedColumn(),
                console=Console(file=self._stream), transient=True)
            self._progress.start()
        return self._progress

    def update(self, iteration: int, progress: dict, partial_rows: int) -> None:
        if not self.enabled:
            return
        bar = self._ensure()
        fields = progress_fields(progress, partial_rows)
        if self._task is None:
            self._task = bar.add_task("generate", iteration=iteration, **fields)
        else:
            bar.update(self._task, iteration=iteration, **fields)

    def line(self, text: str) -> None:
        """The per-iteration summary: printed above the bar (or plainly), and the bar resets."""
        if self._progress is not None and self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None
        self.echo(text)  # while the bar is live, rich prints stdout above it (and Prefect's log_prints sees it)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
