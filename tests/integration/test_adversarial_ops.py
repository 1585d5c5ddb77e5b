"""Attacks on the commit path through this issue's operational features, with a real local Ray, a
real monitor actor and real files: timing payloads (malformed, huge, for unknown units and steps,
for a failed step), an event store that cannot be written or whose files are damaged before a
monitor restart and a new job, and ``gc`` racing a job that comes back and commits.

Invariants asserted throughout: a step commits only when every registered unit finished and none
failed, and its manifest counts exactly the real units; trackers name committed steps only;
committed files are never changed or removed."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray
import torch

import ckptd
from ckptd.gc import plan_gc, run_gc
from ckptd.layout import MANIFESTS, TRACKERS, parse_tracker, scan_steps
from ckptd.manifest import Manifest
from ckptd.monitor.event_store import EVENTS_DIR
from ckptd.monitor.publication import LEASES
from ckptd.monitor.retention import RetentionPolicy
from ckptd.storage import Storage
from ckptd.verify import verify
from tests.integration.helpers import restart_monitor, status, wait_for


def _writer(coord, step: int, name: str, gate: threading.Event | None = None,
            written: threading.Event | None = None):
    def fn():
        out = coord.step_dir(step)
        os.makedirs(out, exist_ok=True)
        torch.save({"w": torch.full((4,), float(step))}, os.path.join(out, f"{name}.pt"))
        if written is not None:
            written.set()
        if gate is not None:
            assert gate.wait(60), "the test never released the unit"
    return fn


def _manifest_units(root: str, step: int, kind: str = "checkpoint") -> set[str]:
    storage = Storage(root)
    name = next(e.name for s, e in scan_steps(storage).items() if s == step)
    text = storage.read_text_or_none(storage.join(name, MANIFESTS[ckptd.Kind(kind)]))
    return set(Manifest.model_validate_json(text).units) if text else set()


def _trackers_name_committed_steps(root: str) -> None:
    storage = Storage(root)
    entries = scan_steps(storage)
    for kind, path in TRACKERS.items():
        step = parse_tracker(storage.read_text_or_none(storage.join(path)))
        if step is not None:
            assert step in entries and entries[step].committed, (kind, step, entries)
            verify(root, step, kind=kind.value)


def _unit_dict(worker: str, name: str, step: int, call: str) -> dict:
    return {"worker": worker, "name": name, "step": step, "kind": "checkpoint", "call": call}


def _garbage_timing(step: int) -> list[tuple]:
    """Timing notifications no coordinator of this ckptd sends, but a foreign or buggy one could."""
    fake = _unit_dict("ghost", "model", step, "ghost-1")
    entry = {"unit": fake, "start": 1.0, "admitted": None, "end": 2.0, "error": None}
    return [
        ("timing", None, None), ("timing", None, "not a dict"), ("timing", None, {"timing": "x"}),
        ("timing", None, {"timing": {"units": 5, "blocked": "y"}}),
        ("timing", None, {"timing": {"units": [{"unit": fake}, "junk", {**entry, "error": OSError("x")}]}}),
        ("timing", fake, {"timing": {"units": [entry]}}),  # names a unit: must not count as one
        ("timing", None, {"timing": {"units": [{**entry, "unit": {**fake, "step": 10**12}}]}}),  # unknown step
        ("timing", None, {"timing": {"units": [entry] * 20_000}}),  # huge
        ("from-a-newer-coordinator", None, {"timing": {"units": [entry]}}),  # skipped, not the batch
    ]


def test_timing_garbage_never_counts_as_a_unit_nor_stops_commits_or_persisting(make_monitor, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, timeline_flush_s=0.1, step_timeout_s=120)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gate = threading.Event()

    # Step 1: two units registered; one finishes, the other is held. Timing notifications (before,
    # among and after the unit events) that name a third unit must not complete the step.
    coord.register(1, checkpoint_thread_count=2)
    assert ray.get(monitor.notify_batch.remote(_garbage_timing(1))) == [None] * len(_garbage_timing(1))
    coord.save_async("model", _writer(coord, 1, "model"), 1)
    coord.save_async("optim", _writer(coord, 1, "optim", gate), 1)
    # A started/finished payload's own "timing" is garbage too: it rides along with real units.
    ray.get(monitor.notify_batch.remote(_garbage_timing(1)))
    st = status(monitor).step(1)
    assert st.state.value == "pending" and len(st.finished) <= 1, st
    gate.set()
    coord.wait_committed(1, timeout_s=30)
    assert {k.split("#")[0] for k in _manifest_units(root, 1)} == {"w0/model", "w0/optim"}

    # Step 2 fails; timing for it afterwards neither revives it nor blocks step 3.
    coord.register(2, checkpoint_thread_count=1)
    coord.save_async("model", lambda: (_ for _ in ()).throw(OSError("disk on fire")), 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk on fire"):
        coord.wait_committed(2, timeout_s=30)
    ray.get(monitor.notify_batch.remote(_garbage_timing(2)))
    coord.register(3, checkpoint_thread_count=1)
    coord.save_async("model", _writer(coord, 3, "model"), 3)
    coord.wait_committed(3, timeout_s=30)
    assert status(monitor).step(2).state.value == "failed"
    assert ckptd.latest_step(root) == 3
    _trackers_name_committed_steps(root)

    # Every later flush still works (a non-JSON span used to fail each of them), and the spans of
    # the garbage's unknown step are kept apart from the real ones.
    got = ray.get(monitor.timeline.remote(flush=True))
    assert got["flushed"] is True
    commits = {s["step"] for s in got["spans"] if s["lane"] == "commit" and "error" not in s}
    assert commits == {1, 3}

    # Damage the persisted files, then restart the monitor: it comes back with what it can read,
    # and commits again.
    events = os.path.join(root, EVENTS_DIR, run_name)
    for name, body in (("9999999999990-x-000001-c.json", b"[1, 2]"), ("9999999999990-x-000002-c.json", b"\xff\x00"),
                       ("9999999999990-x-000003-c.json", b'{"format": 1, "spans": [{"la')):
        with open(os.path.join(events, name), "wb") as f:
            f.write(body)
    restart_monitor(monitor)
    back = ray.get(monitor.timeline.remote())
    assert {1, 3} <= {s["step"] for s in back["spans"] if s["lane"] == "commit"}
    coord.register(4, checkpoint_thread_count=1)
    coord.save_async("model", _writer(coord, 4, "model"), 4)
    coord.wait_committed(4, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk on fire"):
        coord.close()

    # A new job (a new attempt) of the same run on the same root: reads the history, commits.
    # (ray.kill gives the monitor no time to flush: what it had not written yet is lost.)
    assert ray.get(monitor.timeline.remote(flush=True))["flushed"] is True
    ray.kill(monitor, no_restart=True)
    monitor2 = make_monitor(root, run=run_name, timeline_flush_s=0.1)
    again = ray.get(monitor2.timeline.remote())
    assert {1, 3, 4} <= {s["step"] for s in again["spans"] if s["lane"] == "commit"}
    coord2 = ckptd.CheckpointCoordinator(monitor2, worker_id="w0")
    coord2.register(5, checkpoint_thread_count=1)
    coord2.save_async("model", _writer(coord2, 5, "model"), 5)
    coord2.wait_committed(5, timeout_s=30)
    # Garbage timing inside a unit's own started and finished payloads: the unit still counts, once.
    coord2.register(6, checkpoint_thread_count=1)
    unit = _unit_dict("raw", "model", 6, "raw-1")
    bad = {"units": [{"unit": None}, 7], "blocked": [None, {"step": "x"}]}
    answers = ray.get(monitor2.notify_batch.remote([
        ("started", unit, {"timing": "garbage"}), ("started", unit, {"timing": bad}),
        ("finished", unit, {"files": [], "found": False, "timing": bad}),
        ("finished", unit, {"files": [], "timing": {"units": [{"unit": unit, "start": "soon"}]}}),
    ]))
    assert answers == [{"admitted": True}, {"admitted": True}, None, None]
    coord2.wait_committed(6, timeout_s=30)
    assert _manifest_units(root, 6) == {"raw/model#raw-1"}
    coord2.close()
    assert ray.get(monitor2.timeline.remote(flush=True))["flushed"] is True
    _trackers_name_committed_steps(root)
    for step in (1, 3, 4, 5, 6):
        verify(root, step)


def test_an_event_store_that_cannot_be_written_fails_no_commit(make_monitor, tmp_path):
    root = tmp_path / "ckpt"
    (root / ".ckptd").mkdir(parents=True)
    (root / EVENTS_DIR).write_text("a file where the events directory goes")  # every flush fails
    monitor = make_monitor(str(root), timeline_flush_s=0.05)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        coord.register(step, checkpoint_thread_count=1)
        coord.save_async("model", _writer(coord, step, "model"), step)
        coord.wait_committed(step, timeout_s=30)
    coord.close()
    assert ray.get(monitor.timeline.remote(flush=True))["flushed"] is False
    assert ckptd.latest_step(str(root)) == 2
    (root / EVENTS_DIR).unlink()  # repaired: the spans kept in memory go out with the next flush
    assert ray.get(monitor.timeline.remote(flush=True))["flushed"] is True
    _trackers_name_committed_steps(str(root))


def test_gc_keeps_what_a_job_commits_between_plan_and_run(make_monitor, tmp_path):
    """``ckptd gc`` asks the cluster once, then plans and removes: a job that comes back in between
    (another cluster, or one that started just after the check) may commit what the plan lists."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, step_timeout_s=120)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gate4, gate5, written4, written5 = (threading.Event() for _ in range(4))
    # Step 4: the state dict committed; the checkpoint's other unit has written optim.pt and is
    # still running, so the file is in no manifest yet. Step 5: written, not committed.
    coord.register(4, is_state_dict=True, state_dict_thread_count=1)
    coord.save_async("model", _writer(coord, 4, "model"), 4, is_state_dict=True)
    coord.wait_committed(4, is_state_dict=True, timeout_s=30)
    coord.register(4, checkpoint_thread_count=1)
    coord.save_async("optim", _writer(coord, 4, "optim", gate4, written4), 4)
    coord.register(5, checkpoint_thread_count=1)
    coord.save_async("model", _writer(coord, 5, "model", gate5, written5), 5)
    name4, name5 = (os.path.basename(coord.step_dir(s)) for s in (4, 5))
    try:
        assert written4.wait(30) and written5.wait(30)
        plan = plan_gc(root, min_idle_s=0)
    finally:
        gate4.set()
        gate5.set()
    assert {f"{name4}/optim.pt", name5} <= {g.path for g in plan.items}
    coord.wait_committed(4, timeout_s=30)
    coord.wait_committed(5, timeout_s=30)
    with pytest.raises(ckptd.CheckpointConfigError, match="is live on .* before collecting garbage"):
        run_gc(plan)  # this process's cluster runs the root's monitor: refused, nothing removed
    assert os.path.exists(os.path.join(root, name5))
    removed = {g.path for g in run_gc(plan, check_live=False)}  # as from a process that cannot see it
    assert f"{name4}/optim.pt" not in removed and name5 not in removed
    coord.close()
    verify(root, 4)  # the committed checkpoint lists optim.pt: it must still be there
    verify(root, 5)
    assert sorted(scan_steps(Storage(root))) == [4, 5]
    _trackers_name_committed_steps(root)
    # Past a policy, step 4 would go, but not while the run's mirror lacks it (here: holds nothing).
    policy = RetentionPolicy(1, 1)
    assert [g.path for g in plan_gc(root, policy=policy, min_idle_s=0).items if g.committed] == [name4]
    assert not plan_gc(root, policy=policy, min_idle_s=0, mirror=str(tmp_path / "mirror")).items
    # A reader's lease on step 4 recorded between plan and run (a monitor came back and pinned it).
    plan = plan_gc(root, policy=policy, min_idle_s=0)
    leases = os.path.join(root, LEASES)
    os.makedirs(leases, exist_ok=True)
    with open(os.path.join(leases, "reader-1.json"), "w") as f:
        f.write('{"lease": "reader-1", "subscriber": "s", "name": "n", "kind": "checkpoint", "step": 4}')
    assert run_gc(plan, check_live=False) == []
    verify(root, 4)


