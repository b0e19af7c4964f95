"""Traffic sources: the Azure trace and the JSONL log, with line-numbered problems."""

import json
from collections import Counter
from pathlib import Path

import pytest

from replay.sources import SourceError, load_source, read_azure, read_jsonl
from replay.users import UserPopulation

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "azure_llm_2023_code.csv"
POP = UserPopulation(size=100, seed=7)


def test_whole_azure_trace_loads_with_exact_offsets():
    loaded = load_source(TRACE, "azure", population=POP)
    reqs = loaded.requests
    assert len(reqs) == 8819 and not loaded.skipped
    assert reqs[0].offset_s == 0.0
    # 18:17:03.9799600 -> 18:17:04.0319600
    assert reqs[1].offset_s == pytest.approx(0.052, abs=1e-6)
    assert (reqs[0].prompt_tokens, reqs[0].max_tokens) == (4808, 10)
    assert all(b.offset_s >= a.offset_s for a, b in zip(reqs, reqs[1:]))
    assert reqs[-1].offset_s == pytest.approx(57 * 60 + 15.678, abs=1.0)


def test_the_shipped_conversation_trace_loads_whole_with_exact_offsets():
    loaded = load_source(TRACE.with_name("azure_llm_2023_conv.csv"), "azure", population=POP)
    reqs = loaded.requests
    assert len(reqs) == 19366 and not loaded.skipped
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert reqs[0].offset_s == 0.0 and reqs[1].offset_s == pytest.approx(4.314579, abs=1e-6)
    assert [(r.prompt_tokens, r.max_tokens) for r in reqs[:2]] == [(374, 44), (396, 109)]
    assert all(b.offset_s >= a.offset_s for a, b in zip(reqs, reqs[1:]))
    assert (reqs[-1].prompt_tokens, reqs[-1].max_tokens) == (197, 183)


def test_limit_takes_the_first_requests():
    assert len(load_source(TRACE, "azure", population=POP, limit=50).requests) == 50
    with pytest.raises(ValueError, match="at least 1"):
        load_source(TRACE, "azure", population=POP, limit=0)


AZURE_BAD = [
    "TIMESTAMP,ContextTokens,GeneratedTokens",
    "2023-11-16 18:17:03.9799600,4808,10",
    "2023-11-16 18:17:04.0319600,abc,8",
    "2023-11-16 18:17:04,100",
    "yesterday,10,10",
    "2023-11-16 18:17:05.5,10,0",
    "2023-11-16 18:17:06.0,12,3",
]


def test_azure_bad_lines_reject_whole_source_with_line_numbers():
    with pytest.raises(SourceError) as info:
        read_azure(AZURE_BAD, population=POP)
    lines = [p.line for p in info.value.problems]
    assert lines == [3, 4, 5, 6]
    assert "GeneratedTokens must be a whole number" in str(info.value)


def test_azure_bad_lines_skipped_and_counted():
    loaded = read_azure(AZURE_BAD, population=POP, on_error="skip")
    assert [r.prompt_tokens for r in loaded.requests] == [4808, 12]
    assert len(loaded.skipped) == 4
    assert [r.seq for r in loaded.requests] == [0, 1]


def test_azure_header_checked():
    with pytest.raises(SourceError, match="header must be"):
        read_azure(["a,b,c", "1,2,3"], population=POP)


def test_users_are_skewed_and_reproducible():
    pop = UserPopulation(size=1000, skew=1.1, seed=3)
    users = [pop.user_for(i) for i in range(20000)]
    assert users == [UserPopulation(size=1000, skew=1.1, seed=3).user_for(i) for i in range(20000)]
    counts = Counter(users).most_common()
    top_share = sum(c for _, c in counts[:10]) / len(users)
    assert top_share > 0.25  # a few heavy users
    assert len(counts) > 500  # and a long tail
    assert [UserPopulation(size=1000, seed=4).user_for(i) for i in range(50)] != users[:50]


