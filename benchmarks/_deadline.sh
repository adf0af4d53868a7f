# Sourced by gpu_check.sh and gpu_smoke.sh.
# upto SECONDS: SECONDS, or less where HACPO_DEADLINE (epoch seconds; device_run.sh sets it per
# stage) comes sooner: a limit of an outer `timeout` does not reach these inner ones (each
# `timeout` runs its command in a process group of its own)
upto() {
  local d="$1"
  if [ -n "${HACPO_DEADLINE:-}" ]; then
    local r=$(( HACPO_DEADLINE - $(date +%s) - 5 ))
    [ "$r" -lt "$d" ] && d=$r
    [ "$d" -lt 1 ] && d=1
  fi
  echo "$d"
}
