#!/usr/bin/env bash
# Start, stop or check a loopback ClickHouse server for abplat (dev and CI).
#
#   scripts/clickhouse.sh start|stop|status|restart
#
# Debian bookworm ships clickhouse-server 18.16 (old but real); we run it without systemd, as
# the invoking user, with our own minimal config under $ABPLAT_VAR/clickhouse (default
# <repo>/var/clickhouse): tcp 19000, http 18123, 127.0.0.1 only, timezone UTC.
# Ports can be overridden with ABPLAT_CH_TCP_PORT / ABPLAT_CH_HTTP_PORT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VAR="${ABPLAT_VAR:-$ROOT/var}"
DIR="$VAR/clickhouse"
TCP_PORT="${ABPLAT_CH_TCP_PORT:-19000}"
HTTP_PORT="${ABPLAT_CH_HTTP_PORT:-18123}"
PID_FILE="$DIR/server.pid"
# Debian's paths; ABPLAT_CLICKHOUSE_SERVER / ABPLAT_CLICKHOUSE_CLIENT for an installation elsewhere.
SERVER="${ABPLAT_CLICKHOUSE_SERVER:-/usr/sbin/clickhouse-server}"
CLIENT="${ABPLAT_CLICKHOUSE_CLIENT:-/usr/bin/clickhouse-client}"
DATABASES="abplat abplat_test"

log() { echo "clickhouse.sh: $*" >&2; }

ensure_installed() {
    if [[ -x "$SERVER" && -x "$CLIENT" ]]; then
        return
    fi
    if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null; then
        log "clickhouse-server is not installed ($SERVER): install Debian's clickhouse-server and" \
            "clickhouse-client as root (apt-get install clickhouse-server clickhouse-client), or set" \
            "ABPLAT_TEST_CLICKHOUSE_URL to a ClickHouse server you run"
        exit 1
    fi
    log "installing clickhouse-server and clickhouse-client from Debian (apt-get)"
    apt-get update -q
    # Debian's package does not start a service inside containers; we start our own below.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q clickhouse-server clickhouse-client
}

write_config() {
    mkdir -p "$DIR/data" "$DIR/tmp" "$DIR/user_files" "$DIR/format_schemas" "$DIR/log"
    # Regenerated on every start so a changed port or path never leaves a stale config behind.
    cat >"$DIR/config.xml" <<EOF
<?xml version="1.0"?>
<yandex>
    <logger>
        <level>warning</level>
        <log>$DIR/log/server.log</log>
        <errorlog>$DIR/log/server.err.log</errorlog>
        <size>50M</size>
        <count>2</count>
    </logger>
    <listen_host>127.0.0.1</listen_host>
    <tcp_port>$TCP_PORT</tcp_port>
    <http_port>$HTTP_PORT</http_port>
    <interserver_http_port>0</interserver_http_port>
    <max_connections>256</max_connections>
    <keep_alive_timeout>3</keep_alive_timeout>
    <max_concurrent_queries>64</max_concurrent_queries>
    <mark_cache_size>268435456</mark_cache_size>
    <path>$DIR/data/</path>
    <tmp_path>$DIR/tmp/</tmp_path>
    <user_files_path>$DIR/user_files/</user_files_path>
    <format_schema_path>$DIR/format_schemas/</format_schema_path>
    <users_config>$DIR/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <timezone>UTC</timezone>
    <mlock_executable>false</mlock_executable>
</yandex>
EOF
    # allow_experimental_low_cardinality_type lives in the profile, never in queries: chDB
    # rejects that setting name, and the same SQL must run on both backends.
    cat >"$DIR/users.xml" <<EOF
<?xml version="1.0"?>
<yandex>
    <profiles>
        <default>
            <max_memory_usage>4000000000</max_memory_usage>
            <load_balancing>random</load_balancing>
            <allow_experimental_low_cardinality_type>1</allow_experimental_low_cardinality_type>
        </default>
    </profiles>
    <users>
        <default>
            <password></password>
            <networks>
                <ip>127.0.0.1</ip>
                <ip>::1</ip>
            </networks>
            <profile>default</profile>
            <quota>default</quota>
        </default>
    </users>
    <quotas>
        <default>
            <interval>
                <duration>3600</duration>
                <queries>0</queries>
                <errors>0</errors>
                <result_rows>0</result_rows>
                <read_rows>0</read_rows>
                <execution_time>0</execution_time>
            </interval>
        </default>
    </quotas>
</yandex>
EOF
}

running_pid() {
    [[ -f "$PID_FILE" ]] || return 1
    local pid
    pid="$(cat "$PID_FILE" 2>/dev/null || true)"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

client() {
    "$CLIENT" --host 127.0.0.1 --port "$TCP_PORT" --user default "$@"
}

wait_ready() {
    local i
    for i in $(seq 1 150); do
        if client --query "SELECT 1" >/dev/null 2>&1; then
            return 0
        fi
        if ! running_pid >/dev/null; then
            log "server exited during start; see $DIR/log/server.err.log"
            tail -n 20 "$DIR/log/server.err.log" >&2 2>/dev/null || true
            return 1
        fi
        sleep 0.1
    done
    log "server did not accept queries within 15 s on 127.0.0.1:$TCP_PORT"
    return 1
}

create_databases() {
    local db
    for db in $DATABASES; do
        client --query "CREATE DATABASE IF NOT EXISTS $db"
    done
}

start() {
    ensure_installed
    local pid
    if pid="$(running_pid)"; then
        log "already running (pid $pid) on 127.0.0.1:$TCP_PORT"
        wait_ready
        create_databases
        return 0
    fi
    write_config
    rm -f "$PID_FILE"
    "$SERVER" --config-file="$DIR/config.xml" --daemon --pid-file="$PID_FILE" \
        >>"$DIR/log/stdout.log" 2>&1
    # The daemon writes its pid file a moment after forking.
    local i
    for i in $(seq 1 50); do
        [[ -s "$PID_FILE" ]] && break
        sleep 0.1
    done
    wait_ready
    create_databases
    log "running (pid $(cat "$PID_FILE")) tcp 127.0.0.1:$TCP_PORT http 127.0.0.1:$HTTP_PORT"
}

stop() {
    local pid
    if ! pid="$(running_pid)"; then
        log "not running"
        rm -f "$PID_FILE"
        return 0
    fi
    kill "$pid"
    local i
    for i in $(seq 1 100); do
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PID_FILE"
            log "stopped (pid $pid)"
            return 0
        fi
        sleep 0.1
    done
    log "pid $pid did not exit within 10 s; sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$PID_FILE"
}

status() {
    local pid
    if pid="$(running_pid)" && client --query "SELECT 1" >/dev/null 2>&1; then
        echo "running (pid $pid) tcp 127.0.0.1:$TCP_PORT http 127.0.0.1:$HTTP_PORT"
        return 0
    fi
    echo "not running"
    return 1
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) status ;;
restart)
    stop
    start
    ;;
*)
    echo "usage: $0 start|stop|status|restart" >&2
    exit 2
    ;;
esac
