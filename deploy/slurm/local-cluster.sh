#!/usr/bin/env bash
# local-cluster.sh up|down|status — a real two-node Slurm cluster on this one machine (root).
#
#   slurmctld : root network namespace, on the bridge address 10.213.0.1
#   slurmd n1 : network namespace slurm-n1 (10.213.0.11), its own hostname; slurmd n2 likewise
# Nodes share the filesystem (the "shared FS" of a real cluster) but not the network: each has
# its own address and port space, so both may bind the same port. Where network namespaces are
# not allowed it falls back to several slurmd on loopback (127.0.1.N; shared port space).
# `up` is idempotent (a healthy cluster is left alone; a half-up one is rebuilt); `down` stops
# only what `up` started (PIDs from our pid files and our namespaces) and leaves nothing behind.
# Env: SLURM_CI_PREFIX (/tmp/slurm-ci), SLURM_CI_NODES (2), SLURM_CI_MODE (auto|netns|loopback).
set -uo pipefail
PREFIX=${SLURM_CI_PREFIX:-/tmp/slurm-ci}
NNODES=${SLURM_CI_NODES:-2}
MODE=${SLURM_CI_MODE:-auto}
NET=10.213.0
BR=slurmbr0
MARK="# tandem-slurm-local"
CONF=/etc/slurm/slurm.conf   # Debian's compiled-in default path: srun/sbatch find it unaided
t0=$(date +%s.%N)
log() { printf '[local-cluster %5.1fs] %s\n' "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*"; }
# PID 1 here reaps zombies lazily, so `kill -0` lies about a killed daemon: read its state.
alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $s != Z* ]]; }
pid_in() { [[ -s $1 ]] && cat "$1"; }
wait_for() { local n=$1; shift; for ((k = 0; k < n * 10; k++)); do "$@" && return 0; sleep 0.1; done; return 1; }
nodes() { seq 1 "$NNODES"; }
addr_of() { [[ $(cat "$PREFIX/mode" 2>/dev/null) == netns ]] && echo "$NET.1$1" || echo "127.0.1.$1"; }