def jsonl(*objs) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_jsonl_chat_and_completions_and_ordering():
    loaded = read_jsonl(
        jsonl(
            {
                "timestamp": 10.5,
                "user_id": "u1",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
            },
            {"timestamp": "1970-01-01T00:00:10Z", "prompt": "def f(", "max_tokens": 3, "metadata": {"k": 1}},
        ),
        population=POP,
    )
    a, b = loaded.requests
    assert (a.prompt, a.offset_s, a.metadata) == ("def f(", 0.0, {"k": 1})
    assert b.messages[0]["content"] == "hi" and b.offset_s == 0.5 and b.user_id == "u1"
    assert a.user_id.startswith("user-")  # drawn from the population when absent


@pytest.mark.parametrize(
    "line, says",
    [
        ("{not json", "Expecting property name"),
        ('["a"]', "must be a JSON object"),
        ({"timestamp": 1, "max_tokens": 3}, "exactly one of messages"),
        ({"timestamp": 1, "prompt": "x", "messages": [], "max_tokens": 3}, "exactly one of messages"),
        ({"timestamp": 1, "prompt": "x", "max_tokens": 0}, "max_tokens must be"),
        ({"timestamp": 1, "prompt": "x", "max_tokens": "5"}, "max_tokens must be"),
        ({"timestamp": True, "prompt": "x", "max_tokens": 5}, "timestamp must be"),
        ({"prompt": "x", "max_tokens": 5}, "timestamp must be"),
        ({"timestamp": 1, "messages": [{"role": "bot", "content": "x"}], "max_tokens": 5}, "role must be"),
        ({"timestamp": 1, "prompt": "x", "max_tokens": 5, "extra": 1}, "unknown field(s) extra"),
    ],
)
def test_jsonl_malformed_lines_named(line, says):
    good = {"timestamp": 0, "prompt": "ok", "max_tokens": 1}
    lines = jsonl(good, line, good)
    with pytest.raises(SourceError) as info:
        read_jsonl(lines, population=POP)
    assert info.value.problems[0].line == 2 and says in info.value.problems[0].message
    skipped = read_jsonl(lines, population=POP, on_error="skip")
    assert len(skipped.requests) == 2 and skipped.skipped[0].line == 2


def test_empty_source_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(SourceError, match="no requests"):
        load_source(path, "jsonl", population=POP)
    with pytest.raises(SourceError, match="cannot read"):
        load_source(tmp_path / "missing.csv", "azure", population=POP)


def test_a_missing_file_says_so_with_its_path_not_line_0(tmp_path):
    """A missing trace was reported as "1 malformed line(s): line 0"; now it says so, with its path."""
    missing = tmp_path / "nope" / "missing.csv"
    with pytest.raises(SourceError) as info:
        load_source(missing, "azure", population=POP)
    message = str(info.value)
    assert message == f"{missing}: cannot read: no such file (the path as this process sees it)"
    assert "malformed" not in message and "line 0" not in message
    with pytest.raises(SourceError, match="a directory, not a trace or log file"):
        load_source(tmp_path, "jsonl", population=POP)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(SourceError, match="not UTF-8 text"):
        load_source(latin, "jsonl", population=POP)


def test_requests_carry_their_line_numbers(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(
        '{"timestamp": 1, "prompt": "a", "max_tokens": 2}\n\n{"timestamp": 2, "prompt": "b", "max_tokens": 2}\n'
    )
    assert [r.line for r in load_source(log, "jsonl", population=POP).requests] == [1, 3]
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,10,5\n")
    assert [r.line for r in load_source(trace, "azure", population=POP).requests] == [2]


def test_thinning_keeps_a_stable_share_and_the_order():
    from replay.sources import thin

    reqs = load_source(TRACE, "azure", population=POP).requests
    kept = thin(reqs, 0.25, seed=1)
    assert abs(len(kept) / len(reqs) - 0.25) < 0.02
    assert kept == thin(reqs, 0.25, seed=1) and kept != thin(reqs, 0.25, seed=2)
    assert [r.seq for r in kept] == sorted(r.seq for r in kept)
    assert thin(reqs, 1.0) is reqs
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        thin(reqs, 0)
