"""Traces tests: a fresh trace directory per test, and the roles' read permission on traces."""

import importlib

import pytest

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
# Three requests at 18:17:01.5, 18:17:03.5 and 18:17:05.5 (out of order in the file): span 4 s,
# 3 requests, 0.75 requests/s.
TINY = HEADER + "2023-11-16 18:17:03.5,10,5\n2023-11-16 18:17:01.5,11,5\n2023-11-16 18:17:05.5,12,5\n"


@pytest.fixture(autouse=True)
def trace_dir(settings, tmp_path):
    settings.TRACE_DIR = tmp_path / "traces"
    return settings.TRACE_DIR


@pytest.fixture
def users(users):
    # transaction=True tests elsewhere flush what the data migrations granted; grant it again.
    from django.apps import apps

    importlib.import_module("traces.migrations.0002_roles_read_traces").grant_trace_roles(apps, None)
    return users
