"""Progress of the long commands, on stderr: a tqdm bar on a terminal, one line per update elsewhere.

tqdm redraws its bar with carriage returns, which a file or a pipe (a log, CI) keeps, so every update
there runs together on one line. Written to anything that is not a terminal, a bar is `Lines` instead:
each update a line of its own, at most one per `mininterval` seconds (and the last one always).
"""

from __future__ import annotations

import sys
import time


def is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def bar(*, total: int, desc: str, unit: str, leave: bool = True, disable: bool = False, file=None):
    """A progress bar on `file` (default stderr): tqdm on a terminal, else `Lines`. Both offer `update(n)`,
    `n`, `total`, `set_postfix(**values)`, `write(text)` and `close()`."""
    file = sys.stderr if file is None else file
    if is_terminal(file):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=leave, disable=disable, file=file)
    return Lines(total=total, desc=desc, unit=unit, disable=disable, file=file)


class Lines:
    """A progress bar as lines: `desc: n/total unit (s elapsed), key=value, ...`, one per update."""

    def __init__(self, *, total: int, desc: str, unit: str, disable: bool = False, file=None,
                 mininterval: float = 1.0):
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.file = sys.stderr if file is None else file
        self.mininterval = mininterval
        self.n, self.postfix = 0, ""
        self.start = time.perf_counter()
        self.printed_at, self.printed_n = None, None

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.printed_at is None or now - self.printed_at >= self.mininterval or self.n == self.total:
            self._print(now)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def write(self, text: str) -> None:
        if not self.disable:
            print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self.printed_n != self.n and self.n:
            self._print(time.perf_counter())
        self.disable = True

    def _print(self, now: float) -> None:
        self.printed_at, self.printed_n = now, self.n
        if self.disable:
            return
        of = "" if self.total is None else f"/{self.total}"
        postfix = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}{of} {self.unit} ({now - self.start:.1f} s){postfix}", file=self.file, flush=True)


class Status:
    """One status line (`status(text)`): rewritten in place on a terminal, a line per message elsewhere;
    `close()` ends it."""

    def __init__(self, file=None):
        self.file = sys.stderr if file is None else file
        self.terminal, self.shown = is_terminal(self.file), False

    def __call__(self, text: str) -> None:
        self.shown = True
        if self.terminal:
            print(f"\r{text:<40}", end="", file=self.file, flush=True)
        else:
            print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self.terminal and self.shown:
            print(file=self.file, flush=True)
        self.shown = False
