"""A Slurm node > 0 past its stopped mark (orchestrator/launch/slurm_env.publish_stopped) is not
killed by the SIGTERM srun's --kill-on-bad-exit sends once node 0 has exited: it ends with its
own code, so node 0's gate result stays the job's (one run of the Slurm gate test ended 143)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The node's end as _run_node runs it: the mark published inside stop_on_signals, then the
# process on its way out, signalled as srun does.
NODE_END = """
import os, signal, sys, time
from pathlib import Path
from orchestrator.launch.processes import LocalCluster, stop_on_signals
from orchestrator.launch.slurm_env import publish_stopped
with stop_on_signals(LocalCluster([], None, 1.0, 1.0)):
    publish_stopped(Path(sys.argv[1]), 1, 0)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
sys.exit(0)
"""


def test_a_node_past_its_stopped_mark_exits_with_its_own_code(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", NODE_END, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert json.loads((tmp_path / "stopped" / "node1.json").read_text()) == {"status": 0}
