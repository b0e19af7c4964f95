"""The sample store on a ClickHouse cluster: Distributed tables over every shard's local tables.

ABPLAT_CLICKHOUSE_URL names one server of the cluster (the entry: queries and inserts go there)
and ABPLAT_CLICKHOUSE_CLUSTER the cluster of its <remote_servers> config. Which servers make the
cluster is read from that server's system.clusters (every replica of every shard), reached with
the URL's user, password and database: the servers' own definition, so abplat can never migrate
another set of servers than the one the Distributed tables read (docs/clickhouse-cluster.md).

- Migrations run on every server (samples.cluster: `<table>_local` + Distributed `<table>`); no
  ZooKeeper/Keeper is needed, which `ON CLUSTER` DDL would.
- Inserts go through the Distributed tables with insert_distributed_sync=1: an insert returns
  once every shard has its rows (the default queues them on the entry's disk and sends them
  later, so a read right after would miss them, and a lost entry disk would lose them). A
  retried insert sends each row to the same shard again (samples.cluster's sharding keys), where
  the ReplacingMergeTree collapses the copies.
- distributed_product_mode='global': a subquery over a Distributed table inside a query over
  another (the report's `build_id IN (SELECT ... FROM rollup_builds FINAL)`) runs once, on the
  entry, and its result goes to every shard (GLOBAL IN); 18.16's default refuses such queries.
- OPTIMIZE, TRUNCATE and ALTER ... DELETE, which a Distributed table refuses or ignores, run on
  every server's local table (samples.cluster.per_shard_form); SampleStore.deduplicate runs on
  each server (the duplicates of one request are on one shard).
- Queries grouping the samples by user (the per-user moments) run on one replica of each shard's
  `samples_local` alone when the samples are sharded by the unit (unit_shards): the entry then
  merges a few rows per arm instead of every user's partial sums. A cluster whose Distributed
  samples table older code made (sharded by the sorting key, each user on every shard) is read
  through the Distributed table as before; which one it is, the entry's system.tables says.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from samples import cluster as clustermod
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.schema import SAMPLES_TABLE
from samples.sql import bind
from samples.store import MIGRATE_ALL_COMMAND, StoreError, check_ident

# ALL_CONNECTION_TRIES_FAILED: the entry could not reach a shard (down, restarting): retry.
_SHARD_UNREACHABLE = 279


class ClickHouseClusterBackend(ClickHouseServerBackend):
    backend_name = "clickhouse-cluster"

    def __init__(self, url: str, cluster: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.cluster = check_ident(cluster, "ClickHouse cluster (ABPLAT_CLICKHOUSE_CLUSTER)")
        self._server_kw = kw
        self._url_parts = urllib.parse.urlsplit(url)
        self._conn_kwargs["settings"] = {"insert_distributed_sync": 1, "distributed_product_mode": "global"}
        self._servers: list[ClickHouseServerBackend] | None = None
        self._shard_nums: list[int] = []  # each server's shard_num, in servers() order
        self._by_unit: bool | None = None  # samples_sharded_by_unit(), once read
        self._tables = clustermod.distributed_tables()

    def describe(self) -> str:
        return f"{self.backend_name} {self.cluster} via {self.url_safe}"

    @staticmethod
    def _is_transient(e: BaseException) -> bool:
        from clickhouse_driver import errors

        if isinstance(e, errors.ServerException) and e.code == _SHARD_UNREACHABLE:
            # 18.16 reports a shard that lacks the local table the same way ("All connection
            # tries failed ... There is no table db.t_local on server"): that is a schema to
            # migrate, not an outage to wait out (SampleStore._explained names the command).
            return "There is no table" not in str(e)
        return ClickHouseServerBackend._is_transient(e)

    # ---- the servers of the cluster ------------------------------------------------------
    def servers(self) -> list[ClickHouseServerBackend]:
        """One store per server of the cluster (every replica of every shard), as the entry's
        system.clusters lists them; each makes its tables in the cluster form. Read once."""
        if self._servers is None:
            rows = self._system(
                bind(
                    "SELECT shard_num, replica_num, host_name, port FROM system.clusters "
                    "WHERE cluster = %(c)s ORDER BY shard_num, replica_num",
                    {"c": self.cluster},
                )
            )
            if not rows:
                known = self._system("SELECT DISTINCT cluster FROM system.clusters ORDER BY cluster")
                raise StoreError(
                    f"ABPLAT_CLICKHOUSE_CLUSTER={self.cluster}: {self.url_safe} has no such cluster in "
                    f"its remote_servers config (it has: {', '.join(r[0] for r in known) or 'none'})"
                )
            self._servers = [self._server(host, int(port)) for _shard, _replica, host, port in rows]
            self._shard_nums = [int(shard) for shard, _replica, _host, _port in rows]
        return self._servers

    def shards(self) -> list[tuple[int, ClickHouseServerBackend]]:
        """(shard_num, its first replica) for every shard: each shard's rows once."""
        servers = self.servers()  # reads the shard numbers with them
        first: dict[int, ClickHouseServerBackend] = {}
        for num, server in zip(self._shard_nums, servers, strict=True):
            first.setdefault(num, server)
        return sorted(first.items())

    def samples_sharded_by_unit(self) -> bool:
        """Whether the entry's Distributed samples table shards by the unit
        (samples.cluster.SAMPLES_SHARDING_KEY, as this code's migrations make it), not by the
        sorting key (a cluster made by older code: CREATE TABLE IF NOT EXISTS kept it). Read once
        per store object: after the table is recreated, a process sees it when it restarts. No
        table yet (not migrated): False, and asked again next time."""
        if self._by_unit is None:
            rows = self._system(
                bind(
                    "SELECT engine_full FROM system.tables WHERE database = %(db)s AND name = %(t)s",
                    {"db": self.database, "t": SAMPLES_TABLE},
                )
            )
            if not rows:
                return False
            self._by_unit = clustermod.sharded_by_unit(rows[0][0])
        return self._by_unit

    def unit_shards(self) -> list[tuple[str, Any, str]]:
        """StoreBase.unit_shards: each shard's `samples_local` (its first replica) when the
        samples are sharded by the unit, else the Distributed table through the entry."""
        if not self.samples_sharded_by_unit():
            return super().unit_shards()
        local = clustermod.local_name(SAMPLES_TABLE)
        return [
            (f"shard {num} of cluster {self.cluster} ({server.url_safe})", server, local)
            for num, server in self.shards()
        ]

    def _system(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows of a query on system tables, connected to the `default` database (the store's
        own may not exist yet)."""
        return self._run(lambda c: c.execute(sql), "read system tables", database="default")

    def _server(self, host: str, port: int) -> ClickHouseServerBackend:
        p = self._url_parts
        auth = p.netloc.rsplit("@", 1)[0] + "@" if "@" in p.netloc else ""
        netloc = f"{auth}[{host}]:{port}" if ":" in host else f"{auth}{host}:{port}"
        server = ClickHouseServerBackend(
            urllib.parse.urlunsplit(p._replace(netloc=netloc)), **self._server_kw
        )
        server.cluster = self.cluster
        return server

    # ---- schema: on every server ---------------------------------------------------------
    def ensure_database(self) -> None:
        for server in self.servers():
            server.ensure_database()

    def migrate(self) -> list[int]:
        """Every server's migrations (SampleStore.migrate on each, in the cluster form); the
        versions applied on any of them by this call."""
        done: set[int] = set()
        for server in self.servers():
            done.update(server.migrate())
        self._schema_ok = True
        return sorted(done)

    def migration_status(self) -> list[dict[str, Any]]:
        """As SampleStore.migration_status: applied when applied on every server."""
        per_server = [server.migration_status() for server in self.servers()]
        return [
            {
                **entries[0],
                "applied": all(e["applied"] for e in entries),
                "checksum_ok": all(e["checksum_ok"] for e in entries),
            }
            for entries in zip(*per_server, strict=True)
        ]

    def _missing_migrations(self) -> str:
        missing = {server.url_safe: server._pending_versions() for server in self.servers()}
        return "; ".join(
            f"{url} lacks {', '.join(f'{v:04d}' for v in versions)}"
            for url, versions in missing.items()
            if versions
        )

    def _not_migrated_text(self, missing: str) -> str:
        return (
            f"the sample store ({self.describe()}) is not migrated on every server: {missing}. Run "
            f"`{MIGRATE_ALL_COMMAND}` (it applies the sample store's migrations on every server of "
            "the cluster; `python manage.py clickhouse_migrate` applies only those)."
        )

    # ---- statements a Distributed table cannot run ---------------------------------------
    def _command(self, sql: str) -> None:
        local = clustermod.per_shard_form(sql, self._tables)
        if local is None:
            super()._command(sql)
            return
        for server in self.servers():
            server._command(local)

    def deduplicate(self, run_id: int | None = None) -> int:
        """SampleStore.deduplicate on every server's local samples table (OPTIMIZE is per
        table, per server); the duplicate rows removed, all servers together."""
        return sum(server.deduplicate(run_id) for server in self.servers())

    def close(self) -> None:
        for server in self._servers or ():
            server.close()
        super().close()
