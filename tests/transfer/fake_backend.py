"""In-process test double of TransferBackend, for state-machine unit tests ONLY.

It copies bytes with ctypes.memmove between regions of this process; it is not selectable from
TransferConfig (make_backend knows only mooncake and nixl) and is injected by tests.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

from transfer.backend import BackendError, Span, TransferBackend, WriteStatus

_names = itertools.count()


class FakeBackend(TransferBackend):
    name = "fake"

    def __init__(self) -> None:
        self._name = f"fake-{next(_names)}"
        self.regions: list[tuple[int, int]] = []
        self.submitted = 0

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, ptr: int, nbytes: int) -> None:
        self.regions.append((ptr, nbytes))

    def connect(self, agent_name: str, metadata: bytes) -> None:
        pass

    def forget(self, agent_name: str) -> None:
        pass

    def submit(self, peer: str, spans: list[Span]) -> Any:
        for src, dst, n in spans:
            if not any(p <= src and src + n <= p + size for p, size in self.regions):
                raise BackendError(f"fake: source 0x{src:x}+{n} is not registered")
            ctypes.memmove(dst, src, n)
        self.submitted += 1
        return True

    def poll(self, handle: Any) -> WriteStatus:
        return WriteStatus.DONE

    def release(self, handle: Any) -> None:
        pass

    def close(self) -> None:
        self.regions.clear()
