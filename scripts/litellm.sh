#!/usr/bin/env bash
# LiteLLM's proxy as a peer of our gateway (bench/bench_gateway.py --peers nginx,litellm): the
# Python LLM proxy users would pick instead, in its own cached virtualenv outside the clone.
#
#   scripts/litellm.sh install                               # the venv (idempotent); prints its path
#   scripts/litellm.sh config DIR PORT UPSTREAM [WORKERS] [MODEL]   # write DIR/litellm.yaml, print its path
#   scripts/litellm.sh run DIR PORT UPSTREAM [WORKERS] [MODEL]      # install, config, then the proxy
#
# PORT: where it listens, on 127.0.0.1 only. UPSTREAM: the OpenAI-compatible server it forwards
# to, host:port or http://host:port (its API under /v1). WORKERS: uvicorn worker processes
# (default 1: the proxy runs in the caller's pid). MODEL: the model name clients send and the
# upstream serves (default *: every name, routed as openai/<name>). `run` execs LiteLLM, so the
# caller's pid is the proxy's process (SIGTERM stops it) and any workers are its children.
#
# Clients authenticate with the master key: $LITELLM_MASTER_KEY when set, else one generated into
# DIR/master_key (LiteLLM refuses to start without one). Health without a key or an upstream
# call: GET /health/liveliness.
#
# Offline and self-contained: no database (DATABASE_URL is unset), the bundled model cost map
# instead of fetching it at start, telemetry off, no .env read from anywhere, and the working
# directory is DIR. Logs at WARNING, so uvicorn writes no access-log line per request (as nginx
# runs with access_log off).
#
#   ABPLAT_LITELLM_VENV=/x scripts/litellm.sh install     # another place for the venv
#   ABPLAT_LITELLM_PYTHON=python3.12 ...                  # the interpreter it is built with
set -euo pipefail

VENV="${ABPLAT_LITELLM_VENV:-/var/cache/abplat/litellm}"
LITELLM_VERSION="1.108.7"
MARKER="$VENV/.abplat-installed"
WANT="litellm[proxy]==$LITELLM_VERSION recipe=1"

usage() {
  echo "usage: $0 install | config DIR PORT UPSTREAM [WORKERS] [MODEL] | run DIR PORT UPSTREAM [WORKERS] [MODEL]" >&2
  exit 2
}

# The environment every LiteLLM process here runs with (the smoke import and the proxy).
offline_env() {
  export LITELLM_LOCAL_MODEL_COST_MAP=True  # the map bundled in the wheel, no fetch at import
  export LITELLM_TELEMETRY_DISABLED=true
  export LITELLM_MODE=PRODUCTION  # no load_dotenv() of the working directory's .env
  export LITELLM_DONT_SHOW_FEEDBACK_BOX=true
  export LITELLM_LOG="${LITELLM_LOG:-WARNING}"
  unset DATABASE_URL
}

ensure_installed() {
  if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$WANT" && -x "$VENV/bin/litellm" ]]; then
    echo "$VENV"
    return
  fi
  local py="${ABPLAT_LITELLM_PYTHON:-python3.11}"
  if ! command -v "$py" >/dev/null; then
    py=python3
  fi
  if ! "$py" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
    echo "litellm.sh: LiteLLM $LITELLM_VERSION needs Python 3.10 to 3.14: set ABPLAT_LITELLM_PYTHON to one" >&2
    exit 1
  fi
  if ! mkdir -p "$(dirname "$VENV")" 2>/dev/null || ! [[ -w "$(dirname "$VENV")" ]]; then
    echo "litellm.sh: cannot write $(dirname "$VENV"): set ABPLAT_LITELLM_VENV to a writable directory" >&2
    exit 1
  fi
  echo "litellm.sh: installing litellm[proxy]==$LITELLM_VERSION into $VENV (a few minutes, once)" >&2
  if [[ ! -x "$VENV/bin/python" ]]; then
    "$py" -m venv "$VENV"
  fi
  # pip's warnings about the machine's extra local indexes are noise here.
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "litellm[proxy]==$LITELLM_VERSION" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  # Smoke: the proxy's CLI imports offline (from /, so no directory shadows a module).
  (offline_env && cd / && "$VENV/bin/python" -c \
    'import importlib.metadata as m, litellm.proxy.proxy_cli; print("litellm", m.version("litellm"))' >&2)
  echo "$WANT" >"$MARKER"
  echo "$VENV"
}

check_port() {
  if ! [[ "$1" =~ ^[0-9]+$ ]] || (($1 < 1 || $1 > 65535)); then
    echo "litellm.sh: $2 '$1' is not a port number in 1..65535" >&2
    exit 2
  fi
}

write_config() {
  local dir="$1" port="$2" upstream="${3%/}" workers="${4:-1}" model="${5:-*}"
  check_port "$port" "PORT"
  upstream="${upstream#http://}"
  if ! [[ "$upstream" =~ ^[A-Za-z0-9._-]+:[0-9]+$ ]]; then
    echo "litellm.sh: UPSTREAM '$3' must be host:port or http://host:port" >&2
    exit 2
  fi
  check_port "${upstream##*:}" "UPSTREAM's port"
  if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "litellm.sh: WORKERS '$workers' must be a whole number >= 1" >&2
    exit 2
  fi
  if ! [[ "$model" =~ ^[A-Za-z0-9._/:*-]+$ ]]; then
    echo "litellm.sh: MODEL '$model' must be a model name (letters, digits, . _ / : - or *)" >&2
    exit 2
  fi
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  # Retries off: a failed upstream request is answered once, as through nginx. The upstream
  # asks for no key; LiteLLM's OpenAI client wants one all the same.
  cat >"$dir/litellm.yaml" <<EOF
# Written by scripts/litellm.sh: LiteLLM's proxy on 127.0.0.1:$port -> http://$upstream/v1 ($workers worker(s)).
model_list:
  - model_name: "$model"
    litellm_params:
      model: "openai/$model"
      api_base: "http://$upstream/v1"
      api_key: "none"
litellm_settings:
  num_retries: 0
  request_timeout: 600
router_settings:
  num_retries: 0
general_settings:
  disable_spend_logs: true
EOF
  echo "$dir/litellm.yaml"
}

case "${1:-}" in
  install) ensure_installed ;;
  config)
    (($# >= 4)) || usage
    write_config "$2" "$3" "$4" "${5:-1}" "${6:-*}"
    ;;
  run)
    (($# >= 4)) || usage
    venv="$(ensure_installed)"
    conf="$(write_config "$2" "$3" "$4" "${5:-1}" "${6:-*}")"
    dir="$(dirname "$conf")"
    if [[ -z "${LITELLM_MASTER_KEY:-}" ]]; then
      if [[ ! -s "$dir/master_key" ]]; then
        (umask 077 && echo "sk-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')" >"$dir/master_key")
      fi
      LITELLM_MASTER_KEY="$(cat "$dir/master_key")"
      echo "litellm.sh: no LITELLM_MASTER_KEY: clients use the key in $dir/master_key" >&2
    fi
    export LITELLM_MASTER_KEY
    offline_env
    cd "$dir"
    exec "$venv/bin/litellm" --config "$conf" --host 127.0.0.1 --port "$3" --num_workers "${5:-1}"
    ;;
  *) usage ;;
esac
