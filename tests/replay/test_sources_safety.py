"""Sources are untrusted input: only regular files, read as a stream that
stops at the limit, lines and files capped, and messages quoting a file only in short escaped
excerpts."""

import itertools
import os
import re

import pytest

from replay.sources import (
    EXCERPT_MAX,
    SourceError,
    SourceFileError,
    excerpt,
    load_source,
    read_azure,
    read_jsonl,
    summarize,
)
from replay.users import UserPopulation

POP = UserPopulation(size=100, seed=7)
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def azure_lines(n: int, start_s: int = 0) -> str:
    return "".join(
        f"2023-11-16 18:{(start_s + i) // 60:02d}:{(start_s + i) % 60:02d}.5,{10 + i},5\n" for i in range(n)
    )


def test_proc_files_are_refused_before_reading():
    """`source=/proc/self/environ` returned the process environment."""
    with pytest.raises(SourceFileError) as info:
        load_source("/proc/self/environ", "azure", population=POP)
    message = str(info.value)
    assert "a kernel file (/proc, /sys)" in message
    assert os.environ["PATH"] not in message


def test_devices_are_refused_before_reading():
    """`/dev/zero` would have been read until memory ran out."""
    with pytest.raises(SourceFileError, match="not a regular file"):
        load_source("/dev/zero", "azure", population=POP)
    with pytest.raises(SourceFileError, match="not a regular file"):
        summarize("/dev/zero", "jsonl")


def test_a_symlink_to_a_device_and_a_fifo_are_refused(tmp_path):
    link = tmp_path / "trace.csv"
    link.symlink_to("/dev/zero")
    with pytest.raises(SourceFileError, match="not a regular file"):
        load_source(link, "azure", population=POP)
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(SourceFileError, match="not a regular file"):
        load_source(fifo, "azure", population=POP)


