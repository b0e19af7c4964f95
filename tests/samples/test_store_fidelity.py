"""The fidelity tables' writer (samples.store_fidelity): every value checked against its
column's declared type before anything is sent, rows readable back, a re-sent batch collapsed."""

from __future__ import annotations

import pytest

from samples import schema


def _score(**over):
    row = {
        "experiment": "e",
        "variant": "awq",
        "run_id": 7,
        "seq": 3,
        "user_id": "u1",
        "control": "fp16",
        "top_k": 20,
        "outcome": "ok",
        "error": "",
        "positions": 12,
        "kl_sum": 0.25,
        "kl_max": 0.1,
        "top1_agree": 11,
    }
    return {**row, **over}


def _shadow(**over):
    row = {
        "experiment": "e",
        "variant": "awq",
        "control": "fp16",
        "request_id": "r1",
        "user_id": "u1",
        "config_revision": 4,
        "sent_at": 1_780_000_000,
        "compared": "live",
        "outcome": "ok",
        "error": "",
        "identical": 0,
        "first_divergence": 5,
        "unit": "token",
        "variant_tokens": 9,
        "control_tokens": 10,
        "variant_fp": 2**64 - 1,
        "control_fp": 1,
    }
    return {**row, **over}


def test_scores_and_shadows_round_trip_and_a_resent_batch_collapses(store):
    assert store.insert_fidelity_scores([_score(), _score(seq=4, kl_sum=0.5)]) == 2
    assert store.insert_fidelity_scores([_score(kl_sum=0.75)]) == 1  # the pass run again
    got = store.query(
        f"SELECT seq, kl_sum, scored_ms > 0 FROM {schema.FIDELITY_SCORES_TABLE} FINAL ORDER BY seq"
    )
    assert [tuple(r) for r in got] == [(3, 0.75, 1), (4, 0.5, 1)]
    assert store.insert_fidelity_shadows([_shadow()]) == 1
    got = store.query(
        f"SELECT request_id, toUnixTimestamp(sent_at), first_divergence, variant_fp "
        f"FROM {schema.FIDELITY_SHADOWS_TABLE}"
    )
    assert [tuple(r) for r in got] == [("r1", 1_780_000_000, 5, 2**64 - 1)]


@pytest.mark.parametrize(
    "row, says",
    [
        (_score(top_k=256), "row 0 column 'top_k' must be a whole number in [0, 256)"),
        (_score(kl_sum=float("nan")), "row 0 column 'kl_sum' must be a finite number"),
        (_score(user_id=None), "row 0 column 'user_id' must be a string"),
        ({k: v for k, v in _score().items() if k != "positions"}, "row 0 has no 'positions'"),
        (_score(extra=1), "row 0 has unknown columns ['extra']"),
        (_score(seq=True), "column 'seq' must be a whole number"),
    ],
)
def test_a_bad_score_names_its_row_and_column_and_nothing_is_sent(store, row, says):
    with pytest.raises(ValueError, match=r"^fidelity_scores: ") as err:
        store.insert_fidelity_scores([_score(seq=1), row])
    assert says.replace("row 0", "row 1") in str(err.value)
    assert store.query(f"SELECT count() FROM {schema.FIDELITY_SCORES_TABLE}")[0][0] == 0


def test_a_shadow_sent_at_must_be_whole_seconds(store):
    with pytest.raises(ValueError, match="column 'sent_at' must be whole seconds since 1970"):
        store.insert_fidelity_shadows([_shadow(sent_at=1.5)])
    with pytest.raises(ValueError, match="column 'first_divergence' must be a whole number in"):
        store.insert_fidelity_shadows([_shadow(first_divergence=2**31)])
