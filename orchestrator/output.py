"""Output to a reader that may leave: `tandem serve | head`, or a `tee` that Ctrl-C ended first.

Python ignores SIGPIPE, so a write to a pipe nobody reads raises BrokenPipeError: printed
from the launcher, that was a traceback in place of the ordered shutdown (the `stopped:` line
is printed after the children are stopped, the `ready:` line before the cluster serves).
`reader_may_leave` wraps a stream so that the first broken pipe points its descriptor at
/dev/null and every later write is dropped: the command carries on (serving, stopping in
order) and exits without a traceback or Python's "Exception ignored" note.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any, cast


def silence(stream: IO[str]) -> None:
    """Point `stream`'s descriptor at /dev/null (its reader has gone)."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        return
    os.dup2(devnull, fd)
    os.close(devnull)


class _ReaderMayLeave:
    """`stream`, whose writes stop (silently) once its reader has left."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._left()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._left()

    def _left(self) -> None:
        self._gone = True
        silence(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def reader_may_leave(stream: IO[str] | None) -> IO[str]:
    """`stream` (default sys.stdout) made safe to print to after its reader has gone."""
    stream = sys.stdout if stream is None else stream
    wrapped = stream if isinstance(stream, _ReaderMayLeave) else _ReaderMayLeave(stream)
    return cast(IO[str], wrapped)  # it writes and flushes as one; the rest is the stream's
