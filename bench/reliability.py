"""Partial-failure probes on real local clusters (not a test): docs/reliability.md's table.

    .venv/bin/python -m bench.reliability                    # every probe
    .venv/bin/python -m bench.reliability --probe freeze     # freeze | faults | overload | sockets

Each probe starts its own cluster with `tandem serve` (real workers, real Mooncake over TCP),
drives it from this process (tests/e2e/chaos/probes.py) and prints one line of figures:
- freeze: 2P2D under steady load; SIGSTOP decode-0 for 15 s (longer than the 2 s transfer
  deadline), then SIGCONT: completions/s before and during, the slowest error, how long a
  stream that was mid-answer on decode-0 waited for its error, empty 200s, rejoin time;
- faults: 2P2D with TANDEM_TRANSFER_FAULTS=fail=0.3, 300 requests: answers, errors, 200s whose
  finish_reason is "abort", and whether the gateway's metrics agree with the clients;
- overload: 1P1D, 300 streams of 200 tokens at once: the longest gap between two tokens;
- sockets: 1P1D gateway, 500 idle and 500 half-header sockets: how many it closes, and when.
`--set KEY=VALUE` adds cluster overrides (repeatable). The probes use only HTTP, signals and
GetLoad, so the same script measures older code (copy it and tests/e2e/chaos/probes.py in).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster  # noqa: E402
from tests.e2e.chaos.probes import (  # noqa: E402
    faults_probe,
    freeze_probe,
    overload_probe,
    sockets_probe,
)

DEADLINES = ("transfer.bootstrap_timeout_s=3", "transfer.waiting_timeout_s=10",
             "transfer.transfer_timeout_s=2", "gateway.health_interval_s=0.3")


def _leaked(c: object) -> str:
    try:
        c.wait_drained(timeout_s=60)  # type: ignore[attr-defined]
        return "0"
    except AssertionError as e:
        return f"LEAK ({str(e)[:200]})"


def run_freeze(tmp: Path, extra: list[str], model: Path) -> None:
    with running_cluster("configs/tiny-2p2d.yaml", *DEADLINES, *extra, tmp=tmp, model=model) as c:
        f = asyncio.run(freeze_probe(c, model.name))
        print(f"freeze: {f.rps_before:.1f} req/s before, {f.rps_during:.1f} during "
              f"({f.rps_during / max(f.rps_before, 1e-9):.2f}x); slowest answer during it "
              f"{f.slowest_ok_s:.1f} s; slowest error "
              f"{f.max_error_s:.1f} s after the freeze; {f.stalled_streams} streams stalled "
              f"mid-answer: {f.stalled_streams - f.stall_resumed} erred (last "
              f"{f.stall_error_s:.1f} s after the freeze), {f.stall_resumed} waited it out; "
              f"{f.stuck_rooms} prefill rooms transferring at the freeze's end; "
              f"{f.empty_200} empty 200s; {f.hung} hung (90 s); rejoined {f.rejoin_s:.1f} s "
              f"after SIGCONT; leaked pages {_leaked(c)}", flush=True)


def run_faults(tmp: Path, extra: list[str], model: Path) -> None:
    env = {"TANDEM_TRANSFER_FAULTS": "fail=0.3"}
    with running_cluster("configs/tiny-2p2d.yaml", *DEADLINES, *extra, tmp=tmp, model=model,
                         env=env) as c:
        f = asyncio.run(faults_probe(c.url, model.name))
        print(f"faults fail=0.3: {f.ok} answers, {f.errors} errors {f.statuses}, {f.empty_200} "
              f"200s with finish_reason abort, {f.hung} hung; metrics: {f.metrics_success:.0f} "
              f"success, {f.metrics_errors:.0f} errors; leaked pages {_leaked(c)}", flush=True)


def run_overload(tmp: Path, extra: list[str], model: Path) -> None:
    with running_cluster("configs/tiny-1p1d.yaml", *extra, tmp=tmp, model=model) as c:
        o = asyncio.run(overload_probe(c.url, model.name))
        print(f"overload 300x200 tokens: {o.ok} ok, {o.errors} failed {o.statuses} in "
              f"{o.wall_s:.0f} s; "
              f"inter-token gap max {o.max_gap_s:.2f} s, p99 {o.p99_gap_s:.3f} s, "
              f"{o.gaps_over_1s} gaps > 1 s; TTFT p50 {o.ttft_p50_s:.1f} s, max "
              f"{o.ttft_max_s:.1f} s; leaked pages {_leaked(c)}", flush=True)


def run_sockets(tmp: Path, extra: list[str], model: Path) -> None:
    with running_cluster("configs/tiny-1p1d.yaml", *extra, tmp=tmp, model=model) as c:
        s = sockets_probe(c.url, model.name)
        print(f"sockets: {s.opened} opened; closed by the gateway within 40 s: {s.closed_idle} "
              f"idle, {s.closed_partial} half-header ({s.got_408} answered 408), last after "
              f"{s.last_close_s:.1f} s; normal requests meanwhile {s.normal_ok}/{s.normal_sent}",
              flush=True)


PROBES = {"freeze": run_freeze, "faults": run_faults, "overload": run_overload,
          "sockets": run_sockets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probe", choices=[*PROBES, "all"], default="all")
    ap.add_argument("--set", action="append", default=[], dest="extra",
                    help="extra cluster override KEY=VALUE (repeatable)")
    ap.add_argument("--model", type=Path, default=EMBEDDED_MODEL)
    args = ap.parse_args()
    names = list(PROBES) if args.probe == "all" else [args.probe]
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"rel-{name}-") as tmp:
            PROBES[name](Path(tmp), args.extra, args.model)


if __name__ == "__main__":
    main()
