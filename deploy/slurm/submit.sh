#!/usr/bin/env bash
# submit.sh JOB.yaml [--set key=value ...] — submit a Tandem job, wait, exit with its result.
#
#   PD_SLURM=1 (default here): one role per node, node count from the plan (`tandem plan`).
#   PD_SLURM=0: the single-node smoke topology on one node.
#   DISAGGREGATION_IB_DEVICE: RDMA device(s) for the transfer backend; passed through to every task.
# Prints the job's output (and the run's artifact directory) when it ends.
set -euo pipefail
ROOT=$(cd "$(dirname "$(readlink -f "$0")")/../.." && pwd)
[[ $# -ge 1 ]] || { echo "usage: $0 JOB.yaml [--set key=value ...]" >&2; exit 2; }
JOB=$(readlink -f "$1"); shift
[[ -f $JOB ]] || { echo "error: job file $JOB not found" >&2; exit 2; }
cd "$ROOT"
export TANDEM_PY=${TANDEM_PY:-$ROOT/.venv/bin/python}
export PD_SLURM=${PD_SLURM:-1}
export TANDEM_JOB=$JOB TANDEM_SETS="$*"
export TANDEM_RUN_ID=${TANDEM_RUN_ID:-$(date +%Y%m%d-%H%M%S)-$$}
TANDEM_NODES=$("$TANDEM_PY" -m orchestrator.launch.slurm nodes --config "$JOB" "$@"); export TANDEM_NODES
ART=$("$TANDEM_PY" -m orchestrator.launch.slurm artifact-dir --config "$JOB" "$@")
PART=$("$TANDEM_PY" -m orchestrator.launch.slurm partition --config "$JOB" "$@")
TIME=$("$TANDEM_PY" -m orchestrator.launch.slurm time --config "$JOB" "$@")
mkdir -p "$ART"
OUT="$ART/slurm-$TANDEM_RUN_ID.out"
args=(--wait --parsable -N "$TANDEM_NODES" --ntasks-per-node=1 -J "tandem-$(basename "$JOB" .yaml)"
      -t "$TIME" -o "$OUT" --chdir "$ROOT" --export=ALL)
[[ -n $PART ]] && args+=(-p "$PART")
echo "submit: $(basename "$JOB") on $TANDEM_NODES node(s), run $TANDEM_RUN_ID, output $OUT"
rc=0
sbatch "${args[@]}" "$ROOT/deploy/slurm/job.sbatch" || rc=$?
cat "$OUT" 2>/dev/null || echo "(no job output at $OUT)"
echo "submit: job finished with exit $rc; artifacts in $ART"
exit "$rc"
