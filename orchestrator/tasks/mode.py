"""How `tandem eval` talks to the server for a task family (its `MODE`)."""

from __future__ import annotations

from enum import Enum


class TaskMode(Enum):
    COMPLETION = "completion"  # one /v1/completions request per problem; its text is scored
    TOOL_LOOP = "tool_loop"  # chat with tools: calls, tool results, then the answer is scored
