"""The one queue in front of the sample writer (samples/batching.py): put never blocks and
counts what it refuses; take hands over full batches at once and partial ones at their age;
taken items count against the bound until done or given back, in order."""

from __future__ import annotations

import threading

import pytest

from samples.batching import BatchQueue


def test_a_full_batch_is_handed_over_without_waiting_for_its_age():
    q = BatchQueue(batch_rows=3, max_age_s=3600.0)
    for i in range(4):
        assert q.put(i)
    items, closing = q.take(limit=3)  # 4 queued >= 3: no wait (an hour's age would hang the test)
    assert items == [0, 1, 2] and not closing
    assert q.waiting() == 1 and q.in_memory() == 4  # the taken three still in memory


def test_a_partial_batch_leaves_at_its_age_and_a_waiting_writer_wakes_for_a_full_one():
    q = BatchQueue(batch_rows=2, max_age_s=0.05)
    q.put("a")
    assert q.take() == (["a"], False)  # aged out: what there is
    q.done(1)
    got: list = []
    slow = BatchQueue(batch_rows=2, max_age_s=3600.0)
    writer = threading.Thread(target=lambda: got.append(slow.take()))
    writer.start()
    slow.put(1)
    slow.put(2)  # the second item fills the batch: the writer wakes now, not in an hour
    writer.join(30)
    assert not writer.is_alive() and got == [([1, 2], False)]


def test_the_bound_counts_taken_items_until_done_and_refusals_are_counted():
    q = BatchQueue(batch_rows=2, max_age_s=0.01, capacity=3)
    assert [q.put(i) for i in range(5)] == [True, True, True, False, False]
    items, _ = q.take(limit=2)
    assert q.put(9) is False  # 1 waiting + 2 taken = 3: still full while the writer works
    q.done(len(items))
    assert q.put(9) is True and q.in_memory() == 2
    assert q.refused() == (3, 0)
    assert q.refused(reset=True) == (3, 0) and q.refused() == (0, 0)


def test_items_given_back_go_first_in_their_order():
    q = BatchQueue(batch_rows=10, max_age_s=0.01)
    for i in range(5):
        q.put(i)
    items, _ = q.take()
    q.put(5)
    q.done(2)  # 0 and 1 handled; 2, 3, 4 not
    q.give_back(items[2:])
    assert q.take() == ([2, 3, 4, 5], False) and q.in_memory() == 4


def test_after_close_put_refuses_and_take_returns_what_is_left_at_once():
    q = BatchQueue(batch_rows=100, max_age_s=3600.0)
    q.put("x")
    q.close()
    assert q.put("y") is False and q.refused() == (0, 1)
    assert q.take() == (["x"], True)  # no wait for a full batch once closed
    assert q.take() == ([], True)


def test_bad_arguments_and_miscounts_say_what():
    with pytest.raises(ValueError, match="capacity >= batch_rows"):
        BatchQueue(batch_rows=10, max_age_s=1.0, capacity=5)
    with pytest.raises(ValueError, match="max_age_s > 0"):
        BatchQueue(batch_rows=1, max_age_s=0)
    q = BatchQueue(batch_rows=1, max_age_s=0.01)
    q.put(1)
    q.take()
    with pytest.raises(ValueError, match=r"done\(2\): only 1 items are taken"):
        q.done(2)
    with pytest.raises(ValueError, match="give_back: 2 items, only 1 taken"):
        q.give_back([1, 2])
