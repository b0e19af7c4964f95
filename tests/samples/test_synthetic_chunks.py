"""samples.synthetic.generate_chunks: one run generated a chunk at a time (bench/bench_scale.py)."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from samples import synthetic


def spec(**over) -> synthetic.SyntheticSpec:
    base = synthetic.SyntheticSpec(
        n=10_000,
        seed=4,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        config_revisions=(1, 2),
        gaps=False,
        users=300,
        user_sigma=0.5,
    )
    return dataclasses.replace(base, **over)


def joined(s: synthetic.SyntheticSpec, rows: int, first: int = 0) -> dict[str, np.ndarray]:
    parts = [d.columns for d in synthetic.generate_chunks(s, rows, first_chunk=first)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def test_the_chunks_tile_one_run_with_unique_requests_in_time_order():
    cols = joined(spec(), 3_000)
    assert cols["seq"].tolist() == list(range(10_000))
    assert len(set(cols["request_id"].tolist())) == 10_000
    assert np.all(np.diff(cols["scheduled_offset_ms"]) >= 0)
    assert np.all(np.diff(cols["sent_at"].astype(np.int64)) >= -1)  # the send lag reorders within 1 s
    assert 0 <= cols["scheduled_offset_ms"].min() and cols["scheduled_offset_ms"].max() < 3600 * 1000
    # four chunks, two revisions: the first two chunks are revision 1, the last two revision 2
    assert cols["config_revision"][:6_000].tolist() == [1] * 6_000
    assert cols["config_revision"][6_000:].tolist() == [2] * 4_000


def test_a_user_keeps_one_arm_and_one_ttft_factor_across_chunks():
    cols = joined(
        spec(factor_effects={}, variants=[synthetic.VariantSpec("a", 1, control=True)], sigma=1e-9), 2_500
    )
    arms: dict[str, set] = {}
    for user, variant in zip(cols["user_id"].tolist(), cols["variant"].tolist(), strict=True):
        arms.setdefault(user, set()).add(variant)
    assert all(len(a) == 1 for a in arms.values())
    two = joined(spec(), 2_500)
    by_user: dict[str, set] = {}
    for user, variant in zip(two["user_id"].tolist(), two["variant"].tolist(), strict=True):
        by_user.setdefault(user, set()).add(variant)
    assert all(len(a) == 1 for a in by_user.values())
    assert len({next(iter(a)) for a in by_user.values()}) == 3  # every arm has users


def test_users_are_heavy_tailed_and_shared_by_every_chunk():
    cols = joined(spec(n=30_000, users=1_000), 10_000)
    users, per = np.unique(cols["user_id"], return_counts=True)
    assert len(users) > 900
    assert per.max() > 8 * per.mean()  # lognormal rates, sigma 1: a few users send many requests
    chunk_users = [
        set(d.columns["user_id"].tolist())
        for d in synthetic.generate_chunks(spec(n=30_000, users=1_000), 10_000)
    ]
    top = users[np.argmax(per)]
    assert all(top in u for u in chunk_users)


def test_a_resumed_generation_gives_the_same_later_chunks():
    whole = joined(spec(), 3_000)
    later = joined(spec(), 3_000, first=2)
    for k in ("seq", "request_id", "user_id", "variant", "ttft_ms", "sent_unix_ms"):
        np.testing.assert_array_equal(whole[k][6_000:], later[k])


def digest(data: synthetic.Synthetic) -> str:
    h = hashlib.sha256()
    for k in sorted(data.columns):
        v = data.columns[k]
        h.update(k.encode())
        if v.dtype == object:
            h.update(repr([x.tolist() if hasattr(x, "tolist") else x for x in v.tolist()]).encode())
        else:
            h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


def test_generate_gives_what_it_gave_before_chunks_existed():
    # the digest of these rows from samples/synthetic.py before users_seed and seq_offset
    data = synthetic.generate(spec(n=2_000, gaps=True, no_user_share=0.1, duplicate_rate=0.01))
    assert digest(data) == "c77c8ee9f8ddeb9248de98beff4902ccfc0cedc9c7cae25e916f5ff4b31333bd"


@pytest.mark.parametrize("bad", [{"chunk_rows": 0}, {"chunk_rows": 10, "first_chunk": -1}])
def test_bad_chunking_is_refused(bad):
    with pytest.raises(ValueError, match="generate_chunks"):
        next(synthetic.generate_chunks(spec(), **bad))


def test_seqs_past_uint32_are_refused():
    with pytest.raises(ValueError, match="seq_offset"):
        synthetic.generate(spec(n=10, seq_offset=2**32 - 5))
