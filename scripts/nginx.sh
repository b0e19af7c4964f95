#!/usr/bin/env bash
# nginx as a reference streaming proxy (bench/bench_gateway.py): the physical floor of a proxy hop.
#
#   scripts/nginx.sh install                      # Debian's nginx with apt-get, if missing
#   scripts/nginx.sh config DIR PORT UPSTREAM [WORKERS]   # write DIR/nginx.conf, print its path
#   scripts/nginx.sh run DIR PORT UPSTREAM [WORKERS]      # config, then nginx in the foreground
#
# PORT: where it listens, on 127.0.0.1 only. UPSTREAM: host:port of the server it forwards to.
# WORKERS: nginx worker processes (default 1). `run` execs nginx with `daemon off`, so the
# caller's pid is nginx's master (SIGQUIT drains, SIGTERM stops) and its workers are its children.
#
# The generated config streams as a proxy for SSE should: proxy_buffering off (each upstream
# read is written to the client at once), request buffering off, HTTP/1.1 to the upstream with
# a keepalive pool (no new upstream connection per request), no access log. Everything nginx
# writes (pid, error log, the temp dirs it insists on) is under DIR; the system's
# /etc/nginx, /var/log/nginx and /var/lib/nginx are never read or written (-p DIR -c ... -e ...).
# Installing with apt-get does not start Debian's own nginx service where policy-rc.d forbids it
# (containers); elsewhere stop it with `systemctl disable --now nginx` if you do not want it.
set -euo pipefail

usage() {
  echo "usage: $0 install | config DIR PORT UPSTREAM [WORKERS] | run DIR PORT UPSTREAM [WORKERS]" >&2
  exit 2
}

find_nginx() {
  command -v nginx 2>/dev/null || { [[ -x /usr/sbin/nginx ]] && echo /usr/sbin/nginx; } || return 1
}

ensure_installed() {
  if find_nginx >/dev/null; then
    return
  fi
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "nginx.sh: nginx is not installed; install Debian's nginx (apt-get install nginx) as root" >&2
    exit 1
  fi
  # Debian 12's nginx-light is a transitional package for nginx; install nginx itself.
  echo "nginx.sh: installing nginx with apt-get" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
}

check_port() {
  if ! [[ "$1" =~ ^[0-9]+$ ]] || (($1 < 1 || $1 > 65535)); then
    echo "nginx.sh: $2 '$1' is not a port number in 1..65535" >&2
    exit 2
  fi
}

write_config() {
  local dir="$1" port="$2" upstream="$3" workers="${4:-1}"
  check_port "$port" "PORT"
  if ! [[ "$upstream" =~ ^[A-Za-z0-9._-]+:[0-9]+$ ]]; then
    echo "nginx.sh: UPSTREAM '$upstream' must be host:port" >&2
    exit 2
  fi
  check_port "${upstream##*:}" "UPSTREAM's port"
  if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "nginx.sh: WORKERS '$workers' must be a whole number >= 1" >&2
    exit 2
  fi
  mkdir -p "$dir/tmp"
  dir="$(cd "$dir" && pwd)"
  cat >"$dir/nginx.conf" <<EOF
# Written by scripts/nginx.sh: a streaming reverse proxy on 127.0.0.1:$port -> $upstream.
daemon off;
master_process on;
worker_processes $workers;
pid $dir/nginx.pid;
error_log $dir/error.log warn;

events {
    worker_connections 8192;
}

http {
    access_log off;
    client_body_temp_path $dir/tmp/client_body;
    proxy_temp_path $dir/tmp/proxy;
    fastcgi_temp_path $dir/tmp/fastcgi;
    uwsgi_temp_path $dir/tmp/uwsgi;
    scgi_temp_path $dir/tmp/scgi;
    client_max_body_size 16m;
    keepalive_requests 1000000;
    keepalive_timeout 75s;

    upstream variant {
        server $upstream;
        keepalive 1024;
        keepalive_requests 1000000;
        # Below the upstream's own idle timeout (vLLM's uvicorn closes idle connections after
        # 5 s): nginx must drop an idle connection before the server does, or a POST sent on a
        # connection the server just closed is a 502 (nginx never retries a non-idempotent one).
        # Our clients keep theirs 4 s too (streaming/h1.py IDLE_EXPIRY_S).
        keepalive_timeout 4s;
    }

    server {
        listen 127.0.0.1:$port reuseport;
        location / {
            proxy_pass http://variant;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }
    }
}
EOF
  echo "$dir/nginx.conf"
}

case "${1:-}" in
  install) ensure_installed ;;
  config)
    (($# >= 4)) || usage
    write_config "$2" "$3" "$4" "${5:-1}"
    ;;
  run)
    (($# >= 4)) || usage
    ensure_installed
    conf="$(write_config "$2" "$3" "$4" "${5:-1}")"
    dir="$(dirname "$conf")"
    exec "$(find_nginx)" -p "$dir" -c "$conf" -e "$dir/error.log"
    ;;
  *) usage ;;
esac
