#!/usr/bin/env bash
# submit.sh JOB.yaml [--set key=value ...] — submit a Tandem job, wait, exit with its result.
#
#   PD_SLURM=1 (default here): one role per node, node count from the plan (`tandem plan`).
#   PD_SLURM=0: the single-node smoke topology on one node.
#   DISAGGREGATION_IB_DEVICE: RDMA device(s) for the transfer backend; passed through to every task.
# Prints the job's output as it runs (and the run's artifact directory when it ends).
set -euo pipefail
ROOT=$(cd "$(dirname "$(readlink -f "$0")")/../.." && pwd)
[[ $# -ge 1 ]] || { echo "usage: $0 JOB.yaml [--set key=value ...]" >&2; exit 2; }
JOB=$(readlink -f "$1"); shift
# A job runs the Slurm launcher whatever the file's launcher.kind: a local config (the README's
# configs/tiny-1p1d.yaml) otherwise ran the local launcher on one node, gate skipped, until
# cancelled. First, so that a later --set can still say otherwise.
set -- --set launcher.kind=slurm "$@"
[[ -f $JOB ]] || { echo "error: job file $JOB not found" >&2; exit 2; }
cd "$ROOT"
export TANDEM_PY=${TANDEM_PY:-$ROOT/.venv/bin/python}
export PD_SLURM=${PD_SLURM:-1}
export TANDEM_JOB=$JOB TANDEM_SETS="$*"
export TANDEM_SUBMIT_T0=${TANDEM_SUBMIT_T0:-$(date +%s.%N)}   # the job's "[t]" stamps count from here
export TANDEM_RUN_ID=${TANDEM_RUN_ID:-$(date +%Y%m%d-%H%M%S)-$$}
TANDEM_NODES=$("$TANDEM_PY" -m orchestrator.launch.slurm nodes --config "$JOB" "$@"); export TANDEM_NODES
ART=$("$TANDEM_PY" -m orchestrator.launch.slurm artifact-dir --config "$JOB" "$@")
PART=$("$TANDEM_PY" -m orchestrator.launch.slurm partition --config "$JOB" "$@")
TIME=$("$TANDEM_PY" -m orchestrator.launch.slurm time --config "$JOB" "$@")
if [[ -n $PART ]] && ! scontrol show partition "$PART" >/dev/null 2>&1; then
  echo "error: launcher.slurm_partition: no partition '$PART' on this cluster (it has:" \
    "$(sinfo -h -o %R 2>/dev/null | sort -u | paste -sd' ')); fix the job YAML or" \
    "--set launcher.slurm_partition=NAME ('' = the cluster's default)" >&2
  exit 2
fi
mkdir -p "$ART"
OUT="$ART/slurm-$TANDEM_RUN_ID.out"
args=(--parsable -N "$TANDEM_NODES" --ntasks-per-node=1 -J "tandem-$(basename "$JOB" .yaml)"
      -t "$TIME" -o "$OUT" --chdir "$ROOT" --export=ALL)
[[ -n $PART ]] && args+=(-p "$PART")
echo "submit: $(basename "$JOB") on $TANDEM_NODES node(s), run $TANDEM_RUN_ID, output $OUT"
JOBID=$(sbatch "${args[@]}" "$ROOT/deploy/slurm/job.sbatch") || exit 2
echo "submit: job $JOBID"
# Ctrl-C here cancels the job too, then waits for it to stop and shows its last lines (the
# `stopped:` line, where the artifacts are); a second Ctrl-C leaves at once. Under `set -e`
# every command the loop runs must survive its own interruption (`|| ...`), else the script
# dies with the sleep it was in.
cancelled=0
cancel() {
  if ((cancelled)); then echo "submit: not waiting for job $JOBID to stop" >&2; exit "$1"; fi
  cancelled=$1
  echo "submit: cancelling job $JOBID; waiting for it to stop (Ctrl-C again: leave now)" >&2
  scancel "$JOBID" 2>/dev/null || echo "submit: scancel $JOBID failed" >&2
}
trap 'cancel 130' INT
trap 'cancel 143' TERM
# Wait ourselves (sbatch --wait backs off to polls seconds apart): the job's record holds its
# state and exit code until MinJobAge; no accounting database is needed.
field() { scontrol show job -o "$JOBID" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p"; }
# The job's output as it comes (a serving job's `ready:` line tells where it serves), whole
# lines only; the rest once it has ended.
shown=0
show() {
  local n; [[ -f $OUT ]] || return 0   # sbatch creates it when the job starts
  n=$(wc -l <"$OUT") || return 0
  if ((n > shown)); then sed -n "$((shown + 1)),${n}p" "$OUT"; shown=$n; fi
}
while :; do
  show || true
  state=$(field JobState) || state=""
  case $state in
    PENDING|CONFIGURING|RUNNING|COMPLETING|SUSPENDED|"") sleep 0.5 || true ;;
    *) break ;;
  esac
done
code=$(field ExitCode); rc=${code%%:*}
[[ $state == COMPLETED || $rc != 0 ]] || rc=1   # CANCELLED / TIMEOUT / NODE_FAIL with exit 0
[[ $state == COMPLETED || $cancelled == 0 ]] || rc=$cancelled   # we cancelled it: 130 / 143
if [[ -f $OUT ]]; then tail -n "+$((shown + 1))" "$OUT"; else echo "(no job output at $OUT)"; fi
run_dir=$(compgen -G "$ART/job$JOBID.*-$TANDEM_RUN_ID" | head -n 1) || run_dir=""
echo "submit: job $JOBID $state"
echo "submit: job finished with exit $rc; artifacts in ${run_dir:-$ART} (job output: $OUT)"
exit "$rc"
