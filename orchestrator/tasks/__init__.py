"""Evaluation task families for `tandem eval` (pure Python: no torch, no transformers).

A task family is a module with `MODE` (how the eval talks to the server), `make_problems(n,
seed)`, `score(problem, completion)`, `ANSWER_MAX_TOKENS` and `STOP`; a `TaskMode.TOOL_LOOP`
family also has the tool and its checks (see lookup.py). `get_task(name)` looks one up by its
fixed name.
"""

from __future__ import annotations

from types import ModuleType

from orchestrator.tasks import arith, lookup
from orchestrator.tasks.mode import TaskMode

TASKS: dict[str, ModuleType] = {"arith": arith, "lookup": lookup}
__all__ = ["TASKS", "TaskMode", "UnknownTaskError", "get_task"]


class UnknownTaskError(KeyError):
    """`--task` names a family that does not exist; the message lists the known ones."""


def get_task(name: str) -> ModuleType:
    """Return the task module called `name` (e.g. "arith")."""
    try:
        return TASKS[name]
    except KeyError:
        raise UnknownTaskError(
            f"--task {name!r} is unknown; choose one of: {', '.join(sorted(TASKS))}"
        ) from None
