#!/usr/bin/env bash
# Start Redis and PostgreSQL when they are not running (the test-suite, `deploy/cluster.sh`).
# The commands are this machine kind's own (see docs/operations.md). It installs nothing;
# the browser the report test needs is `scripts/ensure-chromium.sh`'s (`make test` runs both).
set -u
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "starting redis-server"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
  echo "starting postgresql"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
for _ in $(seq 1 30); do
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "warning: redis or postgresql did not come up; tests that need them will fail" >&2
exit 0
