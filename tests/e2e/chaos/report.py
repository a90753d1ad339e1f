"""The chaos drills' figures table: each drill files a `Row` (the `record` fixture), and the
session prints them at its end (and writes them to $TANDEM_CHAOS_REPORT; docs/reliability.md
reproduces them). Under pytest-xdist the rows travel from the workers to the controller in
their `workeroutput`; the hooks are registered by tests/conftest.py, the conftest every process
of a run loads (the controller collects no test, so it never loads the chaos conftest).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


@dataclass
class Outcomes:
    """How a drill's requests ended."""

    ok: int = 0
    error: int = 0
    hung: int = 0
    aborted: int = 0  # the client itself left (abort storm)
    started: int = 0  # answers whose first bytes reached the client (a stream under way)
    error_after_s: list[float] = field(default_factory=list)  # fault (or request start) -> error
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, other: Outcomes) -> None:
        self.ok += other.ok
        self.error += other.error
        self.hung += other.hung
        self.aborted += other.aborted
        self.started += other.started
        self.error_after_s += other.error_after_s
        for k, v in other.statuses.items():
            self.statuses[k] = self.statuses.get(k, 0) + v

    @property
    def max_error_s(self) -> float:
        return max(self.error_after_s, default=0.0)


@dataclass
class Row:
    fault: str
    topology: str
    outcomes: Outcomes
    pages_leaked: int
    recover_s: float | None  # fault -> the gateway routes to the worker again (None: n/a)

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        o = d["outcomes"]
        outcomes = Outcomes(**{**o, "statuses": {int(k): v for k, v in o["statuses"].items()}})
        return cls(**{**d, "outcomes": outcomes})


_ROWS = pytest.StashKey[list[Row]]()


def rows(config: pytest.Config) -> list[Row]:
    """The rows this process's drills filed (or, in an xdist controller, its workers')."""
    return config.stash.setdefault(_ROWS, [])


def table(filed: list[Row]) -> str:
    lines = [
        "| fault | topology | ok | error | hung | max time to error (s) | pages leaked "
        "| recover (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in filed:
        o = r.outcomes
        rec = "-" if r.recover_s is None else f"{r.recover_s:.1f}"
        err = f"{o.error}" + (f" (+{o.aborted} client aborts)" if o.aborted else "")
        lines.append(
            f"| {r.fault} | {r.topology} | {o.ok} | {err} | {o.hung} | {o.max_error_s:.2f} | "
            f"{r.pages_leaked} | {rec} |"
        )
    return "\n".join(lines)


def session_finished(session: pytest.Session) -> None:
    """Under pytest-xdist a worker hands its rows to the controller, which prints the table."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["chaos_rows"] = json.dumps([r.to_json() for r in rows(session.config)])


def node_down(node: Any, error: object) -> None:
    sent = getattr(node, "workeroutput", {}).get("chaos_rows")
    if sent:
        rows(node.config).extend(Row.from_json(r) for r in json.loads(sent))


def terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    filed = rows(terminalreporter.config)
    if not filed:
        return
    terminalreporter.write_sep("=", "chaos drills")
    terminalreporter.write_line(table(filed))
    path = os.environ.get("TANDEM_CHAOS_REPORT")
    if path:
        Path(path).write_text(table(filed) + "\n" + json.dumps([r.fault for r in filed]) + "\n")
