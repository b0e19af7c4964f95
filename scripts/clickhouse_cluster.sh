#!/usr/bin/env bash
# Start, stop or check a local two-shard ClickHouse cluster for abplat's cluster tests.
#
#   scripts/clickhouse_cluster.sh start|stop|status|restart
#
# Two servers made by scripts/clickhouse.sh (same package, same minimal config), each with its
# own data directory beside the single server's ($ABPLAT_VAR/clickhouse-shard1/clickhouse and
# ...-shard2/clickhouse, default ABPLAT_VAR <repo>/var) and a config.d/cluster.xml naming both in
# <remote_servers> as cluster `abplat_test_cluster`: shard 1 native 19101 / HTTP 18201, shard 2
# native 19102 / HTTP 18202 (ABPLAT_CH_CLUSTER_TCP_PORTS / ABPLAT_CH_CLUSTER_HTTP_PORTS, two
# space-separated ports each, change them). No ZooKeeper/Keeper: plain MergeTree tables on each
# shard, created by abplat's migrations on every server (docs/clickhouse-cluster.md).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VAR="${ABPLAT_VAR:-$ROOT/var}"
CLUSTER=abplat_test_cluster
read -r -a TCP_PORTS <<<"${ABPLAT_CH_CLUSTER_TCP_PORTS:-19101 19102}"
read -r -a HTTP_PORTS <<<"${ABPLAT_CH_CLUSTER_HTTP_PORTS:-18201 18202}"

log() { echo "clickhouse_cluster.sh: $*" >&2; }

if [[ ${#TCP_PORTS[@]} -ne 2 || ${#HTTP_PORTS[@]} -ne 2 ]]; then
    log "ABPLAT_CH_CLUSTER_TCP_PORTS and ABPLAT_CH_CLUSTER_HTTP_PORTS need two ports each"
    exit 2
fi

shard_var() { echo "$VAR/clickhouse-shard$1"; }

# One server through scripts/clickhouse.sh: its ABPLAT_VAR is the shard's directory, so its
# data, config and pid file live in <shard dir>/clickhouse.
shard() {
    local i="$1" action="$2"
    ABPLAT_VAR="$(shard_var "$i")" ABPLAT_CH_TCP_PORT="${TCP_PORTS[$((i - 1))]}" \
        ABPLAT_CH_HTTP_PORT="${HTTP_PORTS[$((i - 1))]}" bash "$ROOT/scripts/clickhouse.sh" "$action"
}

# ClickHouse merges every file of config.d/ beside config.xml into it (clickhouse.sh regenerates
# config.xml only, so this file stays): the cluster, one replica per shard.
write_cluster_config() {
    local i dir
    for i in 1 2; do
        dir="$(shard_var "$i")/clickhouse/config.d"
        mkdir -p "$dir"
        cat >"$dir/cluster.xml" <<EOF
<?xml version="1.0"?>
<yandex>
    <remote_servers>
        <$CLUSTER>
            <shard>
                <replica><host>127.0.0.1</host><port>${TCP_PORTS[0]}</port></replica>
            </shard>
            <shard>
                <replica><host>127.0.0.1</host><port>${TCP_PORTS[1]}</port></replica>
            </shard>
        </$CLUSTER>
    </remote_servers>
</yandex>
EOF
    done
}

# Each server must see the whole cluster: a distributed query from either reaches both.
check_cluster() {
    local port n
    for port in "${TCP_PORTS[@]}"; do
        n="$(/usr/bin/clickhouse-client --host 127.0.0.1 --port "$port" --query \
            "SELECT count() FROM cluster('$CLUSTER', system.one)")"
        if [[ "$n" != 2 ]]; then
            log "cluster $CLUSTER seen from 127.0.0.1:$port: expected 2 shards to answer, got '$n'"
            return 1
        fi
    done
}

start() {
    write_cluster_config
    shard 1 start
    shard 2 start
    check_cluster
    log "cluster $CLUSTER running: 127.0.0.1:${TCP_PORTS[0]} and 127.0.0.1:${TCP_PORTS[1]} (native)"
}

stop() {
    shard 1 stop || true
    shard 2 stop || true
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status)
    rc=0
    shard 1 status || rc=1
    shard 2 status || rc=1
    exit $rc
    ;;
restart)
    stop
    start
    ;;
*)
    echo "usage: $0 start|stop|status|restart" >&2
    exit 2
    ;;
esac
