"""The sample store's schema on a ClickHouse cluster: every migration, rewritten per server.

Pure: SQL text only (the migrations of samples.schema in, the statements one server runs out).
Under ABPLAT_CLICKHOUSE_CLUSTER (docs/clickhouse-cluster.md) every table a migration creates
becomes two on every server of the cluster:
- `<table>_local`, the migration's own CREATE with the table renamed: the same engine, so a
  ReplacingMergeTree still collapses the recordings of one request, on the shard that holds them;
- `<table>`, a Distributed table over the `_local` tables of every shard, under the name the
  code reads and writes, so queries and inserts are unchanged.

Sharding keys (sharding_key):
- samples: the unit the report clusters by, SAMPLES_SHARDING_KEY = sipHash64(experiment, variant,
  user_id, if(user_id = '', request_id, '')): a user's requests (a request without a user is a
  unit of its own, as in analysis.units.CLUSTER_KEY) are all on one shard, so a query grouping
  by user runs on each shard's `samples_local` alone and the shards' per-arm sums add up
  (SampleStore.unit_shards). Every recording of one request has the same experiment, variant,
  user and request id, so it still lands on one shard, where the ReplacingMergeTree, FINAL and
  SampleStore.deduplicate collapse it, exactly as on one server.
- every other table: sipHash64 of its sorting key (its ORDER BY). A ReplacingMergeTree's sorting
  key is its dedup key, so every recording of one row (a retried insert, a spool flush after an
  ambiguous failure) goes to the same shard. A table without a sorting key (ORDER BY tuple())
  has nothing to dedupe: its rows are spread by rand().
A cluster migrated by older code keeps the Distributed samples table it has (CREATE TABLE IF NOT
EXISTS), sharded by the sorting key: sharded_by_unit tells the two apart from the table's
engine_full, and only a cluster sharded by the unit is read shard by shard
(docs/clickhouse-cluster.md, "Moving an existing cluster").

The migrations keep their versions and checksums: each server records them in its own
schema_migrations (a plain local table), applied when both its tables exist.
"""

from __future__ import annotations

import re

from samples import schema

LOCAL_SUFFIX = "_local"
# The samples' shard: their unit (user, or the request without one) within the variant, hashed
# with the experiment so one experiment's users spread over the shards.
SAMPLES_SHARDING_KEY = "sipHash64(experiment, variant, user_id, if(user_id = '', request_id, ''))"

_CREATE_HEAD = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+) \(")
_ORDER_BY = re.compile(r"\nORDER BY (.+?)\s*$", re.S)
_ALTER_HEAD = re.compile(r"^ALTER TABLE (\w+) ")


class ClusterSchemaError(ValueError):
    """A migration statement that has no cluster form (say which and why)."""


def local_name(table: str) -> str:
    return table + LOCAL_SUFFIX


def sharding_key(create_sql: str) -> str:
    """The Distributed table's sharding key for a CREATE TABLE statement: SAMPLES_SHARDING_KEY
    for the samples; else sipHash64 of its ORDER BY (the dedup key of a ReplacingMergeTree),
    rand() for ORDER BY tuple()."""
    head = _CREATE_HEAD.match(create_sql.strip())
    if head and head.group(1) == schema.SAMPLES_TABLE:
        return SAMPLES_SHARDING_KEY
    m = _ORDER_BY.search(create_sql)
    if m is None:
        raise ClusterSchemaError(
            f"no ORDER BY in {create_sql.splitlines()[0]!r}: cannot choose a sharding key"
        )
    key = m.group(1).strip()
    if key.startswith("(") and key.endswith(")"):
        key = key[1:-1].strip()
    if key in ("", "tuple()"):
        return "rand()"
    return f"sipHash64({key})"


def sharded_by_unit(engine_full: str) -> bool:
    """Whether a Distributed samples table (its system.tables engine_full) shards by
    SAMPLES_SHARDING_KEY, as this code makes it, rather than by the sorting key, as older code
    did. Whitespace aside, the server prints the key as it was written."""

    def bare(text: str) -> str:
        return "".join(text.split())

    return bare(engine_full).startswith("Distributed(") and bare(engine_full).endswith(
        "," + bare(SAMPLES_SHARDING_KEY) + ")"
    )


def server_statements(statement: str, cluster: str, database: str) -> tuple[str, ...]:
    """What one server of the cluster runs for one migration statement, in order.

    CREATE TABLE IF NOT EXISTS t (...) -> the same as t_local, then t as a Distributed table
    over every shard's t_local. ALTER TABLE t ... -> on t_local, then on t (a Distributed
    table takes ADD/DROP/MODIFY COLUMN as its local tables do). Anything else has no defined
    cluster form: ClusterSchemaError naming it."""
    text = statement.strip()
    create = _CREATE_HEAD.match(text)
    if create:
        table = create.group(1)
        local = _CREATE_HEAD.sub(f"CREATE TABLE IF NOT EXISTS {local_name(table)} (", text, count=1)
        distributed = (
            f"CREATE TABLE IF NOT EXISTS {table} AS {local_name(table)} "
            f"ENGINE = Distributed({cluster}, {database}, {local_name(table)}, {sharding_key(text)})"
        )
        return (local, distributed)
    alter = _ALTER_HEAD.match(text)
    if alter:
        table = alter.group(1)
        return (_ALTER_HEAD.sub(f"ALTER TABLE {local_name(table)} ", text, count=1), text)
    raise ClusterSchemaError(
        f"migration statement {text.splitlines()[0][:80]!r} has no cluster form: a migration "
        "applied under ABPLAT_CLICKHOUSE_CLUSTER may only CREATE TABLE IF NOT EXISTS or ALTER TABLE "
        "(samples/cluster.py)"
    )


def migration_statements(migration: schema.Migration, cluster: str, database: str) -> tuple[str, ...]:
    return tuple(s for stmt in migration.statements for s in server_statements(stmt, cluster, database))


def distributed_tables(migrations: tuple[schema.Migration, ...] = schema.MIGRATIONS) -> tuple[str, ...]:
    """Every table the migrations create: on a cluster, each is a Distributed table over its
    `_local` tables."""
    return tuple(t for m in migrations for t in schema.declared_tables(m))


# Statements a Distributed table refuses on 18.16 ("Method optimize is not supported by storage
# Distributed", "Mutations are not supported by storage Distributed") or silently ignores
# (TRUNCATE leaves the shards' rows): they run on every server's local table instead.
_PER_SHARD = re.compile(
    r"^\s*(OPTIMIZE TABLE|TRUNCATE TABLE(?: IF EXISTS)?|ALTER TABLE)\s+(\w+)(\s+(?:DELETE|UPDATE)\b|\s|$)",
    re.I,
)


def per_shard_form(sql: str, tables: tuple[str, ...]) -> str | None:
    """The statement rewritten for every server's local table when a Distributed table cannot
    run it (OPTIMIZE, TRUNCATE, ALTER ... DELETE/UPDATE on one of ``tables``); else None."""
    m = _PER_SHARD.match(sql)
    if m is None or m.group(2) not in tables:
        return None
    verb = m.group(1).upper()
    if verb == "ALTER TABLE" and not m.group(3).strip():
        return None  # a column change: the Distributed table takes it (a migration's job)
    return sql[: m.start(2)] + local_name(m.group(2)) + sql[m.end(2) :]
