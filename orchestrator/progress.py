"""A one-line progress bar for `tandem bench` and `tandem eval`, drawn only on a terminal.

Redrawn in place (carriage return) at most ten times a second; on a pipe or a file it draws
nothing, so logs and `--json` output stay clean.
"""

from __future__ import annotations

import time
from typing import IO


class Progress:
    """`advance()` once per finished request; `close()` ends the line."""

    WIDTH = 30
    _MIN_REDRAW_S = 0.1

    def __init__(self, total: int, label: str, stream: IO[str] | None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = self.failed = 0
        self._stream = stream if stream is not None and _is_tty(stream) else None
        self._t0 = time.monotonic()
        self._drawn = 0.0

    @property
    def enabled(self) -> bool:
        return self._stream is not None

    def advance(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if self.done >= self.total or now - self._drawn >= self._MIN_REDRAW_S:
            self._draw(now)

    def line(self, now: float) -> str:
        filled = self.WIDTH * min(self.done, self.total) // self.total
        rate = self.done / max(now - self._t0, 1e-9)
        failed = f"  {self.failed} failed" if self.failed else ""
        return (f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                f"{self.done}/{self.total}  {rate:.1f}/s{failed}")

    def _draw(self, now: float) -> None:
        self._drawn = now
        if self._stream is not None:
            self._stream.write("\r" + self.line(now))
            self._stream.flush()

    def close(self) -> None:
        if self._stream is not None:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
