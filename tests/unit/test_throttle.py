"""Writer slots: limits per strategy, first come first served."""

from __future__ import annotations

import pytest

from ckptd.config import SaveStrategy
from ckptd.monitor.throttle import SlotRequest, WriterSlots


def req(unit: str, node: str = "n1", process: str = "p1") -> SlotRequest:
    return SlotRequest(unit, node, process)


def test_unrestricted_grants_everything():
    slots = WriterSlots(SaveStrategy.UNRESTRICTED)
    assert [slots.request(req(u, process=u))[0] for u in "abc"] == list("abc")


def test_single_thread_grants_one_at_a_time_in_arrival_order():
    slots = WriterSlots(SaveStrategy.SINGLE_THREAD)
    assert slots.request(req("a")) == ["a"]
    assert slots.request(req("b")) == []
    assert slots.request(req("c")) == []
    assert slots.release("a") == ["b"]
    assert slots.release("b") == ["c"]
    assert slots.holders() == ["c"]


def test_single_process_runs_one_process_at_a_time():
    slots = WriterSlots(SaveStrategy.SINGLE_PROCESS)
    assert slots.request(req("a1", process="A")) == ["a1"]
    assert slots.request(req("a2", process="A")) == ["a2"]
    assert slots.request(req("b1", process="B")) == []
    assert slots.release("a1") == []
    assert slots.release("a2") == ["b1"]


def test_single_node_runs_one_node_at_a_time():
    slots = WriterSlots(SaveStrategy.SINGLE_NODE)
    assert slots.request(req("a", node="N1", process="A")) == ["a"]
    assert slots.request(req("b", node="N1", process="B")) == ["b"]
    assert slots.request(req("c", node="N2", process="C")) == []
    slots.release("a")
    assert slots.release("b") == ["c"]


def test_no_starvation_a_waiting_request_blocks_later_compatible_ones():
    slots = WriterSlots(SaveStrategy.SINGLE_PROCESS)
    slots.request(req("a1", process="A"))
    assert slots.request(req("b1", process="B")) == []
    # a2 could run beside a1, but b1 came first: a2 waits behind it.
    assert slots.request(req("a2", process="A")) == []
    assert slots.waiting() == ["b1", "a2"]
    assert slots.release("a1") == ["b1"]
    assert slots.release("b1") == ["a2"]


def test_release_of_a_waiting_request_and_idempotent_requests():
    slots = WriterSlots(SaveStrategy.SINGLE_THREAD)
    slots.request(req("a"))
    slots.request(req("b"))
    slots.request(req("b"))
    assert slots.waiting() == ["b"]
    assert slots.release("b") == []  # a failed writer that never got its slot
    assert slots.release("a") == []
    assert slots.holders() == [] and slots.waiting() == []


@pytest.mark.parametrize("strategy", list(SaveStrategy))
def test_adopted_holder_counts_against_the_limit(strategy):
    slots = WriterSlots(strategy)
    slots.adopt(req("old", process="A", node="N1"))
    granted = slots.request(req("new", process="B", node="N2"))
    assert granted == (["new"] if strategy is SaveStrategy.UNRESTRICTED else [])


def test_a_late_renewal_never_retakes_a_released_slot():
    import asyncio

    from ckptd.monitor.slots import SlotLeases

    async def scenario() -> tuple[list[str], dict]:
        leases = SlotLeases(SaveStrategy.SINGLE_THREAD, lease_s=60.0, restarted=False)
        assert await leases.acquire("1/checkpoint/w/a#1", "n", "p") == {"granted": True}
        leases.release("1/checkpoint/w/a#1")  # the unit finished
        leases.renew([("1/checkpoint/w/a#1", "n", "p")])  # a heartbeat sent just before that
        held_after = leases.holders()
        second = await asyncio.wait_for(leases.acquire("1/checkpoint/w/b#2", "n", "p"), 1.0)
        return held_after, second

    held_after, second = asyncio.run(scenario())
    assert held_after == [] and second == {"granted": True}


def test_a_restarted_monitor_grants_nothing_until_holders_could_re_announce():
    import asyncio
    import time

    from ckptd.monitor.slots import SlotLeases

    async def scenario() -> float:
        leases = SlotLeases(SaveStrategy.SINGLE_THREAD, lease_s=0.4, restarted=True)
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(leases.acquire("1/checkpoint/w/b#2", "n", "p"))
        leases.renew([("1/checkpoint/w/a#1", "n", "p")])  # the holder from before the restart
        await asyncio.sleep(0)
        assert not waiter.done()
        leases.release("1/checkpoint/w/a#1")
        assert await waiter == {"granted": True}
        return time.monotonic() - t0

    assert asyncio.run(scenario()) >= 0.2  # held back for half a lease
