"""Storing traces by content hash, and naming them inside the trace directory only."""

import os

import pytest

from tests.traces.conftest import HEADER, TINY
from traces import storage
from traces.models import Trace


def chunks(text: str, size: int = 7):
    data = text.encode()
    return [data[i : i + size] for i in range(0, len(data), size)]


def files(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.django_db
@pytest.mark.engine
def test_an_upload_is_stored_under_its_hash_with_its_figures(trace_dir):
    trace, created = storage.store(chunks(TINY), name="tiny.csv")
    assert created and trace.format == "azure"
    assert (trace.rows, trace.span_s, trace.rate, trace.size) == (3, 4.0, 0.75, len(TINY))
    assert files(trace_dir) == [trace.sha256]  # no temporary file left behind
    assert (trace_dir / trace.sha256).read_text() == TINY
    log = '{"timestamp": 10, "prompt": "a", "max_tokens": 2}\n{"timestamp": 12.5, "prompt": "b", "max_tokens": 2}\n'
    jsonl, _ = storage.store(chunks(log), name="log.jsonl")
    assert (jsonl.format, jsonl.rows, jsonl.span_s, jsonl.rate) == ("jsonl", 2, 2.5, 0.8)


@pytest.mark.django_db
@pytest.mark.engine
def test_the_same_content_is_stored_once(trace_dir):
    first, created = storage.store(chunks(TINY), name="tiny.csv")
    again, created_again = storage.store(chunks(TINY, 3), name="other-name.csv")
    assert created and not created_again and again.pk == first.pk and again.name == "tiny.csv"
    assert Trace.objects.count() == 1 and files(trace_dir) == [first.sha256]


@pytest.mark.django_db
@pytest.mark.engine
def test_a_name_is_a_label_never_a_path(trace_dir):
    for bad in ["../escape.csv", "/etc/passwd", ".hidden", "a/b.csv", "x" * 201, ""]:
        with pytest.raises(storage.TraceError) as info:
            storage.store(chunks(TINY), name=bad)
        assert info.value.field == "name"
    storage.store(chunks(TINY), name="taken.csv")
    with pytest.raises(storage.TraceError, match="taken.csv is taken"):
        storage.store(chunks(TINY.replace("12,5", "13,5")), name="taken.csv")
    assert Trace.objects.count() == 1 and len(files(trace_dir)) == 1


@pytest.mark.django_db
def test_an_oversized_upload_stops_at_the_cap_and_leaves_nothing(settings, trace_dir):
    settings.TRACE_MAX_BYTES = 1024
    taken = []

    def endless():
        while True:
            taken.append(1)
            yield b"x" * 100

    with pytest.raises(storage.TraceTooLarge) as info:
        storage.store(endless(), name="big.csv")
    assert info.value.status == 413 and "over the cap of 1024 bytes (TRACE_MAX_BYTES)" in str(info.value)
    assert len(taken) == 11 and files(trace_dir) == [] and not Trace.objects.exists()


@pytest.mark.django_db
def test_a_malformed_upload_is_refused_naming_line_and_field(trace_dir):
    bad = HEADER + "2023-11-16 18:17:03.5,10,5\n2023-11-16 18:17:04.5,ten,5\n"
    with pytest.raises(storage.TraceError) as info:
        storage.store(chunks(bad), name="bad.csv")
    assert info.value.field == "file"
    assert "line 3: ContextTokens must be a whole number in [1, 1000000], got 'ten'" in str(info.value)
    with pytest.raises(storage.TraceError, match="first line is neither"):
        storage.store(chunks("root:x:0:0:root:/root:/bin/bash\n"), name="passwd")
    assert files(trace_dir) == [] and not Trace.objects.exists()


@pytest.mark.django_db
def test_an_overlong_line_in_an_upload_is_refused(settings, trace_dir):
    settings.TRACE_MAX_LINE_BYTES = 256
    text = '{"timestamp": 1, "prompt": "' + "p" * 300 + '", "max_tokens": 2}\n'
    with pytest.raises(storage.TraceError, match="line 1: longer than 256 bytes"):
        storage.store(chunks(text, 64), name="long.jsonl")
    assert files(trace_dir) == []


@pytest.mark.django_db
@pytest.mark.engine
def test_references_resolve_inside_the_trace_directory_only(trace_dir, tmp_path):
    trace, _ = storage.store(chunks(TINY), name="tiny.csv")
    assert storage.resolve("tiny.csv") == (trace.path.resolve(), trace)
    assert storage.resolve(trace.sha256) == (trace.path.resolve(), trace)
    (trace_dir / "sub").mkdir()
    (trace_dir / "sub" / "mine.csv").write_text(TINY)
    assert storage.resolve("sub/mine.csv", field="source") == (
        (trace_dir / "sub" / "mine.csv").resolve(),
        None,
    )
    (trace_dir / "inside").symlink_to(trace_dir / "sub" / "mine.csv")
    assert storage.resolve("inside")[0] == (trace_dir / "sub" / "mine.csv").resolve()
    outside = tmp_path / "outside.csv"
    outside.write_text(TINY)
    (trace_dir / "out").symlink_to(outside)
    (trace_dir / "passwd").symlink_to("/etc/passwd")
    (trace_dir / "environ").symlink_to("/proc/self/environ")
    refused = {
        "out": "leads out of the trace directory",
        "passwd": "leads out of the trace directory",
        "environ": "leads out of the trace directory",
        "../outside.csv": "'..' is not allowed",
        "sub/../../outside.csv": "'..' is not allowed",
        str(outside): "is an absolute path",
        "/etc/passwd": "is an absolute path",
        "/proc/self/environ": "is an absolute path",
        "/dev/zero": "is an absolute path",
        "~/x.csv": "is an absolute path",
        "sub": "is not a regular file",
        ".upload-x.part": "hidden files are not traces",
        "missing.csv": "no trace 'missing.csv'",
    }
    for ref, says in refused.items():
        with pytest.raises(storage.TraceError) as info:
            storage.resolve(ref, field="source")
        assert info.value.field == "source" and says in str(info.value), (ref, str(info.value))
        assert "root:" not in str(info.value)


@pytest.mark.django_db
@pytest.mark.engine
def test_delete_removes_the_row_and_then_the_file(trace_dir, django_capture_on_commit_callbacks):
    trace, _ = storage.store(chunks(TINY), name="tiny.csv")
    with django_capture_on_commit_callbacks(execute=True):
        storage.delete(trace)
    assert not Trace.objects.exists() and files(trace_dir) == []


@pytest.mark.django_db
@pytest.mark.engine
def test_add_trace_stores_a_local_file(trace_dir, tmp_path):
    import io

    from django.core.management import call_command

    local = tmp_path / "local.csv"
    local.write_text(TINY)
    out = io.StringIO()
    call_command("add_trace", str(local), stdout=out)
    assert "local.csv: stored; 3 requests over 4.0 s (0.75/s), azure" in out.getvalue()
    call_command("add_trace", str(local), "--name", "again", stdout=out)
    assert "already stored" in out.getvalue() and Trace.objects.count() == 1
