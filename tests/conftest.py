"""Root fixtures: users in each role, API clients, and experiment documents."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth.models import Group, User
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from experiments import services
from samples.store import SampleStore
from tests.pki import PKI, make_pki
from tests.sample_dbs import SessionDatabases, open_store

# No per-example deadline: wall-clock limits flake on a loaded 2-core CI machine (speed is
# measured in bench/); derandomized so a CI failure reproduces on a developer's machine.
hypothesis_settings.register_profile("abplat", deadline=None, derandomize=True, print_blob=True)
hypothesis_settings.load_profile("abplat")

DEMO_DOCUMENT = {
    "key": "ttft-opt",
    "name": "TTFT optimizations",
    "hypothesis": "AWQ + FlashAttention-2 keeps 99.2% of first tokens under 200 ms",
    "sla": {"ttft_ms": 200, "target": 0.992},
    "variants": [
        {
            "key": "fp16",
            "control": True,
            "weight": 34,
            "endpoint": "http://127.0.0.1:8100/v1",
            "model": "tiny-llama",
            "api": "chat",
            "factors": {"quantization": "none", "attention": "sdpa"},
            "engine_args": {"dtype": "float16"},
        },
        {
            "key": "awq",
            "weight": 33,
            "endpoint": "http://127.0.0.1:8101/v1",
            "model": "tiny-llama",
            "api": "chat",
            "factors": {"quantization": "awq", "attention": "sdpa"},
            "engine_args": {"quantization": "awq"},
        },
        {
            "key": "awq-fa2",
            "weight": 33,
            "endpoint": "http://127.0.0.1:8102/v1",
            "model": "tiny-llama",
            "api": "completions",
            "factors": {"quantization": "awq", "attention": "flash_attn_2"},
            "engine_args": {"quantization": "awq", "attention_backend": "FLASH_ATTN"},
        },
    ],
}


DB_FIXTURES = {
    "db",
    "transactional_db",
    "django_db_setup",
    "live_server",
    "admin_client",
    "django_user_model",
}


def pytest_collection_modifyitems(items):
    # `make test` runs the tests that touch the database a second time on PostgreSQL.
    for item in items:
        if item.get_closest_marker("django_db") or DB_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.database)


@pytest.fixture
def document():
    """A valid experiment document; each test gets its own copy to mutate."""
    return copy.deepcopy(DEMO_DOCUMENT)


def _user(username: str, role: str | None = None, **extra) -> User:
    extra.setdefault("is_staff", role is not None)  # role users work in the admin
    user = User.objects.create_user(username=username, password="pw-" + username, **extra)
    if role:
        user.groups.add(Group.objects.get(name=role))
    return user


def _ensure_role_groups() -> None:
    # transaction=True tests flush the tables the data migrations filled; put the roles back.
    import importlib

    from django.apps import apps

    importlib.import_module("experiments.migrations.0002_role_groups").create_groups(apps, None)
    importlib.import_module("workers.migrations.0002_sre_operates_replays").grant_replay_roles(apps, None)


@pytest.fixture
def users(db):
    """One user per role, plus a user in no group and a superuser."""
    _ensure_role_groups()
    return {
        "product": _user("pat", "product"),
        "sre": _user("sam", "sre"),
        "analyst": _user("ana", "analyst"),
        "nobody": _user("nob"),
        "admin": _user("root", is_superuser=True, is_staff=True),
    }


@pytest.fixture
def client_for(users):
    def make(role: str | None) -> APIClient:
        client = APIClient()
        if role is not None:
            client.force_authenticate(users[role])
        return client

    return make


@pytest.fixture
def experiment(db, document, users):
    from experiments.services import apply_document

    return apply_document(document, actor=users["product"]).experiment


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # PBKDF2's deliberate slowness buys nothing in tests.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(scope="session")
def chdb_dir() -> str:
    """The one chDB data directory of this test process (chDB allows one per process): the
    session's ABPLAT_VAR/chdb, which the Django settings' embedded store uses too."""
    from django.conf import settings

    return str(settings.CHDB_PATH)


@pytest.fixture(scope="session")
def clickhouse_server() -> str:
    """The real ClickHouse server's test URL; fails (never skips) when it is not running."""
    from samples.backends.clickhouse import ClickHouseServerBackend
    from tests.plugin import SERVER_URL

    probe = ClickHouseServerBackend(SERVER_URL, tries=1)
    try:
        probe.ping()
    except Exception as e:
        pytest.fail(
            f"ClickHouse server not reachable at {SERVER_URL} ({e}). Start it with: scripts/clickhouse.sh start",
            pytrace=False,
        )
    finally:
        probe.close()
    return SERVER_URL


SESSION_DATABASES = pytest.StashKey[SessionDatabases]()


