"""py-spy helpers for the serving benches (named so that it never shadows the stdlib `profile`,
which cProfile imports, when a bench runs as `python3 bench/X.py`): find a server's pid by its
port, record it, and summarize the record as the share of samples per thread and per innermost
frame.

    .venv/bin/python -m bench.pyspy --port 8001 --seconds 8   # any live worker or gateway
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path


def pid_listening(port: int) -> int | None:
    """The pid of the process with a TCP socket listening on `port` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return int(d.name)
        except OSError:
            continue
    return None


def record(pid: int, seconds: float, rate: int = 250) -> str:
    """A summary of `seconds` of py-spy samples of `pid`. py-spy drops the samples of a thread it
    sees idle, so a thread's samples / (rate * seconds) is how busy it was. `--nonblocking`: by
    default py-spy pauses the process for each sample, which slows what it measures, and a
    thread stopped so is mostly found at a syscall's return (a 2-core box: the gateway's
    `asyncio.get_running_loop()` calls, a getpid each, took 17% of its samples paused, 1% not)."""
    beside = Path(sys.executable).parent / "py-spy"  # a venv's, when the venv is not on PATH
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        return "py-spy is not installed (pip install py-spy)\n"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        done = subprocess.run([spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r",
                               str(rate), "-f", "raw", "--threads", "--nonblocking", "-o",
                               str(raw)],
                              capture_output=True, text=True, timeout=seconds + 60)
        if not raw.exists():
            return f"py-spy failed: {done.stderr[-500:]}\n"
        return (f"{rate} Hz for {int(seconds)} s: {rate * int(seconds)} samples a thread busy "
                f"throughout would have\n" + summarize(raw.read_text()))


def summarize(raw: str, top: int = 8) -> str:
    """Share of samples per thread, and each thread's top innermost frames. py-spy counts a
    thread blocked in a C call (select, a queue wait) as busy: those frames say "waiting"."""
    threads: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        parts = stack.split(";")
        threads[parts[0]] += n
        frames.setdefault(parts[0], Counter())[parts[-1]] += n
    out = [f"{total} samples"]
    for thread, n in threads.most_common():
        out += ["", f"{n / total * 100:5.1f}%  {thread}"]
        out += [
            f"    {k / total * 100:5.1f}%  {f[:150]}" for f, k in frames[thread].most_common(top)
        ]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=8)
    args = ap.parse_args()
    pid = pid_listening(args.port)
    print(record(pid, args.seconds) if pid else f"nothing listens on port {args.port}")


if __name__ == "__main__":
    main()
