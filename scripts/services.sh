#!/usr/bin/env bash
# Start (or check) every real service the test suite talks to. Each is given by a URL; the
# defaults (as in the Makefile) are this project's services on loopback:
#   TEST_POSTGRES_URL, ABPLAT_TEST_REDIS_URL, ABPLAT_TEST_ETCD_ENDPOINTS,
#   ABPLAT_TEST_CLICKHOUSE_URL, ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS.
# A service on loopback that is not answering is started here: etcd and ClickHouse by our
# scripts (which install Debian's packages when run as root with apt-get), Redis and PostgreSQL
# from this machine's own installation (Redis is installed the same way when missing). A service
# elsewhere is only checked. Last, scripts/doctor.sh checks each one with its real protocol and
# fails naming what is missing and how to provide it: nothing is skipped silently.
# Usage: scripts/services.sh start|stop|status
set -euo pipefail
cd "$(dirname "$0")/.."
VAR="${ABPLAT_VAR:-$PWD/var}"

export TEST_POSTGRES_URL="${TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/abplat}"
export ABPLAT_TEST_REDIS_URL="${ABPLAT_TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
export ABPLAT_TEST_ETCD_ENDPOINTS="${ABPLAT_TEST_ETCD_ENDPOINTS:-127.0.0.1:12379}"
export ABPLAT_TEST_CLICKHOUSE_URL="${ABPLAT_TEST_CLICKHOUSE_URL:-clickhouse://default:@127.0.0.1:19000/abplat_test}"
export ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS="${ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS:-clickhouse://default:@127.0.0.1:19101/abplat_test,clickhouse://default:@127.0.0.1:19102/abplat_test}"

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && exec 3<&- 3>&-; }
# "host port" of a URL or host:port (its default port when it names none).
addr() {
  local rest="${1#*://}"
  rest="${rest%%/*}"
  rest="${rest##*@}"
  if [[ "$rest" == *:* ]]; then echo "${rest%:*} ${rest##*:}"; else echo "$rest $2"; fi
}
loopback() { [[ "$1" == 127.0.0.1 || "$1" == localhost ]]; }
can_install() { [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null; }
wait_port() { for _ in $(seq 1 "$3"); do port_open "$1" "$2" && return 0; sleep 1; done; return 1; }

ensure_postgres() {
  local host port
  read -r host port <<<"$(addr "$TEST_POSTGRES_URL" 5432)"
  port_open "$host" "$port" && return 0
  loopback "$host" || return 0  # elsewhere: the doctor says it is not answering
  if [[ "$(id -u)" -eq 0 ]] && command -v pg_ctlcluster >/dev/null && [[ -d /etc/postgresql ]]; then
    echo "services: PostgreSQL is not answering on $port; starting this machine's clusters"
    local version
    for version in /etc/postgresql/*/; do
      pg_ctlcluster --skip-systemctl-redirect "$(basename "$version")" main start || true
    done
    wait_port "$host" "$port" 30 || true
  fi
}
ensure_redis() {
  local host port
  read -r host port <<<"$(addr "$ABPLAT_TEST_REDIS_URL" 6379)"
  port_open "$host" "$port" && return 0
  loopback "$host" || return 0
  if ! command -v redis-server >/dev/null && can_install; then
    echo "services: installing redis-server with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  fi
  command -v redis-server >/dev/null || return 0
  echo "services: Redis is not answering on $port; starting it (data in $VAR/redis)"
  mkdir -p "$VAR/redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$port" --save "" --appendonly no \
    --dir "$VAR/redis" --logfile "$VAR/redis/redis.log"
  wait_port "$host" "$port" 10 || true
}
ensure_rabbitmq() {
  # No test uses RabbitMQ (the broker tests run on Redis); started when installed, for manual
  # runs with ABPLAT_BROKER_URL=amqp://..., and never a failure.
  port_open 127.0.0.1 5672 && return 0
  command -v rabbitmq-server >/dev/null || return 0
  echo "services: RabbitMQ is not answering on 5672; starting it"
  rabbitmq-server -detached || true
  wait_port 127.0.0.1 5672 60 || echo "services: RabbitMQ did not come up on 5672 (not needed by the tests)" >&2
}
ensure_etcd() {
  local host port
  read -r host port <<<"$(addr "${ABPLAT_TEST_ETCD_ENDPOINTS%%,*}" 2379)"
  loopback "$host" || return 0
  ABPLAT_ETCD_CLIENT_PORT="$port" ABPLAT_ETCD_PEER_PORT="${ABPLAT_ETCD_PEER_PORT:-$((port + 1))}" \
    bash scripts/etcd.sh start
}
ensure_clickhouse() {
  local host port
  read -r host port <<<"$(addr "$ABPLAT_TEST_CLICKHOUSE_URL" 9000)"
  port_open "$host" "$port" && return 0
  loopback "$host" || return 0
  ABPLAT_CH_TCP_PORT="$port" bash scripts/clickhouse.sh start
}
ensure_clickhouse_cluster() {
  local url host port down=0
  for url in ${ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS//,/ }; do
    read -r host port <<<"$(addr "$url" 9000)"
    loopback "$host" || return 0  # a cluster elsewhere: only checked
    port_open "$host" "$port" || down=1
  done
  ((down)) || return 0
  bash scripts/clickhouse_cluster.sh start  # two shards for tests/samples/test_cluster.py
}

case "${1:-start}" in
  start)
    # Each start may fail; the doctor then names every service still missing.
    ensure_postgres || true
    ensure_redis || true
    ensure_rabbitmq
    ensure_etcd || true
    ensure_clickhouse || true
    ensure_clickhouse_cluster || true
    bash scripts/doctor.sh --only services --create-databases
    ;;
  stop)
    bash scripts/etcd.sh stop || true
    bash scripts/clickhouse.sh stop || true
    bash scripts/clickhouse_cluster.sh stop || true
    ;;
  status)
    bash scripts/doctor.sh --only services || true
    bash scripts/etcd.sh status || true
    bash scripts/clickhouse.sh status || true
    ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
