"""The coordinator's notifier: order kept, bursts batched, delivery errors reach the waiter."""

from __future__ import annotations

import threading

import pytest

from ckptd.coordinator.notifier import Notifier


def test_a_lone_notification_goes_out_at_once_and_bursts_go_together():
    calls: list[list] = []
    first_sent, release = threading.Event(), threading.Event()

    def send(events):
        calls.append(list(events))
        if len(calls) == 1:
            first_sent.set()
            release.wait()

    n = Notifier(send)
    sender = threading.Thread(target=n.deliver, args=("a",))
    sender.start()
    assert first_sent.wait(10)  # "a" is in flight, sent by the delivering thread itself
    n.post("b")  # return at once: queued behind the call in flight
    n.post("c")
    release.set()
    sender.join(10)  # the sender flushes what queued up before it returns
    assert calls == [["a"], ["b", "c"]]
    n.deliver("d")
    assert calls[-1] == ["d"]


def test_a_failed_delivery_is_raised_to_the_waiter():
    def send(events):
        raise ConnectionError("monitor unreachable")

    n = Notifier(send)
    with pytest.raises(ConnectionError, match="unreachable"):
        n.deliver("x")
    n.post("y")  # logged, not raised
    with pytest.raises(ConnectionError):
        n.deliver("z")


def test_many_threads_each_get_their_own_answer_and_every_event_goes_once():
    """A process hosting many coordinators has hundreds of save threads on one notifier: each
    must get the answer to its own event, every event must be sent exactly once, and they batch."""
    sent: list = []
    lock = threading.Lock()

    def send(events):
        with lock:
            sent.extend(events)
        return [("answer", e) for e in events]

    n = Notifier(send)
    answers: dict[int, object] = {}
    start = threading.Barrier(200)

    def worker(i: int) -> None:
        start.wait()
        answers[i] = n.deliver(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answers == {i: ("answer", i) for i in range(200)}
    assert sorted(sent) == list(range(200))
