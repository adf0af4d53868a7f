#!/usr/bin/env bash
# (Kept in the repo for CI, which has no ../shared: the project's tested local-slurm tool.)
# Stop what start_local_slurm.sh started: slurmctld, every slurmd, and munged if
# (and only if) the start script launched it.  Idempotent; kills only PIDs from our
# own pid files whose command line names our slurm.conf.
#   LOCAL_SLURM_DIR   same dir as for start (/tmp/local-slurm)
#   LOCAL_SLURM_PURGE=1 also delete the dir afterwards
set -uo pipefail
DIR=${LOCAL_SLURM_DIR:-/tmp/local-slurm}
CONF=$DIR/etc/slurm.conf
log() { echo "[stop_local_slurm] $*"; }

ours() {  # ours PIDFILE -> echo pid if it is a live process started with our config
  local p; p=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$p" ] && tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$CONF" && echo "$p"
}
pids() { for f in "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && ours "$f"; done; }

if [ -f "$CONF" ]; then
  running=$(pids | xargs)
  if [ -n "$running" ]; then
    export SLURM_CONF=$CONF
    jobs=$(timeout 15 squeue -h -o %i 2>/dev/null | xargs)
    if [ -n "$jobs" ]; then     # cancel while slurmd is still up so it kills the job's processes
      log "cancelling jobs: $jobs"
      timeout 15 scancel $jobs 2>/dev/null
      for _ in $(seq 1 60); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    log "scontrol shutdown (pids: $running)"
    SLURM_CONF=$CONF timeout 15 scontrol shutdown >/dev/null 2>&1 || true
    for _ in $(seq 1 40); do [ -z "$(pids)" ] && break; sleep 0.25; done
    left=$(pids | xargs)
    if [ -n "$left" ]; then log "SIGTERM $left"; kill -TERM $left 2>/dev/null; sleep 3; fi
    left=$(pids | xargs)
    if [ -n "$left" ]; then log "SIGKILL $left"; kill -KILL $left 2>/dev/null; fi
  else
    log "no slurm daemons of ours running"
  fi
  # slurmstepd's outlive slurmd by design; ours have a file under $DIR open (the slurmd log)
  steps=$(for p in $(ps -eo pid=,comm= | awk '$2=="slurmstepd"{print $1}'); do
            ls -l /proc/$p/fd 2>/dev/null | grep -qF -- "$DIR/" && echo $p; done | xargs)
  if [ -n "$steps" ]; then
    log "killing leftover slurmstepd: $steps"; kill -TERM $steps 2>/dev/null; sleep 2; kill -KILL $steps 2>/dev/null
  fi
  # empty cgroup-v1 dirs that our slurmds created (proctrack/cgroup)
  for n in $(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF"); do
    d=/sys/fs/cgroup/freezer/slurm_$n
    [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
fi
rm -f "$DIR"/run/slurm*.pid

if [ -f "$DIR/run/munged.ours" ] && [ "${LOCAL_SLURM_KEEP_MUNGE:-0}" != 1 ]; then
  log "stopping munged (started by start_local_slurm.sh)"
  munged --stop >/dev/null 2>&1 || {
    p=$(cat /run/munge/munged.pid 2>/dev/null); [ -n "$p" ] && [ "$(cat /proc/$p/comm 2>/dev/null)" = munged ] && kill "$p"; }
  rm -f "$DIR/run/munged.ours"
fi
[ "${LOCAL_SLURM_PURGE:-0}" = 1 ] && rm -rf "$DIR" && log "removed $DIR"
log "stopped"