def test_sigterm_before_the_first_save_and_again_during_the_final_save(make_monitor, tmp_path):
    """Two SIGTERMs, the first before anything was saved, the second while the final save writes:
    one save of the step, one unit in its commit, the first notice's time kept, exit code 75."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="rank0")
    calls, writing, gate = [], threading.Event(), threading.Event()

    def save(step: int) -> None:
        calls.append(step)
        coord.register(step, checkpoint_thread_count=1)
        coord.save_async("model", _writer(coord, step, "model", gate, writing), step)

    def second_sigterm() -> None:
        assert writing.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: guard.notice is not first, what="the second SIGTERM's handler")  # a new Notice
        gate.set()

    with ckptd.PreemptionGuard(coord, save, exit=False, watch_ray_drain=False, grace_s=60) as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: guard.preempted, what="the SIGTERM handler")
        first = guard.notice
        helper = threading.Thread(target=second_sigterm)
        helper.start()
        try:
            outcome = guard.at_step_boundary(1)
        finally:
            gate.set()
            helper.join()
        assert guard.at_step_boundary(2) is outcome
    assert guard.notice.received_at == first.received_at  # the second notice did not restart the clock
    assert calls == [1] and outcome.saved and outcome.complete and outcome.error is None
    assert outcome.exit_code == ckptd.PREEMPTED_EXIT_CODE == 75
    assert {k.split("#")[0] for k in _manifest_units(root, 1)} == {"rank0/model"}
    assert ckptd.latest_step(root) == 1
    coord.close()


def test_gc_collects_a_crashed_attempts_directory_of_a_step_another_epoch_committed(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, step_dir_template="epoch-{epoch}_step-{step}")
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(5, checkpoint_thread_count=1)
    out = coord.step_dir(5, epoch=1)

    def write() -> list[str]:
        os.makedirs(out, exist_ok=True)
        torch.save({"w": torch.ones(4)}, f"{out}/model.pt")
        return [f"{out}/model.pt"]

    coord.save_async("model", write, 5)
    coord.wait_committed(5, timeout_s=30)
    coord.close()
    ray.kill(monitor, no_restart=True)
    # An older attempt crashed while saving step 5 under epoch 0 (found after the commit: with
    # both present while saving, the commit refuses to pick one).
    crashed = os.path.join(root, "epoch-0_step-5")
    os.makedirs(crashed)
    torch.save({"w": torch.zeros(4)}, f"{crashed}/model.pt")

    plan = plan_gc(root, min_idle_s=0)
    assert [g.path for g in plan.items] == ["epoch-0_step-5"]
    assert plan_gc(root).kept_busy == ["epoch-0_step-5"]  # just written: not idle yet
    run_gc(plan)
    assert not os.path.exists(crashed)
    verify(root, 5)
    assert ckptd.latest_step(root) == 5


def test_gc_forced_on_a_step_being_saved_fails_the_step_instead_of_committing_missing_files(make_monitor, tmp_path):
    """--min-idle 0 with a job still writing (no live-monitor check reached it): the files gc
    removed are in the units' reports, so the commit check must fail the step, never commit it."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, step_timeout_s=120)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(1, checkpoint_thread_count=1)
    coord.save_async("model", _writer(coord, 1, "model"), 1)
    coord.wait_committed(1, timeout_s=30)
    gate, written = threading.Event(), threading.Event()
    coord.register(2, checkpoint_thread_count=2)
    coord.save_async("model", _writer(coord, 2, "model"), 2)
    coord.save_async("optim", _writer(coord, 2, "optim", gate, written), 2)
    try:
        assert written.wait(30)
        wait_for(lambda: len(status(monitor).step(2).finished) == 1, what="the first unit's report")
        removed = run_gc(plan_gc(root, min_idle_s=0), check_live=False)
    finally:
        gate.set()
    assert os.path.basename(coord.step_dir(2)) in {g.path for g in removed}
    with pytest.raises(ckptd.CheckpointSaveError, match="missing from storage"):
        coord.wait_committed(2, timeout_s=30)
    assert ckptd.latest_step(root) == 1
    _trackers_name_committed_steps(root)
    coord.close()  # the failure was reported by wait_committed


