"""Progress while a run goes: a rich bar when rich is installed and stderr is a terminal,
else a plain line every tenth of the run (or every 5 s), or nothing."""

from __future__ import annotations

import importlib.util
import sys
import time

from loadtest.client import RequestResult

PROGRESS_KINDS = ("auto", "rich", "plain", "none")


class PlainProgress:
    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr

    def start(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.done = self.errors = self.tokens = 0
        self.t0 = self.last_print = time.monotonic()
        self.every = max(1, total // 10)

    def advance(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += not result.ok
        self.tokens += result.output_tokens if result.ok else 0
        now = time.monotonic()
        if self.done % self.every == 0 or self.done == self.total or now - self.last_print >= 5:
            self.last_print = now
            print(f"[loadtest] {self.label}: {self.done}/{self.total} done, {self.errors} errors, "
                  f"{self.tokens / max(now - self.t0, 1e-9):.1f} output tok/s", file=self.stream, flush=True)

    def finish(self) -> None:
        pass


class RichProgress:
    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[errors]} errors"), TextColumn("{task.fields[tok_s]:.1f} tok/s"),
            TimeElapsedColumn(), console=Console(stderr=True), transient=False,
        )

    def start(self, label: str, total: int) -> None:
        self.errors = self.tokens = 0
        self.t0 = time.monotonic()
        self._progress.start()
        self._task = self._progress.add_task(label, total=total, errors=0, tok_s=0.0)

    def advance(self, result: RequestResult) -> None:
        self.errors += not result.ok
        self.tokens += result.output_tokens if result.ok else 0
        tok_s = self.tokens / max(time.monotonic() - self.t0, 1e-9)
        self._progress.update(self._task, advance=1, errors=self.errors, tok_s=tok_s)

    def finish(self) -> None:
        self._progress.stop()


class NoProgress:
    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, result: RequestResult) -> None:
        pass

    def finish(self) -> None:
        pass


def make_progress(kind: str = "auto"):
    if kind == "none":
        return NoProgress()
    if kind in ("auto", "rich"):
        if importlib.util.find_spec("rich") is None:  # optional: the `bench` extra
            if kind == "rich":
                print("[loadtest] rich is not installed; plain progress lines instead", file=sys.stderr)
            return PlainProgress()
        if kind == "rich" or sys.stderr.isatty():
            return RichProgress()
    return PlainProgress()
