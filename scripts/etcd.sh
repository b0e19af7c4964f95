#!/usr/bin/env bash
# Run a single-node etcd on loopback for abplat (tests, development, CI).
#
#   scripts/etcd.sh start|stop|status|restart|install
#
# Ports: client ABPLAT_ETCD_CLIENT_PORT (default 12379), peer ABPLAT_ETCD_PEER_PORT (12380).
# State: $ABPLAT_VAR/etcd/<client port>/{data,etcd.pid,etcd.log} (ABPLAT_VAR defaults to the
# project's var/). Our variables are never named ETCD_*: etcd reads those as its own flags.
# Installs Debian's etcd-server/etcd-client with apt-get when `etcd` is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLIENT_PORT="${ABPLAT_ETCD_CLIENT_PORT:-12379}"
PEER_PORT="${ABPLAT_ETCD_PEER_PORT:-12380}"
VAR="${ABPLAT_VAR:-$ROOT/var}"
STATE="$VAR/etcd/$CLIENT_PORT"
PID_FILE="$STATE/etcd.pid"
LOG_FILE="$STATE/etcd.log"
CLIENT_URL="http://127.0.0.1:$CLIENT_PORT"
PEER_URL="http://127.0.0.1:$PEER_PORT"
START_TIMEOUT_S=20

for port in "$CLIENT_PORT" "$PEER_PORT"; do
  if ! [[ "$port" =~ ^[0-9]+$ ]] || ((port < 1 || port > 65535)); then
    echo "etcd.sh: port '$port' is not a number in 1..65535" \
      "(ABPLAT_ETCD_CLIENT_PORT / ABPLAT_ETCD_PEER_PORT)" >&2
    exit 2
  fi
done

# etcd takes ETCD_* from the environment as flags; never let a stray one change ours.
while IFS='=' read -r name _; do
  unset "$name"
done < <(env | grep -E '^ETCD_[A-Z_]*=' || true)
export ETCDCTL_API=3

ensure_installed() {
  if command -v etcd >/dev/null && command -v etcdctl >/dev/null; then
    return
  fi
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "etcd.sh: etcd is not installed; install Debian's etcd-server and etcd-client" \
      "(apt-get install etcd-server etcd-client) as root" >&2
    exit 1
  fi
  echo "etcd.sh: installing etcd-server etcd-client with apt-get" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null
}

healthy() {
  command -v etcdctl >/dev/null &&
    etcdctl --endpoints="$CLIENT_URL" --dial-timeout=1s --command-timeout=1s \
      endpoint health >/dev/null 2>&1
}

running_pid() {
  [[ -f "$PID_FILE" ]] || return 1
  local pid
  pid="$(cat "$PID_FILE")"
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  # A recycled pid belonging to something else is not our etcd.
  grep -q etcd "/proc/$pid/comm" 2>/dev/null || return 1
  echo "$pid"
}

start() {
  if healthy; then
    echo "etcd.sh: etcd already healthy at $CLIENT_URL"
    return 0
  fi
  if pid="$(running_pid)"; then
    echo "etcd.sh: etcd (pid $pid) is running but not healthy yet; waiting" >&2
  else
    ensure_installed
    mkdir -p "$STATE"
    # setsid: the server outlives this script and the shell or test that ran it.
    setsid etcd --name abplat --data-dir "$STATE/data" \
      --listen-client-urls "$CLIENT_URL" --advertise-client-urls "$CLIENT_URL" \
      --listen-peer-urls "$PEER_URL" --initial-advertise-peer-urls "$PEER_URL" \
      --initial-cluster "abplat=$PEER_URL" --initial-cluster-state new \
      --log-level warn >>"$LOG_FILE" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PID_FILE"
  fi
  local deadline=$((SECONDS + START_TIMEOUT_S))
  until healthy; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "etcd.sh: etcd exited during start; last lines of $LOG_FILE:" >&2
      tail -n 20 "$LOG_FILE" >&2 || true
      rm -f "$PID_FILE"
      exit 1
    fi
    if ((SECONDS >= deadline)); then
      echo "etcd.sh: etcd (pid $pid) not healthy after ${START_TIMEOUT_S}s; see $LOG_FILE" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "etcd.sh: etcd healthy at $CLIENT_URL (pid $pid, data $STATE/data)"
}

stop() {
  local pid
  if ! pid="$(running_pid)"; then
    rm -f "$PID_FILE"
    if healthy; then
      echo "etcd.sh: an etcd answers at $CLIENT_URL but was not started by this script" \
        "(no pid file in $STATE); not stopping it" >&2
      exit 1
    fi
    echo "etcd.sh: etcd not running"
    return 0
  fi
  kill -TERM "$pid"
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "etcd.sh: etcd (pid $pid) ignored SIGTERM for 10s; sending SIGKILL" >&2
    kill -KILL "$pid" || true
  fi
  rm -f "$PID_FILE"
  echo "etcd.sh: etcd stopped (pid $pid)"
}

status() {
  if healthy; then
    local pid
    pid="$(running_pid || echo "unknown")"
    echo "etcd.sh: healthy at $CLIENT_URL (pid $pid)"
    return 0
  fi
  if pid="$(running_pid)"; then
    echo "etcd.sh: running (pid $pid) but not healthy at $CLIENT_URL"
    return 1
  fi
  echo "etcd.sh: not running at $CLIENT_URL"
  return 3
}

case "${1:-}" in
  install) ensure_installed ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart)
    stop
    start
    ;;
  *)
    echo "usage: $0 start|stop|status|restart|install" >&2
    exit 2
    ;;
esac
