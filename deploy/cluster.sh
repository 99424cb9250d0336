#!/usr/bin/env bash
# Run the distributed set on one machine: PostgreSQL store, Redis broker and locks,
# N Celery workers on the case queue, beat (the recovery sweep), the metrics exporter
# and Flower.  Usage:
#   deploy/cluster.sh start [WORKERS]   # default 2 workers of WORKER_CONCURRENCY processes;
#                                       # starts only what is not running (a dead beat, say)
#   deploy/cluster.sh stop [NAME...]    # warm shutdown; waits until every process (or each
#                                       # one named, e.g. worker-3: one fewer worker) exited
#   deploy/cluster.sh status            # its processes, and the workers and beat health sees
# Settings come from the environment, then from deploy/cluster.env (copy
# cluster.env.example; CLUSTER_ENV names another file): a variable the caller set keeps
# its value, the file fills in the others. Those read:
#   WORKER_CONCURRENCY (2), WORKER_METRICS_BASE_PORT (9810: worker i serves base+i),
#   METRICS_PORT (9808), FLOWER_PORT (5555), STOP_TIMEOUT_S (120), START_TIMEOUT_S (90:
#   how long start waits for every worker to answer ping), INVESTIGATE_RUN_DIR (var/cluster),
#   INVESTIGATE_BIN (the `investigate` to run: default .venv/bin/investigate of this
#   checkout; set it for a runtime install elsewhere, e.g. /opt/investigation/bin/investigate),
#   INVESTIGATE_HOME (default $INVESTIGATE_RUN_DIR/home; a worker started by hand needs
#   the same).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
env_file="${CLUSTER_ENV:-$here/cluster.env}"
if [ -f "$env_file" ]; then
  # The caller's environment wins over the file: its exported values are put back after
  # the file is read (by name; a read-only variable such as SHELLOPTS is left as it is).
  caller=()
  while IFS= read -r name; do
    flags="$(declare -p "$name" 2>/dev/null)"; flags="${flags#declare -}"
    [[ "${flags%% *}" == *r* ]] || caller+=("$name=${!name}")
  done < <(compgen -e)
  set -a; . "$env_file"; set +a
  for assignment in "${caller[@]}"; do export "$assignment"; done
fi
run="${INVESTIGATE_RUN_DIR:-$root/var/cluster}"
bin="${INVESTIGATE_BIN:-$root/.venv/bin/investigate}"
export INVESTIGATE_DATABASE_URL="${INVESTIGATE_DATABASE_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/investigation}"
export INVESTIGATE_BROKER_URL="${INVESTIGATE_BROKER_URL:-redis://127.0.0.1:6379/0}"
export INVESTIGATE_HOME="${INVESTIGATE_HOME:-$run/home}"
concurrency="${WORKER_CONCURRENCY:-2}"
metrics_base="${WORKER_METRICS_BASE_PORT:-9810}"
stop_timeout="${STOP_TIMEOUT_S:-120}"
start_timeout="${START_TIMEOUT_S:-90}"

alive() {
  # The pid file's process runs and is one of ours: an exited one its parent has not
  # reaped yet does not count, nor another program that got the pid later.
  [ -f "$1" ] || return 1
  local pid; pid="$(cat "$1")"
  kill -0 "$pid" 2>/dev/null || return 1
  case "$(ps -o stat= -p "$pid" 2>/dev/null)" in Z*) return 1 ;; esac
  case "$(ps -o args= -p "$pid" 2>/dev/null)" in *investigate*|*celery*) return 0 ;; esac
  return 1
}

ensure_database() {
  # A local PostgreSQL database named in the URL is created when missing.
  case "$INVESTIGATE_DATABASE_URL" in
    postgresql*@127.0.0.1:*/*|postgresql*@localhost:*/*)
      local db="${INVESTIGATE_DATABASE_URL##*/}"; db="${db%%\?*}"
      psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='$db'" \
        | grep -q 1 || createdb -h 127.0.0.1 -U postgres "$db" ;;
  esac
}

start_one() {
  # Start one process unless its pid file names a live one; its log is appended to.
  local name="$1"; shift
  if alive "$run/$name.pid"; then kept="$kept $name"; return; fi
  echo "--- $(date -u +%Y-%m-%dT%H:%M:%SZ) $(basename "$0") start" >>"$run/$name.log"
  nohup "$@" >>"$run/$name.log" 2>&1 &
  echo $! >"$run/$name.pid"
  started="$started $name"
}

