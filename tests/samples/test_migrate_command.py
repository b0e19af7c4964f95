"""python manage.py clickhouse_migrate [--show] against the configured store."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from samples import factory


@pytest.mark.services
def test_migrate_command_applies_then_reports_nothing_to_do(settings, make_store):
    store = make_store("server")  # fresh database name, dropped after the test
    settings.CLICKHOUSE_URL = f"clickhouse://default:@127.0.0.1:19000/{store.database}"
    factory._cache.clear()
    try:
        show = io.StringIO()
        call_command("clickhouse_migrate", "--show", stdout=show)
        assert "[ ] 0001 create samples" in show.getvalue()

        out = io.StringIO()
        call_command("clickhouse_migrate", stdout=out)
        assert "applied 0001 on clickhouse-server" in out.getvalue()
        out = io.StringIO()
        call_command("clickhouse_migrate", stdout=out)
        assert "no migrations to apply" in out.getvalue()

        show = io.StringIO()
        call_command("clickhouse_migrate", "--show", stdout=show)
        assert "[X] 0001 create samples" in show.getvalue()
    finally:
        factory._cache.clear()


def test_store_from_config_picks_the_server_when_a_url_is_set(chdb_dir):
    server = factory.store_from_config("clickhouse://default:@127.0.0.1:19000/abplat_test", "")
    assert server.backend_name == "clickhouse-server" and server.database == "abplat_test"
    embedded = factory.store_from_config("", chdb_dir)
    assert embedded.backend_name == "chdb" and embedded.database == "abplat"


def test_store_from_config_without_either_setting_says_what_to_set():
    import pytest

    with pytest.raises(ValueError, match="ABPLAT_CLICKHOUSE_URL .* ABPLAT_CHDB_PATH"):
        factory.store_from_config("", "")