def test_gc_on_an_object_store_removes_only_idle_leftovers(make_monitor, s3_root):
    root, opts = s3_root
    monitor = make_monitor(root, opts)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root, opts)

    def put(rel: str, data: bytes = b"x" * 100) -> None:
        storage.fs.pipe_file(storage.join(rel), data)

    coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    coord.save_async("model", lambda: put("global_step_1/model.bin"), 1, is_state_dict=True)  # found by listing
    coord.wait_committed(1, is_state_dict=True, timeout_s=30)
    coord.close()
    ray.kill(monitor, no_restart=True)
    # What a dead job left: the rest of step 1's checkpoint, an uncommitted step 2, a temp object.
    for rel in ("global_step_1/optim.bin", "global_step_2/model.bin", "global_step_2/sub/x.bin",
                ".ckptd-tmp-model.bin-0123456789ab"):
        put(rel)
    assert plan_gc(root, storage_options=opts).items == []  # just written: nothing is idle yet
    plan = plan_gc(root, min_idle_s=0, storage_options=opts)
    assert {g.path for g in plan.items} == {"global_step_1/optim.bin", "global_step_2",
                                           ".ckptd-tmp-model.bin-0123456789ab"}
    run_gc(plan, storage_options=opts)
    files = set(storage.walk_files(storage.root))
    assert {f for f in files if "/" in f and not f.startswith(".ckptd/")} == {
        "global_step_1/model.bin", "global_step_1/ckptd_state_dict_manifest.json"}
    assert not any(f.startswith(".ckptd-tmp-") for f in files)
    verify(root, 1, kind="state_dict", storage_options=opts)
    assert plan_gc(root, min_idle_s=0, storage_options=opts).items == []