start() {
  # Starts what is not running (a dead beat, a dead worker) and leaves the rest alone.
  local n="${1:-2}" pidfile name kept="" started=""
  bash "$root/scripts/ensure-services.sh"
  ensure_database
  mkdir -p "$run" "$INVESTIGATE_HOME"
  for pidfile in "$run"/*.pid; do   # forget the processes that died
    if [ -e "$pidfile" ] && ! alive "$pidfile"; then rm -f "$pidfile"; fi
  done
  "$bin" db upgrade
  for i in $(seq 1 "$n"); do
    start_one "worker-$i" "$bin" worker --name "worker$i@%h" --concurrency "$concurrency" \
      --metrics-port "$((metrics_base + i))"
  done
  local beyond=""   # workers of an earlier, larger start: said, and how to stop them
  for pidfile in "$run"/worker-*.pid; do
    [ -e "$pidfile" ] || continue
    name="$(basename "$pidfile" .pid)"
    if [ "${name#worker-}" -gt "$n" ] && alive "$pidfile"; then beyond="$beyond $name"; fi
  done
  if [ -n "$beyond" ]; then
    echo "also running, beyond the $n worker(s) asked for:$beyond ('$0 stop$beyond' stops them)"
  fi
  if ! alive "$run/beat.pid" && "$bin" health --check beat --timeout 1 >/dev/null 2>&1; then
    # One per deployment: a beat started elsewhere (by hand, another host) already sends
    # this queue's sweeps to this broker.
    echo "beat: one already runs, not started by '$0' ($("$bin" health --check beat \
      --timeout 1 2>/dev/null | grep -o 'beat on [^;,]*')); not starting another" >&2
  else
    start_one beat "$bin" beat --schedule "$INVESTIGATE_HOME/celerybeat-schedule"
  fi
  start_one metrics "$bin" metrics --port "${METRICS_PORT:-9808}"
  start_one flower "$bin" flower --port "${FLOWER_PORT:-5555}"
  if [ -z "$started" ]; then
    echo "already running:$kept; nothing to start ('$0 stop' stops them)"
    return 0
  fi
  local deadline=$((SECONDS + start_timeout)) dead name   # ready when every worker answers
  until "$bin" health --check workers --min-workers "$n" --timeout 1 >/dev/null 2>&1; do
    dead=""   # a process that exited at start (a taken port, a broken setting)
    for pidfile in "$run"/*.pid; do
      alive "$pidfile" || dead="$dead $(basename "$pidfile" .pid)"
    done
    if [ -n "$dead" ]; then
      echo "error: exited at start:$dead" >&2
      for name in $dead; do
        echo "--- $run/$name.log (last lines):" >&2
        tail -n 5 "$run/$name.log" >&2
      done
      echo "fix the cause, then '$0 start $n' again (it starts only what is not running)" >&2
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "warning: the workers are not healthy after ${start_timeout}s:" >&2
      "$bin" health --check workers --min-workers "$n" --timeout 1 2>/dev/null \
        | grep -E '^(ok|FAIL)' >&2 || true
      echo "(see $run/worker-*.log)" >&2
      break
    fi
    sleep 1
  done
  echo "started:$started${kept:+ (already running:$kept)}"
  echo "$n worker(s) of $concurrency processes (worker1@$(hostname) ...),"
  echo "metrics on http://127.0.0.1:${METRICS_PORT:-9808}/metrics (workers: $((metrics_base + 1))..$((metrics_base + n))),"
  echo "Flower on http://127.0.0.1:${FLOWER_PORT:-5555} (logs, appended to, in $run)"
}

stop() {
  # Every process, or only those named (`stop worker-3`: one fewer worker).
  local pidfile waited=0 left name pidfiles=()
  if [ "$#" -eq 0 ]; then
    pidfiles=("$run"/*.pid)
  else
    for name in "$@"; do
      if [ ! -e "$run/$name.pid" ]; then
        echo "error: '$name' is not one of this script's processes (see '$0 status')" >&2
        exit 2
      fi
      pidfiles+=("$run/$name.pid")
    done
  fi
  for pidfile in "${pidfiles[@]}"; do
    [ -e "$pidfile" ] || continue
    kill -TERM "$(cat "$pidfile")" 2>/dev/null || true   # warm shutdown
  done
  while :; do
    left=""
    for pidfile in "${pidfiles[@]}"; do
      [ -e "$pidfile" ] || continue
      if alive "$pidfile"; then left="$left $(basename "$pidfile" .pid)"; else rm -f "$pidfile"; fi
    done
    [ -z "$left" ] && break
    if [ "$waited" -ge "$stop_timeout" ]; then
      echo "still running after ${stop_timeout}s:$left (their running stages go on)." >&2
      echo "Run '$0 stop' again to keep waiting, or kill -QUIT the pid for a cold shutdown" >&2
      echo "(the interrupted stage is delivered again: late acks)." >&2
      exit 1
    fi
    sleep 1; waited=$((waited + 1))
  done
  if [ "$#" -gt 0 ]; then
    echo "stopped:$(printf ' %s' "$@") (its running stages finished: warm shutdown)"
    return 0
  fi
  echo "stopped (every running stage finished: warm shutdown)"
  local others   # a worker started by hand on this queue is not this script's to stop
  others="$("$bin" health --check workers --timeout 1 2>/dev/null \
    | grep -o 'answered ping: [^;]*' || true)"
  if [ -n "$others" ]; then
    echo "note: workers not started by '$0' still answer: ${others#answered ping: }" >&2
  fi
}

# Exit codes as LSB init scripts' status: 0 every process this script started runs, 1
# one is dead though its pid file is there (`start N` starts only what is dead), 3 none
# was started.
status() {
  local any="" dead="" pidfile name
  for pidfile in "$run"/*.pid; do
    [ -e "$pidfile" ] || continue
    name="$(basename "$pidfile" .pid)"
    any=1
    if alive "$pidfile"; then echo "$name running (pid $(cat "$pidfile"))"; else echo "$name dead"; dead=1; fi
  done
  [ -n "$any" ] || echo "nothing running (no pid files in $run)"
  # What the deployment sees, whoever started it (a worker started by hand included).
  "$bin" health --check workers --check beat --timeout 1 2>/dev/null | grep -E '^(ok|FAIL)' || true
  if [ -n "$dead" ]; then
    echo "a process is dead: \`$0 start N\` starts only what is dead" >&2
    return 1
  fi
  [ -n "$any" ] || return 3
}

case "${1:-}" in
  start) start "${2:-2}" ;;
  stop) shift; stop "$@" ;;
  status) status ;;
  *) echo "usage: $0 start [WORKERS] | stop [NAME...] | status" >&2; exit 2 ;;
esac