healthy() {
  [[ -f $CONF && -f $PREFIX/mode ]] || return 1
  local p; p=$(pid_in "$PREFIX/state/slurmctld.pid") && alive "$p" || return 1
  for i in $(nodes); do p=$(pid_in "$PREFIX/state/slurmd-n$i.pid") && alive "$p" || return 1; done
  [[ $(sinfo -h -N -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc)') == "$NNODES" ]]
}

down() {
  local ctl jobs p pids
  ctl=$(pid_in "$PREFIX/state/slurmctld.pid")
  if [[ -n ${ctl:-} ]] && alive "$ctl"; then          # cancel jobs so their steps exit cleanly
    jobs=$(squeue -h -o %i 2>/dev/null)
    # shellcheck disable=SC2086
    [[ -n $jobs ]] && scancel $jobs && wait_for 10 bash -c '[ -z "$(squeue -h -o %i 2>/dev/null)" ]'
  fi
  for f in "$PREFIX"/state/slurmd-n*.pid "$PREFIX/state/slurmctld.pid"; do
    p=$(pid_in "$f") || continue
    if alive "$p"; then kill "$p"; wait_for 5 bash -c "! ps -o stat= -p $p | grep -qv Z" || kill -9 "$p" 2>/dev/null; fi
  done
  for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^slurm-n[0-9]+$/ {print $1}'); do
    pids=$(ip netns pids "$ns" 2>/dev/null)               # escaped task children, if any
    # shellcheck disable=SC2086
    [[ -n $pids ]] && { kill $pids 2>/dev/null; sleep 1; pids=$(ip netns pids "$ns"); [[ -n $pids ]] && kill -9 $pids 2>/dev/null; }
    ip netns del "$ns"
  done
  ip link show "$BR" >/dev/null 2>&1 && ip link del "$BR"
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^sn[0-9]+-h$'); do
    ip link del "$l" 2>/dev/null
  done
  if [[ -e $PREFIX/munged-started-by-us ]]; then
    p=$(pid_in /run/munge/munged.pid) && alive "$p" && kill "$p"
  fi
  sed -i "/$MARK\$/d" /etc/hosts
  for d in /sys/fs/cgroup/*/slurm_n[0-9]* /sys/fs/cgroup/slurm_n[0-9]*; do
    [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  grep -q "$MARK" "$CONF" 2>/dev/null && rm -f "$CONF" /etc/slurm/cgroup.conf
  rm -rf "$PREFIX"
  log "down: nothing left"
}

try_netns() {
  ip link show "$BR" >/dev/null 2>&1 || ip link add "$BR" type bridge || return 1
  ip addr show dev "$BR" | grep -q "$NET.1/24" || ip addr add "$NET.1/24" dev "$BR"
  ip link set "$BR" up
  for i in $(nodes); do
    local ns=slurm-n$i
    [[ -e /run/netns/$ns ]] || ip netns add "$ns" || return 1
    if ! ip -n "$ns" link show "sn$i-c" >/dev/null 2>&1; then
      ip link del "sn$i-h" 2>/dev/null                   # stale half of a pair (netns deletion is async)
      ip link add "sn$i-h" type veth peer name "sn$i-c" && ip link set "sn$i-c" netns "$ns" || return 1
    fi
    ip link set "sn$i-h" master "$BR" up
    ip -n "$ns" addr show dev "sn$i-c" | grep -q "$NET.1$i/" || ip -n "$ns" addr add "$NET.1$i/24" dev "sn$i-c"
    ip -n "$ns" link set "sn$i-c" up
    ip -n "$ns" link set lo up                            # else 127.0.0.1 is dead inside the node
  done
}

write_conf() {  # $1 = proctrack plugin
  local mem=$(( $(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) / NNODES )) ctl_addr
  ctl_addr=$([[ $(cat "$PREFIX/mode") == netns ]] && echo "$NET.1" || echo 127.0.0.1)
  mkdir -p /etc/slurm
  cat >"$CONF" <<CONF
# written by deploy/slurm/local-cluster.sh $MARK
ClusterName=tandem-local
SlurmctldHost=$(hostname -s)($ctl_addr)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/$1
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
StateSaveLocation=$PREFIX/state/ctld
SlurmdSpoolDir=$PREFIX/state/d/%n
SlurmctldPidFile=$PREFIX/state/slurmctld.pid
SlurmdPidFile=$PREFIX/state/slurmd-%n.pid
SlurmctldLogFile=$PREFIX/log/slurmctld.log
SlurmdLogFile=$PREFIX/log/slurmd-%n.log
CONF
  for i in $(nodes); do
    if [[ $(cat "$PREFIX/mode") == netns ]]; then
      echo "NodeName=n$i NodeHostname=n$i NodeAddr=$(addr_of "$i") CPUs=$(nproc) RealMemory=$mem State=UNKNOWN"
    else
      echo "NodeName=n$i NodeHostname=$(hostname -s) NodeAddr=$(addr_of "$i") Port=$((17000 + i)) CPUs=$(nproc) RealMemory=$mem State=UNKNOWN"
    fi
  done >>"$CONF"
  echo "PartitionName=debug Nodes=n[1-$NNODES] Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
  if [[ $1 == cgroup ]]; then echo "CgroupPlugin=autodetect" >/etc/slurm/cgroup.conf; else rm -f /etc/slurm/cgroup.conf; fi
}

start_daemons() {
  install -d -o slurm -g slurm -m 0755 "$PREFIX/state/ctld" "$PREFIX/log"
  for i in $(nodes); do install -d -m 0755 "$PREFIX/state/d/n$i"; done
  slurmctld || return 1
  wait_for 15 bash -c 'scontrol ping 2>/dev/null | grep -q "is UP"' || { tail -20 "$PREFIX/log/slurmctld.log"; return 1; }
  for i in $(nodes); do
    if [[ $(cat "$PREFIX/mode") == netns ]]; then
      # nsenter, not `ip netns exec`: that remounts /sys and hides the cgroup mounts from slurmd.
      nsenter --net="/run/netns/slurm-n$i" unshare --uts -- sh -c "hostname n$i && exec slurmd -N n$i" || return 1
    else
      slurmd -N "n$i" || return 1                         # Debian builds multiple-slurmd support
    fi
  done
  wait_for 30 bash -c "[ \"\$(sinfo -h -N -o %t 2>/dev/null | grep -c idle)\" = $NNODES ]" || {
    sinfo -N -l; tail -20 "$PREFIX"/log/slurmd-n*.log; return 1; }
}

stop_daemons() {
  local p
  for f in "$PREFIX"/state/slurmd-n*.pid "$PREFIX/state/slurmctld.pid"; do
    p=$(pid_in "$f") && alive "$p" && kill "$p"
  done
  sleep 1
}

smoke() { timeout 60 srun -N"$NNODES" --ntasks-per-node=1 -t 1 hostname >"$PREFIX/smoke.out" 2>&1; }

up() {
  if healthy; then log "up: already healthy ($(cat "$PREFIX/mode")), nothing to do"; return 0; fi
  [[ -e $PREFIX ]] && { log "up: stale or partial cluster: tearing it down first"; down >/dev/null; }
  local b need=()
  for b in slurmctld slurmd srun munged ip unshare nsenter; do command -v "$b" >/dev/null || need+=("$b"); done
  if ((${#need[@]})); then
    log "installing packages (missing: ${need[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq &&
      apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null || return 1
  fi
  # munge: no systemd as PID 1 here, so start it by hand (as the munge user; key mode 0400).
  install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
  install -d -o munge -g munge -m 0711 /var/lib/munge
  install -d -o munge -g munge -m 0755 /run/munge
  mkdir -p "$PREFIX"
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged && touch "$PREFIX/munged-started-by-us"
    wait_for 10 bash -c 'munge -n | unmunge >/dev/null 2>&1' || { log "munged did not start"; return 1; }
  fi
  if [[ $MODE == auto ]]; then
    if try_netns 2>"$PREFIX/netns.err"; then MODE=netns; else MODE=loopback; log "netns unavailable ($(head -1 "$PREFIX/netns.err")): loopback nodes"; fi
  elif [[ $MODE == netns ]]; then try_netns || return 1; fi
  echo "$MODE" >"$PREFIX/mode"
  sed -i "/$MARK\$/d" /etc/hosts
  getent hosts "$(hostname -s)" >/dev/null || echo "$([[ $MODE == netns ]] && echo "$NET.1" || echo 127.0.0.1) $(hostname -s) $MARK" >>/etc/hosts
  for i in $(nodes); do echo "$(addr_of "$i") n$i $MARK" >>/etc/hosts; done
  # proctrack/cgroup kills what a task backgrounds when the job ends; linuxproc would not.
  local proctrack=linuxproc
  [[ -d /sys/fs/cgroup/freezer ]] && proctrack=cgroup
  write_conf "$proctrack"
  start_daemons || return 1
  if ! smoke && [[ $proctrack == cgroup ]]; then
    log "proctrack/cgroup failed the smoke test ($(tail -1 "$PREFIX/smoke.out")): retrying with linuxproc"
    stop_daemons; proctrack=linuxproc; write_conf linuxproc; start_daemons && smoke || return 1
  fi
  log "up: $NNODES nodes ($MODE, proctrack/$proctrack): $(tr '\n' ' ' <"$PREFIX/smoke.out")"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) if healthy; then sinfo -N; else echo "not up"; exit 1; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
