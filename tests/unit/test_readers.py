"""The monitor's reader registry: leases against retention, expiry, the hold after a restart, lag."""

from __future__ import annotations

import threading

from ckptd.config import Kind
from ckptd.monitor.readers import ReaderRegistry

SD = Kind.STATE_DICT


def registry(lease_s: float = 10.0) -> ReaderRegistry:
    return ReaderRegistry(lease_s)


def sub(reg: ReaderRegistry, sub_id: str = "s1", now: float = 100.0):
    return reg.heartbeat(sub_id, f"rollout-{sub_id}", SD, "here", now)


def test_a_pinned_step_cannot_be_claimed_for_deletion_and_a_claimed_one_cannot_be_pinned():
    reg = registry()
    s = sub(reg)
    assert reg.pin(s, "l1", 5, 100.0) is None
    assert not reg.claim_for_delete(5)  # retention keeps it
    assert reg.claim_for_delete(6)
    assert "being deleted" in reg.pin(s, "l2", 6, 100.0)
    reg.deleted(6)
    assert reg.pin(s, "l3", 6, 100.0) is None  # the monitor then checks storage, which says it is gone
    assert reg.pinned_steps() == {5, 6}


def _race(step: int) -> dict[str, bool]:
    reg = registry()
    s = sub(reg)
    results: dict[str, bool] = {}
    barrier = threading.Barrier(2)

    def pin() -> None:
        barrier.wait()
        results["pin"] = reg.pin(s, "l", step, 100.0) is None

    def claim() -> None:
        barrier.wait()
        results["claim"] = reg.claim_for_delete(step)

    threads = [threading.Thread(target=pin), threading.Thread(target=claim)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_pins_and_claims_from_two_threads_never_both_succeed():
    for step in range(200):
        results = _race(step)
        assert results["pin"] != results["claim"], results


def test_a_released_lease_is_never_brought_back_by_a_late_renewal():
    reg = registry()
    s = sub(reg)
    reg.pin(s, "l1", 5, 100.0)
    reg.release("l1")
    assert "released" in reg.pin(s, "l1", 5, 101.0)
    assert reg.pinned_steps() == set()


def test_leases_expire_without_renewal_and_renewals_extend_them():
    reg = registry(lease_s=10.0)
    s = sub(reg)
    reg.pin(s, "l1", 5, 100.0)
    reg.pin(s, "l2", 6, 100.0)
    reg.pin(s, "l2", 6, 108.0)  # renewed
    gone = reg.expire(111.0)
    assert [lease.lease_id for lease in gone] == ["l1"]
    assert reg.pinned_steps() == {6}
    assert not reg.live(s, 111.0) and reg.live(s, 105.0)


def test_restored_leases_hold_their_steps_until_renewed_or_expired():
    reg = registry(lease_s=10.0)
    reg.restore("l1", "s1", "rollout-s1", SD, 5, now=200.0)
    reg.restore("l2", "s2", "rollout-s2", SD, 6, now=200.0)
    assert reg.pinned_steps() == {5, 6} and not reg.claim_for_delete(5)
    s1 = sub(reg, "s1", 205.0)
    assert reg.renew(s1, "l1", 5, 205.0) is None
    assert [lease.lease_id for lease in reg.expire(211.0)] == ["l2"]
    assert reg.pinned_steps() == {5}


def test_a_renewal_never_grants_a_lease_and_reports_released_or_expired_ones():
    reg = registry(lease_s=10.0)
    s = sub(reg)
    assert "released or expired" in reg.renew(s, "unknown", 5, 100.0)  # subscribers renew granted leases only
    assert reg.pinned_steps() == set()
    reg.pin(s, "l1", 5, 100.0)
    reg.expire(111.0)
    assert "released or expired" in reg.renew(s, "l1", 5, 112.0)
    assert reg.pinned_steps() == set()


def test_lag_counts_steps_and_seconds_from_the_first_newer_publication():
    reg = registry()
    s = sub(reg)
    assert reg.lag(s, 3, 100.0) == (None, None)  # serves nothing yet
    reg.published(SD, 1, 100.0)
    reg.published(SD, 2, 104.0)
    reg.published(SD, 3, 107.0)
    reg.report_serving(s, 1, 101.0)
    assert reg.lag(s, 3, 110.0) == (2, 6.0)
    reg.report_serving(s, 3, 108.0)
    assert reg.lag(s, 3, 110.0) == (0, 0.0)
    assert s.serving_since == 108.0
    reg.report_serving(s, 3, 109.0)  # the same version again: since stays
    assert s.serving_since == 108.0


def test_lag_seconds_are_unknown_when_the_first_newer_publication_is_older_than_the_monitor_knows():
    reg = registry()
    s = sub(reg)
    reg.published(SD, 5, 100.0)  # restored at start-up: steps before 5 are gone from the root
    reg.known_from(SD, 5)
    reg.published(SD, 6, 104.0)
    reg.report_serving(s, 3, 90.0)
    assert reg.lag(s, 6, 110.0) == (3, None)
    reg.report_serving(s, 5, 101.0)
    assert reg.lag(s, 6, 110.0) == (1, 6.0)


def test_served_versions_of_live_subscribers_only():
    reg = registry(lease_s=10.0)
    a, b = sub(reg, "a", 100.0), sub(reg, "b", 100.0)
    reg.report_serving(a, 4, 100.0)
    reg.report_serving(b, 2, 100.0)
    reg.heartbeat("a", "rollout-a", SD, "here", 108.0)
    assert reg.served_steps(111.0) == {4}
