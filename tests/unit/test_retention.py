"""Retention decisions (plain Python): what is kept, what is deleted, and what never is."""

from __future__ import annotations

import random

import pytest

from ckptd.config import Kind
from ckptd.layout import StepEntry
from ckptd.monitor.retention import RetentionPolicy, plan_retention

C, S = frozenset({Kind.CHECKPOINT}), frozenset({Kind.STATE_DICT})
BOTH = C | S


def _entries(spec: dict[int, frozenset]) -> dict[int, StepEntry]:
    return {s: StepEntry(s, f"global_step_{s}", kinds) for s, kinds in spec.items()}


def _deleted(spec, policy, protected=(), failed=()):
    plan = plan_retention(_entries(spec), policy, protected=set(protected), failed=set(failed))
    return ([e.step for e in plan.delete], [e.step for e in plan.leftovers_failed],
            [e.step for e in plan.leftovers_idle])


def test_windows_per_kind_and_keep_every_n():
    # Full checkpoints every 5 steps (weights under the state-dict manifest, the rest under the
    # checkpoint one, as pipelines save them), state dicts every step.
    spec = {s: (BOTH if s % 5 == 0 else S) for s in range(1, 21)}
    delete, _, _ = _deleted(spec, RetentionPolicy(max_ckpt_to_keep=2, max_state_dict_to_keep=2, keep_every_n_steps=10))
    kept = sorted(set(spec) - set(delete))
    assert kept == [10, 15, 19, 20]  # 15, 20 newest checkpoints; 19, 20 newest state dicts; 10 every-n


def test_default_policy_keeps_every_full_checkpoint_and_two_state_dicts():
    spec = {s: (C if s % 3 == 0 else S) for s in range(1, 11)}
    delete, _, _ = _deleted(spec, RetentionPolicy())
    assert sorted(set(spec) - set(delete)) == [3, 6, 9, 10]


def test_a_state_dict_being_withdrawn_is_kept_but_does_not_count_toward_the_window():
    spec = {1: S, 2: S, 3: S, 4: S}
    policy = RetentionPolicy(max_state_dict_to_keep=2)
    assert _deleted(spec, policy)[0] == [1, 2]
    # 3's files changed and its withdrawal is retried: 2 is one of the two state dicts that stay.
    plan = plan_retention(_entries(spec), policy, protected=set(), failed=set(), withdrawing={3})
    assert [e.step for e in plan.delete] == [1]
    # A full checkpoint of the step counts as it is: only the state dict is being withdrawn.
    plan = plan_retention(_entries({**spec, 3: BOTH}), policy, protected=set(), failed=set(), withdrawing={3})
    assert [e.step for e in plan.delete] == [1, 2]


def test_a_step_whose_commit_is_settling_is_kept_but_counts_toward_no_window():
    """Its manifest is visible, but its publish may still be taken back: 2 must stay."""
    for spec, policy in (({1: S, 2: S, 3: S, 4: S}, RetentionPolicy(max_state_dict_to_keep=2)),
                         ({1: C, 2: C, 3: C, 4: C}, RetentionPolicy(max_ckpt_to_keep=2, max_state_dict_to_keep=2))):
        plan = plan_retention(_entries(spec), policy, protected=set(), failed=set(), settling={3})
        assert [e.step for e in plan.delete] == [1]
        assert 3 not in plan.counted_newest


def test_never_the_protected_nor_the_newest_nor_anything_newer():
    spec = {1: C, 2: C, 3: C, 4: frozenset(), 5: C}
    delete, _, idle = _deleted(spec, RetentionPolicy(max_ckpt_to_keep=2, max_state_dict_to_keep=2), protected={1})
    assert delete == [2]  # 1 is protected (a tracker target or in flight); 3 and 5 are the newest two
    assert idle == [4]  # uncommitted, unknown to the monitor: only deleted once idle
    spec = {1: C, 2: C, 3: C, 7: frozenset()}  # uncommitted and newer than the newest commit
    assert _deleted(spec, RetentionPolicy(max_ckpt_to_keep=2)) == ([1], [], [])


def test_leftovers_of_failed_steps_go_at_once_in_flight_ones_never():
    spec = {1: frozenset(), 2: frozenset(), 3: frozenset(), 4: C}
    delete, failed, idle = _deleted(spec, RetentionPolicy(), protected={3}, failed={1})
    assert (delete, failed, idle) == ([], [1], [2])


def test_nothing_committed_deletes_nothing():
    assert _deleted({1: frozenset(), 2: frozenset()}, RetentionPolicy(max_ckpt_to_keep=2)) == ([], [], [])


@pytest.mark.parametrize("seed", range(5))
def test_commits_in_random_order_converge_to_the_configured_set(seed):
    """Replaying a pass after every commit, in random order, deletes exactly what a reference
    computation over the final set says, and never a step that is still to commit."""
    rng = random.Random(seed)
    kinds = {s: (BOTH if s % 4 == 0 else S) for s in range(1, 51)}
    policy = RetentionPolicy(max_ckpt_to_keep=3, max_state_dict_to_keep=2, keep_every_n_steps=16)
    order = list(kinds)
    rng.shuffle(order)
    present: dict[int, frozenset] = {}
    deleted: set[int] = set()
    for i, step in enumerate(order):
        present[step] = kinds[step]
        in_flight = set(order[i + 1:])
        plan = plan_retention(_entries({s: k for s, k in present.items() if s not in deleted}), policy,
                              protected=in_flight & set(present), failed=set())
        doomed = {e.step for e in plan.delete}
        assert not doomed & in_flight
        deleted |= doomed
    kept = set(kinds) - deleted
    ckpts = sorted(s for s in kinds if Kind.CHECKPOINT in kinds[s])
    expected = set(ckpts[-3:]) | {49, 50} | {16, 32, 48}
    # A step that one pass deletes is outside the windows of every later pass too (later commits
    # only bring newer steps into a window), so the end result is the reference set.
    assert kept == expected


def test_a_directory_just_created_is_not_idle(tmp_path):
    """A save may have created its step directory and not written a file yet."""
    import os
    import time

    from ckptd.monitor.retention import is_idle
    from ckptd.storage import Storage

    os.makedirs(tmp_path / "global_step_3")
    entry = StepEntry(3, "global_step_3", frozenset())
    storage = Storage(str(tmp_path))
    assert not is_idle(storage, entry, grace_s=600)
    old = time.time() - 3600
    os.utime(tmp_path / "global_step_3", (old, old))
    assert is_idle(storage, entry, grace_s=600)
