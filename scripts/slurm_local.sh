#!/usr/bin/env bash
# A one-node SLURM on this machine, to try the SLURM launcher (hydra/launcher=slurm) and for its integration test
# (tests/train/test_slurm.py). Every file (slurm.conf, munge key and socket, state, spool, pid and log files) lives in
# DIR (default /tmp/sinklab-slurm); the daemons are started directly (no systemd) and stopped by their pid files.
#   bash scripts/slurm_local.sh start [DIR]    # installs slurm-wlm and munge with apt-get if missing (as root)
#   export SLURM_CONF=DIR/slurm.conf           # the line `start` prints: sbatch, squeue and submitit use it
#   bash scripts/slurm_local.sh status [DIR]
#   bash scripts/slurm_local.sh stop [DIR]     # cancels the cluster's jobs, then stops its daemons
# One node `localhost` with this machine's CPUs and memory, no GPUs, no accounting (submitit warns "Bypassing
# sacct error" on each status poll; jobs run and finish). A requeued job waits AuthInfo cred_expire (10 s here,
# SLURM's default is 120 s) before it starts again. Needs root: slurmd runs every job as its user.
# Ports: SLURM_LOCAL_PORT (default 6817) for slurmctld, the next one for slurmd; one cluster per port pair.
set -euo pipefail

usage="usage: bash scripts/slurm_local.sh start|stop|status [DIR]"
cmd=${1:-}
DIR=${2:-${SINKLAB_SLURM_DIR:-/tmp/sinklab-slurm}}
DIR=$(realpath -m "$DIR")
CONF=$DIR/slurm.conf
PORT=${SLURM_LOCAL_PORT:-6817}
started=0
# exit 3: this machine cannot run the local cluster (no packages, no root); the test skips on it, with this line
die() { echo "error: $1" >&2; exit "${2:-1}"; }

pid_alive() {  # the pid in file $1 is a running process
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

ensure_packages() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  [ "$(id -u)" -eq 0 ] || die "slurm-wlm and munge are not installed and installing them needs root: run \
'apt-get install -y slurm-wlm munge' as root, then this script again" 3
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get here; \
install SLURM (slurmctld, slurmd, sbatch) and munge with this system's package manager" 3
  echo "installing slurm-wlm and munge with apt-get ..." >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
    >"${TMPDIR:-/tmp}/sinklab-slurm-apt.log" 2>&1 \
    || die "apt-get could not install slurm-wlm and munge (log: ${TMPDIR:-/tmp}/sinklab-slurm-apt.log)" 3
}

write_conf() {
  local cpus mem_mb
  cpus=$(nproc)
  mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  cat >"$CONF" <<EOF
# written by scripts/slurm_local.sh: a one-node cluster, every file under $DIR
ClusterName=sinklab
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it starts again (SLURM's default 120 s)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
# no cgroups, no accounting
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# look for startable jobs every few seconds (a requeued job starts once cred_expire has passed; default 60 s)
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# seconds between SIGTERM and SIGKILL (time limit, scancel, requeue)
KillWait=15
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_until() {  # wait_until SECONDS WHAT COMMAND...: poll COMMAND every 0.5 s
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq $((seconds * 2))); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  die "$what within $seconds s (logs: $DIR/*.log)"
}

node_idle() {
  [ "$(SLURM_CONF=$CONF sinfo -h -n localhost -o %t)" = idle ]
}

start() {
  ensure_packages
  [ "$(id -u)" -eq 0 ] || die "the local SLURM needs root (slurmd runs each job as its user); run as root" 3
  if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid" && pid_alive "$DIR/munge/munged.pid"; then
    echo "the local SLURM in $DIR is already running" >&2
    echo "export SLURM_CONF=$CONF"
    return
  fi
  stop_daemons  # what is left of a half-started cluster in DIR
  trap '[ "$started" = 1 ] || stop_daemons' EXIT  # a start that fails leaves no daemon behind
  if command -v ss >/dev/null && ss -Hltn "( sport = :$PORT or sport = :$((PORT + 1)) )" | grep -q .; then
    die "port $PORT or $((PORT + 1)) is in use (another SLURM?): stop it (bash scripts/slurm_local.sh stop ITS_DIR) \
or choose other ports with SLURM_LOCAL_PORT"
  fi
  mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool"
  chmod 700 "$DIR/munge"
  [ -s "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key" 2>/dev/null \
    || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none && chmod 600 "$DIR/munge/munge.key"; }
  write_conf
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  # -c: a fresh controller state (no jobs left from an earlier cluster in DIR)
  slurmctld -c -f "$CONF"
  wait_until 30 "slurmctld did not answer" env SLURM_CONF="$CONF" scontrol ping
  slurmd -c -f "$CONF" -N localhost
  wait_until 60 "the node localhost did not become idle" node_idle
  started=1
  echo "the local SLURM is running in $DIR (partition local, node localhost: $(nproc) CPUs); to use it:" >&2
  echo "export SLURM_CONF=$CONF"
}

stop_pidfile() {  # SIGTERM the process in pid file $1, SIGKILL after 15 s
  local file=$1 pid
  pid_alive "$file" || { rm -f "$file"; return 0; }
  pid=$(cat "$file")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
    sleep 0.5
  done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$file"
}

stop_daemons() {
  stop_pidfile "$DIR/slurmd.pid"
  stop_pidfile "$DIR/slurmctld.pid"
  stop_pidfile "$DIR/munge/munged.pid"
}

jobs_left() {
  SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null | grep -q .
}

stop() {
  if pid_alive "$DIR/slurmctld.pid" && SLURM_CONF=$CONF scontrol ping >/dev/null 2>&1; then
    SLURM_CONF=$CONF scancel --partition=local 2>/dev/null || true
    for _ in $(seq 60); do  # the jobs' processes get SIGTERM, then SIGKILL after KillWait
      jobs_left || break
      sleep 0.5
    done
  fi
  stop_daemons
  echo "the local SLURM in $DIR is stopped" >&2
}

status() {
  local name up=0
  for name in munge/munged slurmctld slurmd; do
    if pid_alive "$DIR/$name.pid"; then
      echo "${name#munge/}: running (pid $(cat "$DIR/$name.pid"))"
      up=$((up + 1))
    else
      echo "${name#munge/}: stopped"
    fi
  done
  [ "$up" -eq 3 ] || return 1
  SLURM_CONF=$CONF sinfo
  SLURM_CONF=$CONF squeue
  echo "export SLURM_CONF=$CONF"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) die "$usage" 2 ;;
esac