def test_an_empty_file_says_so(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_bytes(b"")
    with pytest.raises(SourceFileError, match=r"empty \(0 bytes\)"):
        load_source(empty, "azure", population=POP)


class CountingLines:
    """An endless trace; counts the lines taken from it."""

    def __init__(self):
        self.taken = 0

    def __iter__(self):
        yield HEADER
        self.taken += 1
        for i in itertools.count():
            if self.taken > 100_000:
                raise AssertionError("read far past the limit")
            self.taken += 1
            yield f"2023-11-16 18:17:03.{i:07d},10,5\n"


def test_reading_stops_at_the_limit():
    lines = CountingLines()
    loaded = read_azure(lines, population=POP, limit=10)
    assert len(loaded.requests) == 10 and loaded.read == 10
    assert lines.taken == 11  # the header and ten rows, nothing more


def test_a_huge_file_with_a_limit_is_read_only_in_part(tmp_path):
    """The whole file was parsed before `limit` applied: a 4 GiB file for 10 requests."""
    huge = tmp_path / "huge.csv"
    with huge.open("w") as fh:
        fh.write(HEADER + azure_lines(20))
    os.truncate(huge, 4 * 1024**3)  # sparse: NUL bytes, no newline, after the 20 rows
    loaded = load_source(huge, "azure", population=POP, limit=10, max_line_bytes=1024)
    assert [r.prompt_tokens for r in loaded.requests] == list(range(10, 20))
    # Without the limit the reader gets to the NULs and stops at the line cap, not at 4 GiB.
    with pytest.raises(SourceError) as info:
        load_source(huge, "azure", population=POP, max_line_bytes=1024)
    assert info.value.problems[0].line == 22 and "longer than 1024 bytes" in str(info.value)


def test_an_overlong_line_is_refused_with_its_number(tmp_path):
    log = tmp_path / "log.jsonl"
    ok = '{"timestamp": 1, "prompt": "a", "max_tokens": 2}\n'
    log.write_text(ok + '{"timestamp": 2, "prompt": "' + "x" * 400 + '", "max_tokens": 2}\n' + ok)
    with pytest.raises(SourceError) as info:
        load_source(log, "jsonl", population=POP, max_line_bytes=256, on_error="skip")
    assert str(info.value).endswith("line 2: longer than 256 bytes (the line-length cap)")
    assert "xxxx" not in str(info.value)
    assert len(load_source(log, "jsonl", population=POP, max_line_bytes=1024).requests) == 3


def test_a_file_over_the_size_cap_is_refused_before_reading(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + azure_lines(30))
    size = trace.stat().st_size
    with pytest.raises(SourceFileError, match=f"{size} bytes, over the size cap of 100 bytes"):
        load_source(trace, "azure", population=POP, max_bytes=100)
    assert len(load_source(trace, "azure", population=POP, max_bytes=size).requests) == 30


def test_excerpts_are_short_and_escaped():
    text = "root:x:0:0\x00\x1b[31m\n\u2028'\\" + "A" * 500
    shown = excerpt(text)
    assert len(shown) <= EXCERPT_MAX and shown.endswith("...'") and shown.startswith("'root:x:0:0")
    assert "\\x00" in shown and "\\x1b" in shown and "\\n" in shown and "\\u2028" in shown and "\\'" in shown
    assert not re.search(r"[\x00-\x1f\x7f\u2028]", shown)
    assert excerpt("short") == "'short'"
    assert excerpt(b"\xff\xfe") == "'\\\\xff\\\\xfe'"  # undecodable bytes shown, never raw


@pytest.mark.parametrize(
    "line, lineno, says",
    [
        ("\x1b]0;pwned\x07" + "9" * 300 + ",10,5", 2, "TIMESTAMP must be a time like"),
        ("2023-11-16 18:17:03.1,\x00" + "7" * 300 + ",5", 2, "ContextTokens must be a whole number"),
        ("2023-11-16 18:17:03.1,10," + "z" * 300, 2, "GeneratedTokens must be a whole number"),
    ],
)
def test_azure_errors_name_line_and_field_with_a_short_escaped_excerpt(line, lineno, says):
    with pytest.raises(SourceError) as info:
        read_azure([HEADER, line], population=POP)
    problem = info.value.problems[0]
    assert problem.line == lineno and says in problem.message
    quoted = problem.message.split(", got ", 1)[1]
    assert len(quoted) <= EXCERPT_MAX and quoted.endswith("...'")
    assert not re.search(r"[\x00-\x1f\x7f]", str(info.value))


def test_a_bad_header_quotes_only_a_short_escaped_excerpt():
    """`/etc/passwd` came back whole as "header must be ..., got 'root:x:0:0:...'"."""
    first = "root:x:0:0:root:/root:/bin/bash" + "\t" * 3 + "y" * 500
    with pytest.raises(SourceError) as info:
        read_azure([first + "\n", "daemon:x:1:1\n"], population=POP)
    message = info.value.problems[0].message
    assert message.startswith("header must be TIMESTAMP,ContextTokens,GeneratedTokens, got 'root:x:0:0:root")
    assert len(message.split(", got ", 1)[1]) <= EXCERPT_MAX and "\\t" in message and "daemon" not in message


def test_jsonl_errors_never_echo_the_line():
    secret = "s3cr3t-" * 50
    lines = [
        '{"timestamp": 0, "prompt": "ok", "max_tokens": 1}',
        '{"api_key": "' + secret + '"',  # not JSON
        '{"timestamp": "' + secret + '", "prompt": "x", "max_tokens": 1}',
        '{"' + secret + '": 1, "timestamp": 0, "prompt": "x", "max_tokens": 1}',
        "[" * 100_000,
    ]
    with pytest.raises(SourceError) as info:
        read_jsonl(lines, population=POP)
    problems = {p.line: p.message for p in info.value.problems}
    assert problems[2].startswith("not JSON: Expecting")
    assert problems[3].startswith("timestamp must be epoch seconds or an ISO 8601 string, got 's3cr3t-")
    assert problems[4].startswith("unknown field(s) 's3cr3t-")
    assert problems[5] == "not JSON: nested too deeply"
    assert all(len(m) < 200 for m in problems.values()) and secret not in str(info.value)


def test_not_utf8_names_the_line(tmp_path):
    log = tmp_path / "latin.jsonl"
    log.write_bytes(b'{"timestamp": 1, "prompt": "a", "max_tokens": 2}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(SourceFileError, match=r"not UTF-8 text \(invalid continuation byte at line 2\)"):
        load_source(log, "jsonl", population=POP)


def test_a_rejected_source_stops_being_read_after_enough_bad_lines():
    bad = itertools.chain([HEADER], ("nonsense\n" for _ in range(10**9)))
    with pytest.raises(SourceError, match=r"at least 100 malformed line\(s\)"):
        read_azure(bad, population=POP)  # would read a billion lines otherwise


def test_summarize_counts_rows_span_and_rate_without_keeping_requests(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(
        HEADER + "2023-11-16 18:17:03.5,10,5\n2023-11-16 18:17:01.5,11,5\n\n2023-11-16 18:17:05.5,12,5\n"
    )
    summary = summarize(trace, "azure")
    assert (summary.format, summary.rows, summary.span_s, summary.rate, summary.skipped) == (
        "azure",
        3,
        4.0,
        0.75,
        0,
    )
    one = tmp_path / "one.jsonl"
    one.write_text('{"timestamp": 5, "prompt": "a", "max_tokens": 2}\nbad\n')
    with pytest.raises(SourceError, match="line 2"):
        summarize(one, "jsonl")
    skipped = summarize(one, "jsonl", on_error="skip")
    assert (skipped.rows, skipped.span_s, skipped.rate, skipped.skipped) == (1, 0.0, None, 1)
