"""Session 14b attacks on the notifier's per-waiter wake-ups and hand-over of the sending role:
posts mixed with delivers, failing calls, no waiter left unwoken, every event sent exactly once."""

from __future__ import annotations

import threading

from ckptd.coordinator.notifier import Notifier


class BatchError(Exception):
    def __init__(self, batch_no: int) -> None:
        super().__init__(f"batch {batch_no}")
        self.batch_no = batch_no


def test_posts_and_delivers_mixed_with_failing_calls_each_answer_reaches_its_own_waiter():
    lock = threading.Lock()
    batches: list[list] = []

    def send(events):
        with lock:
            batches.append(list(events))
            no = len(batches) - 1
        if no % 3 == 1:
            raise BatchError(no)
        return [f"ok:{e}" for e in events]

    n = Notifier(send)
    threads, per_thread = 24, 150
    outcomes: dict[tuple, object] = {}
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            event = (t, i)
            if (t + i) % 4 == 0:
                n.post(event)
                continue
            try:
                outcomes[event] = n.deliver(event)
            except BatchError as e:
                outcomes[event] = e

    pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(60)
    assert not any(th.is_alive() for th in pool), "a waiter was never woken"
    # Posts may still be queued only if a sender is still going: the last sender flushes them.
    sent = [e for b in batches for e in b]
    assert len(sent) == len(set(sent)) == threads * per_thread  # every event exactly once
    where = {e: no for no, b in enumerate(batches) for e in b}
    for event, outcome in outcomes.items():
        if isinstance(outcome, BatchError):
            assert event in batches[outcome.batch_no], "an error reached a waiter whose event was not in that call"
            assert where[event] % 3 == 1
        else:
            assert outcome == f"ok:{event}"
            assert where[event] % 3 != 1
    for t in range(threads):  # each thread's events go out in its order
        mine = [e for e in sent if e[0] == t]
        assert mine == sorted(mine)
    assert not n._sending and not n._queue


def test_a_post_left_behind_by_the_last_deliver_is_flushed_by_a_posting_sender():
    first_in, release = threading.Event(), threading.Event()
    batches: list[list] = []

    def send(events):
        batches.append(list(events))
        if len(batches) == 1:
            first_in.set()
            release.wait(30)
        return [None] * len(events)

    n = Notifier(send)
    poster = threading.Thread(target=n.post, args=("p0",), daemon=True)
    poster.start()  # a post that finds no call in flight sends it itself
    assert first_in.wait(10)
    waiter = threading.Thread(target=n.deliver, args=("d1",), daemon=True)
    waiter.start()
    n.post("p2")  # queued behind the waiter
    release.set()
    waiter.join(30)
    poster.join(30)
    assert not waiter.is_alive() and not poster.is_alive()
    assert [e for b in batches for e in b] == ["p0", "d1", "p2"] or \
        [e for b in batches for e in b] == ["p0", "p2", "d1"]
    assert not n._sending and not n._queue
