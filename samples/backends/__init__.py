"""Sample store backends: clickhouse.py (a ClickHouse server), chdb.py (chDB in-process)."""