@pytest.fixture(scope="session")
def session_databases(request, chdb_dir: str) -> Iterator[SessionDatabases]:
    """The session's migrated sample-store database of each backend (tests/sample_dbs.py),
    built when a test first asks for it and dropped when the session ends."""
    dbs = request.config.stash[SESSION_DATABASES] = SessionDatabases(chdb_dir)
    yield dbs
    dbs.drop_all()


@pytest.fixture
def shared_database(request, session_databases) -> Callable[[str], str]:
    """shared_database(kind) -> the name of the session's database of kind "chdb" or "server",
    migrated, and empty when this test starts (what an earlier test wrote is truncated; an
    earlier test's schema change got a new database). Every fixture of one test gets the same."""
    names: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in names:
            if kind == "server":
                request.getfixturevalue("clickhouse_server")  # fails, naming the fix, when it is down
            names[kind] = session_databases.acquire(kind, request.node.nodeid)
        return names[kind]

    return get


@pytest.fixture
def shared_store(shared_database, chdb_dir) -> Iterator[Callable[..., SampleStore]]:
    """shared_store(kind, **server_kw) -> a store object of its own (closed after the test) on
    the session's migrated, empty database of that kind. A test that drops the database, alters
    its schema or writes to the migrations table takes make_store (tests/samples/conftest) instead."""
    made: list[SampleStore] = []

    def make(kind: str, **kw) -> SampleStore:
        store = open_store(kind, shared_database(kind), chdb_dir, **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture(params=["chdb", "server"])
def sample_store(request, settings, shared_database, chdb_dir, tmp_path):
    """The Django-configured sample store, on chDB and on the server: the session's migrated
    database of that kind, empty when the test starts (shared_database)."""
    from samples import factory
    from tests.plugin import server_url_for

    database = shared_database(request.param)
    settings.SPOOL_DIR = tmp_path / "spool"
    if request.param == "chdb":
        settings.CLICKHOUSE_URL, settings.CHDB_PATH, settings.CHDB_DATABASE = "", chdb_dir, database
    else:
        settings.CLICKHOUSE_URL = server_url_for(database, request.getfixturevalue("clickhouse_server"))
    factory._cache.clear()  # no store object of an earlier test (its replaced methods, its caches)
    store = factory.sample_store()
    store.check_schema()  # as migrate() on a fresh database did: the process's store knows it is current
    yield store
    factory._cache.clear()


def pytest_terminal_summary(terminalreporter):
    """Name the tests after which the session's sample-store database had to be rebuilt (they
    changed its schema or migrations table: they should take a database of their own)."""
    dbs = terminalreporter.config.stash.get(SESSION_DATABASES, None)
    if dbs is None or not dbs.rebuilds:
        return
    terminalreporter.section("sample store: session database rebuilt")
    for user, reason in dbs.rebuilds:
        terminalreporter.write_line(f"after {user or '(unknown)'}: {reason}")


@pytest.fixture(autouse=True)
def weights_dir(settings, tmp_path):
    """A fresh local weights store (and router) for every test: no test sees another's weights."""
    from experiments.weights import process

    settings.ETCD_ENDPOINTS = []
    settings.WEIGHTS_DIR = tmp_path / "weights"
    process.reset_for_tests()
    yield settings.WEIGHTS_DIR
    process.reset_for_tests()


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> PKI:
    """A private CA and a server certificate for 127.0.0.1 it signs (TLS variants)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def sims():
    """Three fast simulators (in threads of this process) standing in for the demo's variants."""
    from simulator.serve import start_in_thread

    handles = {name: start_in_thread("fast", model="tiny-llama") for name in ("fp16", "awq", "awq-fa2")}
    yield handles
    for h in handles.values():
        h.stop()


@pytest.fixture
def running(db, document, sims, users):
    """The test document's experiment, its variants on the simulators, started (weights published)."""
    for v in document["variants"]:
        v["endpoint"] = sims[v["key"]].url + "/v1"
        v["api"] = "chat"
    experiment = services.apply_document(document, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    return experiment


@pytest.fixture
def recording_sim(monkeypatch):
    """The fast simulator (model tiny-llama) in a thread, recording (path, Authorization) of each
    request it gets: what a variant received, secrets included."""
    seen: list[tuple[str, str]] = []
    from simulator import serve

    build = serve.build_server

    def recording(*args, **kwargs):
        server = build(*args, **kwargs)
        inner = server.config.app

        async def app(scope, receive, send):
            if scope["type"] == "http":
                seen.append((scope["path"], dict(scope["headers"]).get(b"authorization", b"").decode()))
            await inner(scope, receive, send)

        server.config.app = app
        return server

    with monkeypatch.context() as patch:
        patch.setattr(serve, "build_server", recording)
        handle = serve.start_in_thread("fast", model="tiny-llama")
    yield handle, seen
    handle.stop()
