#!/usr/bin/env bash
# Run the distributed set on one machine: PostgreSQL store, Redis broker and locks,
# N Celery workers on the case queue and Flower.  Usage:
#   deploy/cluster.sh start [WORKERS]   # default 2 workers, 2 processes each
#   deploy/cluster.sh stop
#   deploy/cluster.sh status
# Settings come from deploy/cluster.env (copy cluster.env.example) or the environment.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
run="${INVESTIGATE_RUN_DIR:-$root/var/cluster}"
bin="${INVESTIGATE_BIN:-$root/.venv/bin/investigate}"
[ -f "$here/cluster.env" ] && set -a && . "$here/cluster.env" && set +a
export INVESTIGATE_DATABASE_URL="${INVESTIGATE_DATABASE_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/investigation}"
export INVESTIGATE_BROKER_URL="${INVESTIGATE_BROKER_URL:-redis://127.0.0.1:6379/0}"

start() {
  local n="${1:-2}"
  bash "$root/scripts/ensure-services.sh"
  case "$INVESTIGATE_DATABASE_URL" in
    postgresql*/investigation)
      psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='investigation'" \
        | grep -q 1 || createdb -h 127.0.0.1 -U postgres investigation ;;
  esac
  mkdir -p "$run"
  for i in $(seq 1 "$n"); do
    beat=""; [ "$i" = 1 ] && beat="--beat"   # exactly one worker runs the recovery sweep
    nohup "$bin" worker --concurrency 2 $beat >"$run/worker-$i.log" 2>&1 &
    echo $! >"$run/worker-$i.pid"
  done
  nohup "$bin" flower --port "${FLOWER_PORT:-5555}" >"$run/flower.log" 2>&1 &
  echo $! >"$run/flower.pid"
  echo "started $n worker(s) and Flower on http://127.0.0.1:${FLOWER_PORT:-5555} (logs in $run)"
}

stop() {
  for pidfile in "$run"/*.pid; do
    [ -e "$pidfile" ] || continue
    kill -TERM "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  done
  echo "stopped (workers finish or requeue their current stage: late acks)"
}

status() {
  local any=""
  for pidfile in "$run"/*.pid; do
    [ -e "$pidfile" ] || continue
    name="$(basename "$pidfile" .pid)"
    any=1
    if kill -0 "$(cat "$pidfile")" 2>/dev/null; then echo "$name running"; else echo "$name dead"; fi
  done
  [ -n "$any" ] || echo "nothing running (no pid files in $run)"
}

case "${1:-}" in
  start) start "${2:-2}" ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start [WORKERS] | stop | status" >&2; exit 2 ;;
esac
