#!/usr/bin/env bash
# Start (or check) every real service the test suite talks to, on loopback:
#   etcd and a ClickHouse server: installed from Debian packages and started by our scripts;
#   PostgreSQL, Redis, RabbitMQ: started by this machine kind; restarted here if one stopped.
# Usage: scripts/services.sh start|stop|status
set -euo pipefail
cd "$(dirname "$0")/.."

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && exec 3<&- 3>&-; }

ensure_postgres() {
  port_open 5432 && return 0
  echo "services: PostgreSQL is not answering on 5432; starting it"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
}
ensure_redis() {
  port_open 6379 && return 0
  echo "services: Redis is not answering on 6379; starting it"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
}
ensure_rabbitmq() {
  port_open 5672 && return 0
  echo "services: RabbitMQ is not answering on 5672; starting it"
  rabbitmq-server -detached
  for _ in $(seq 1 60); do port_open 5672 && return 0; sleep 1; done
  echo "services: RabbitMQ did not come up on 5672" >&2; return 1
}

case "${1:-start}" in
  start)
    ensure_postgres; ensure_redis; ensure_rabbitmq
    bash scripts/etcd.sh start
    bash scripts/clickhouse.sh start
    ;;
  stop)
    bash scripts/etcd.sh stop || true
    bash scripts/clickhouse.sh stop || true
    ;;
  status)
    for p in 5432 6379 5672; do port_open $p && echo "127.0.0.1:$p up" || echo "127.0.0.1:$p DOWN"; done
    bash scripts/etcd.sh status || true
    bash scripts/clickhouse.sh status || true
    ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
