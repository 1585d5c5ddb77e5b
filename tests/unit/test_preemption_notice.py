"""The rules behind PreemptionGuard: deadlines, combined notices, the ranks' vote, exit codes."""

from __future__ import annotations

import math

from ckptd import PREEMPTED_EXIT_CODE, PREEMPTION_INCOMPLETE_EXIT_CODE, PreemptionOutcome
from ckptd.coordinator.notice import (
    Notice,
    NoticeSource,
    already_saved,
    deadline_of,
    decode_agreement,
    earliest,
    encode_for_agreement,
)

SIGTERM = Notice(NoticeSource.SIGNAL, 100.0, None, "SIGTERM")


def test_the_deadline_is_the_grace_period_or_a_sooner_deadline_of_the_notice():
    assert deadline_of(SIGTERM, 25.0) == 125.0
    assert deadline_of(Notice(NoticeSource.RAY_DRAIN, 100.0, 110.0), 25.0) == 110.0  # Ray's is sooner
    assert deadline_of(Notice(NoticeSource.RAY_DRAIN, 100.0, 200.0), 25.0) == 125.0  # ours is sooner


def test_of_two_notices_the_first_counts_with_the_sooner_deadline():
    drain = Notice(NoticeSource.RAY_DRAIN, 103.0, 118.0, "drain")
    assert earliest(None, None) is None
    assert earliest(SIGTERM, None) is SIGTERM and earliest(None, drain) is drain
    both = earliest(drain, SIGTERM)
    assert (both.source, both.received_at, both.deadline, both.detail) == (NoticeSource.SIGNAL, 100.0, 118.0, "SIGTERM")
    assert earliest(SIGTERM, drain) == both


def test_ranks_vote_with_a_min_all_reduce():
    assert encode_for_agreement(None, 25.0) == (0.0, math.inf)
    assert encode_for_agreement(SIGTERM, 25.0) == (-1.0, 125.0)
    votes = [encode_for_agreement(SIGTERM, 25.0), encode_for_agreement(None, 25.0)]
    flag, deadline = min(v[0] for v in votes), min(v[1] for v in votes)  # what all_reduce(MIN) computes

    mine = decode_agreement(flag, deadline, SIGTERM, now=101.0)
    assert mine.source is NoticeSource.SIGNAL and mine.received_at == 100.0 and mine.deadline == 125.0
    peer = decode_agreement(flag, deadline, None, now=101.0)
    assert peer.source is NoticeSource.PEER and peer.received_at == 101.0 and deadline_of(peer, 25.0) == 125.0
    assert decode_agreement(0.0, math.inf, None, now=101.0) is None  # nobody was told: train on


def test_a_step_already_saved_is_not_saved_again():
    assert not already_saved(7, None)
    assert not already_saved(7, 5)
    assert already_saved(7, 7)
    assert already_saved(7, 9)


def outcome(**changes) -> PreemptionOutcome:
    fields = dict(step=7, source="signal", detail="SIGTERM", saved=True, committed=True, mirrored=None,
                  deadline=125.0, elapsed_s=2.0, error=None)
    return PreemptionOutcome(**{**fields, **changes})


def test_exit_codes_say_whether_the_final_step_is_safe():
    assert PREEMPTED_EXIT_CODE != PREEMPTION_INCOMPLETE_EXIT_CODE and 0 not in (PREEMPTED_EXIT_CODE,
                                                                                PREEMPTION_INCOMPLETE_EXIT_CODE)
    assert outcome().exit_code == PREEMPTED_EXIT_CODE
    assert outcome(mirrored=True).exit_code == PREEMPTED_EXIT_CODE
    assert outcome(error="an earlier save failed").exit_code == PREEMPTED_EXIT_CODE  # the final step is safe
    assert outcome(committed=False, error="deadline").exit_code == PREEMPTION_INCOMPLETE_EXIT_CODE
    assert outcome(mirrored=False, error="deadline").exit_code == PREEMPTION_INCOMPLETE_EXIT_CODE
