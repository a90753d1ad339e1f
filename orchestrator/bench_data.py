"""What `tandem bench` sends: sessions of one or more turns, from one of three sources.

- `random` (the default): one-turn sessions with random prompts of `input_len` (text drawn
  from letters and digits, which every tokenizer encodes; or token-id lists with
  `prompt_kind: ids`); mixed load with `long_every K`: every K-th prompt is `long_input_len`;
  `range_ratio r` draws each request's input and output length from [L(1-r), L(1+r)], so a
  closed loop's requests do not all start and finish together (a steady load, not waves).
- `jsonl:PATH`: one session per line, `{"prompt": "text" | [ids], "max_tokens": N}`
  (`max_tokens` optional, else `output_len`); a line with `"turns": ["q1", "q2", ...]` is a
  multi-turn session.
- `shared-prefix`: synthetic conversations: `num_groups` system prompts of `prefix_len`
  characters, each session picks one and asks `num_turns` questions of `input_len`
  characters, each turn's prompt holding the whole conversation so far (earlier questions and
  the answers the server gave), as a chat client re-sends it. The prefix cache and the
  cache-aware router see what they are for.
Everything is deterministic in `seed`.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ALPHABET = string.ascii_lowercase + string.digits
DATASETS = ("random", "shared-prefix", "jsonl:PATH")


class DatasetError(ValueError):
    """The dataset option or file is wrong; the message names the line and the field."""


@dataclass(frozen=True)
class Session:
    """One unit of work: its turns run one after the other (a conversation)."""

    kind: str  # short | long (mixed load), or the dataset's name
    turns: tuple[Any, ...]  # each turn's new prompt: text, or token ids (one turn only)
    max_tokens: int
    prefix: str = ""  # shared-prefix: the group's system prompt, before the first turn

    def prompt(self, turn: int, history: str) -> Any:
        """The prompt of turn `turn`: a later turn re-sends the conversation so far."""
        new = self.turns[turn]
        if isinstance(new, list):
            return new
        return f"{self.prefix}{history}{new}"


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(n))


def random_sessions(n: int, input_len: int, output_len: int, seed: int, prompt_kind: str,
                    vocab_size: int, long_every: int, long_input_len: int,
                    range_ratio: float = 0.0) -> list[Session]:
    rng = random.Random(seed)

    def spread(length: int) -> int:  # uniform in [L(1-r), L(1+r)], at least 1
        if range_ratio <= 0:
            return length
        return max(1, rng.randint(round(length * (1 - range_ratio)),
                                  round(length * (1 + range_ratio))))

    out = []
    for i in range(n):
        long = long_every > 0 and i % long_every == long_every - 1
        length = spread(long_input_len if long else input_len)
        prompt: Any = ([rng.randrange(1, vocab_size) for _ in range(length)]
                       if prompt_kind == "ids" else random_text(rng, length))
        out.append(Session("long" if long else "short", (prompt,), spread(output_len)))
    return out


def shared_prefix_sessions(n: int, input_len: int, output_len: int, seed: int, num_groups: int,
                           prefix_len: int, num_turns: int) -> list[Session]:
    rng = random.Random(seed)
    prefixes = [f"system {g}: {random_text(rng, prefix_len)}\n" for g in range(num_groups)]
    return [Session("shared-prefix", tuple(f"user: {random_text(rng, input_len)}\nassistant: "
                                           for _ in range(num_turns)), output_len,
                    prefix=prefixes[i % num_groups]) for i in range(n)]


def jsonl_sessions(path: Path, output_len: int, limit: int) -> list[Session]:
    """Sessions from a JSONL file (cycled to `limit` sessions when it has fewer lines)."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except OSError as exc:
        raise DatasetError(f"--dataset jsonl:{path}: cannot read it ({exc.strerror})") from None
    if not lines:
        raise DatasetError(f"--dataset jsonl:{path}: the file has no lines")
    out = []
    for no, line in enumerate(lines, 1):
        where = f"{path}:{no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: each line must be an object with a `prompt`")
        turns = row.get("turns", [row.get("prompt")])
        ok = isinstance(turns, list) and turns and all(
            isinstance(t, str) and t or (isinstance(t, list) and t and len(turns) == 1
                                         and all(isinstance(i, int) for i in t)) for t in turns)
        if not ok:
            raise DatasetError(f"{where}: `prompt` must be text or a list of token ids (or "
                               "`turns` a list of texts)")
        max_tokens = row.get("max_tokens", output_len)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise DatasetError(f"{where}: `max_tokens` must be a positive integer")
        out.append(Session("jsonl", tuple(turns), max_tokens))
    return [out[i % len(out)] for i in range(limit)]


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: all 0 in a closed loop; Poisson gaps at `request_rate`."""
    if request_rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def make_sessions_check(dataset: str) -> None:
    """The --dataset value's form (the file itself is read when the run starts)."""
    if dataset in ("random", "shared-prefix") or (dataset.startswith("jsonl:") and dataset[6:]):
        return
    raise DatasetError(f"--dataset {dataset!r}: use one of {', '.join(DATASETS)}")
