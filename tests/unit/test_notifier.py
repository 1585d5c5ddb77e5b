"""The coordinator's notifier: order kept, bursts batched, delivery errors reach the waiter."""

from __future__ import annotations

import threading

import pytest

from ckptd.coordinator.notifier import Notifier


def test_bursts_go_out_in_one_call_and_in_order():
    calls: list[list] = []
    first_sent, release = threading.Event(), threading.Event()

    def send(events):
        calls.append(list(events))
        first_sent.set()
        release.wait()

    n = Notifier(send, "test-notify")
    waiter = threading.Thread(target=n.deliver, args=("a",))
    waiter.start()
    assert first_sent.wait(10)  # "a" is in flight; what comes now queues up behind it
    n.post("b")
    n.post("c")
    release.set()
    waiter.join(10)
    n.deliver("d")  # returns once the monitor (here: send) has it, so every call is recorded
    assert calls[0] == ["a"]
    assert calls[1][:2] == ["b", "c"]  # the burst in one call ("d" may have joined it)
    assert [e for c in calls for e in c] == ["a", "b", "c", "d"]  # in order, each once


def test_a_failed_delivery_is_raised_to_the_waiter():
    def send(events):
        raise ConnectionError("monitor unreachable")

    n = Notifier(send, "test-notify-fail")
    with pytest.raises(ConnectionError, match="unreachable"):
        n.deliver("x")
    n.post("y")  # logged, not raised
    with pytest.raises(ConnectionError):
        n.deliver("z")
