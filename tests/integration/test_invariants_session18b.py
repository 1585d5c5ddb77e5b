"""A helper's attack on attempt-bound coordinators and relays (session 18b).

Orders: an old job's unit that fails after a new job (same run name, same or another root) has
started; background registrations racing a monitor restart (Trinity's additive counting, and a full
checkpoint waiting for its step's state-dict units). Real local Ray, real files, real monitors.
"""

from __future__ import annotations

import pytest
import ray

import ckptd
from ckptd.config import Kind

from .helpers import (
    Gate,
    assert_not_committed,
    assert_trackers_verified,
    disk_full,
    in_thread,
    read_manifest,
    restart_monitor,
    start_new_job,
    status,
    wait_all,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = Kind.CHECKPOINT, Kind.STATE_DICT


class _FailingGate(Gate):
    """Admitted, waits for open(), writes part of its file, then fails with "disk full"."""

    def __call__(self) -> list[str]:
        self.entered.set()
        assert self._open.wait(60)
        write_step_file(self.root, self.step, self.name)
        disk_full()
        return []


@pytest.mark.parametrize("same_root", [True, False], ids=["same-root", "other-root"])
@pytest.mark.parametrize("relay", [False, True], ids=["direct", "node-relay"])
def test_an_old_jobs_unit_failing_after_the_new_job_starts_neither_fails_nor_commits_its_step(
        make_monitor, tmp_path, same_root, relay):
    """Invariants 1, 2: a unit of job 1 (admitted, mid-write) fails after job 2 started under the
    same run name (same root or another). Job 1's failure must not fail job 2's step 5 (registered
    with two units, one saved): it stays uncommitted until job 2's own second unit, then commits
    with job 2's units only; job 1's coordinator is told its save failed/did not count; trackers
    only name steps that verify, on both roots."""
    opts = {"node_relay": True} if relay else {}
    root_a = str(tmp_path / "a")
    root_b = root_a if same_root else str(tmp_path / "b")
    monitor = make_monitor(root_a, **opts)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=20.0)
    old.register(5, checkpoint_thread_count=1)
    gate = _FailingGate(root_a, 5, "late.partial")
    old.save_async("late", gate, 5)
    assert gate.entered.wait(30)
    try:
        monitor2 = start_new_job(make_monitor, root_b, monitor, **opts)
        new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=20.0)
        new.register(5, checkpoint_thread_count=2)
        new.save_sync(lambda: write_step_file(root_b, 5, "mine.bin"), 5)
        gate.open()
        result = in_thread(lambda: wait_all(old), 90)
        assert result[0] == "ok" and result[1] is not None, f"job 1 was not told: {result}"
        s = status(monitor2).step(5, CKPT)
        assert s is None or s.state.value != "failed", f"job 1's failure failed job 2's step 5: {s}"
        assert_not_committed(new, 5)
        new.save_sync(lambda: write_step_file(root_b, 5, "mine2.bin"), 5)
        new.wait_committed(5, timeout_s=30)
        m = read_manifest(root_b, 5, CKPT)
        # docs/contract.md: an old job's process still writing into the step after the new job
        # started has its reports refused; its files are listed as written outside save units.
        files = sorted(f.path for f in m.files)
        units = sorted(u.split("#")[0] for u in m.units)
        if same_root:
            assert files == ["late.partial", "mine.bin", "mine2.bin"], files
            assert units == ["(written outside save units)", "w1/sync", "w1/sync"], m.units
        else:
            assert files == ["mine.bin", "mine2.bin"], files
            assert units == ["w1/sync", "w1/sync"], m.units
        assert_trackers_verified(root_b)
        assert_trackers_verified(root_a)
        new.close()
    finally:
        gate.open()
        in_thread(old.close, 60)


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
def test_background_registrations_racing_a_restart_add_up(make_monitor, tmp_path, how):
    """Invariant 3 (and 1): register(S, checkpoint_thread_count=1, wait=False) twice, the second
    racing a monitor restart, expects two units: one saved unit never commits S; the second does."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    coord.register(7, checkpoint_thread_count=1, wait=False)
    t = in_thread(lambda: restart_monitor(monitor, how=how), 0.01)  # noqa: F841 - started, not joined
    coord.register(7, checkpoint_thread_count=1, wait=False)
    wait_for(lambda: ray.get(monitor.ping.remote(), timeout=30) is not None, timeout_s=60, what="monitor up")
    coord.save_sync(lambda: write_step_file(root, 7, "a.bin"), 7)
    assert_not_committed(coord, 7)
    assert read_manifest(root, 7, CKPT) is None
    coord.save_sync(lambda: write_step_file(root, 7, "b.bin"), 7)
    coord.wait_committed(7, timeout_s=30)
    assert sorted(f.path for f in read_manifest(root, 7, CKPT).files) == ["a.bin", "b.bin"]
    assert assert_trackers_verified(root)[CKPT] == 7
    assert wait_all(coord) is None
    coord.close()


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
def test_a_full_checkpoint_waits_for_state_dict_units_registered_across_a_restart(make_monitor, tmp_path, how):
    """Invariant 3 (and 1): step S registered wait=False with one checkpoint unit and one
    state-dict unit, a restart in between saves: the full checkpoint of S must not commit while its
    state-dict save is missing, and commits once it lands (state dict first or together)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    coord.register(3, state_dict_thread_count=1, checkpoint_thread_count=1, wait=False)
    coord.save_sync(lambda: write_step_file(root, 3, "optim.bin"), 3)
    restart_monitor(monitor, how=how)
    assert_not_committed(coord, 3)
    assert read_manifest(root, 3, CKPT) is None
    assert assert_trackers_verified(root)[CKPT] is None
    coord.save_sync(lambda: write_step_file(root, 3, "model.bin"), 3, is_state_dict=True)
    coord.wait_committed(3, is_state_dict=True, timeout_s=30)
    coord.wait_committed(3, timeout_s=30)
    assert assert_trackers_verified(root) == {CKPT: 3, SD: 3}
    assert wait_all(coord) is None
    coord.close()


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
def test_a_step_failed_then_registered_in_the_background_across_a_restart_never_commits(
        make_monitor, tmp_path, how):
    """Invariant 2: a step whose unit failed (reported to the caller) stays failed when the caller
    registers it again with wait=False racing a restart and saves a good unit for it."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    coord.register(4, checkpoint_thread_count=1)

    def bad():
        write_step_file(root, 4, "optim.partial")
        disk_full()

    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(bad, 4)
    coord.register(4, checkpoint_thread_count=1, wait=False)
    restart_monitor(monitor, how=how)
    try:
        coord.save_sync(lambda: write_step_file(root, 4, "good.bin"), 4)
    except ckptd.CheckpointError:
        pass
    for _ in range(4):
        if in_thread(coord.wait_all, 60)[0] == "ok":
            break
    result = in_thread(lambda: coord.wait_committed(4, timeout_s=5), 30)
    assert result[0] == "raised", f"a step reported failed committed: {result}"
    assert read_manifest(root, 4, CKPT) is None, "a step reported failed committed"
    assert assert_trackers_verified(root)[CKPT] is None
    coord.close()


def test_a_fence_left_by_keyboard_interrupt_fails_the_save_it_did_not_wait_for(make_monitor, tmp_path):
    """Invariants 1, 2: before_update() interrupted by Ctrl-C (KeyboardInterrupt in the main
    thread while it helps a fenced staging copy) fails that save: the step never commits (its
    copy cannot vouch for the state), wait_all reports it, trackers name only verified steps, and
    the name's next fenced save (its buffers reused) commits a later step."""
    import signal
    import threading
    import time

    import torch

    from ckptd import failpoints

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    state = {"w": torch.ones(64 * 1024 * 1024)}  # 256 MiB: 16 chunks of the staging copy
    interrupted_step = None
    main = threading.main_thread().ident
    # A real SIGINT (a simulated one is not raised until a blocked wait returns), sent 50 ms after
    # the fence was entered. Each chunk takes 0.2 s more (in whichever thread copies it), so the
    # copy lasts at least 1.6 s and the interrupt lands inside the fence however loaded the
    # machine is. xdist's workers ignore SIGINT: Python's own handler is put back meanwhile.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    failpoints.arm("staging_chunk", "delay:0.2")
    try:
        for step in (10, 11, 12):
            coord.register(step, checkpoint_thread_count=1)
            coord.save_state_async("model", state, step, fenced=True)
            entered, done = threading.Event(), threading.Event()

            def interrupt(entered=entered) -> None:
                if entered.wait(30):
                    time.sleep(0.05)
                    signal.pthread_kill(main, signal.SIGINT)

            sender = threading.Thread(target=interrupt, name="sigint-sender")
            sender.start()
            try:
                entered.set()
                coord.before_update()
                done.set()
                sender.join()  # a signal sent just after the fence returned lands here
            except KeyboardInterrupt:
                if not done.is_set():
                    interrupted_step = step
                    break
            finally:
                sender.join()
            coord.wait_committed(step, timeout_s=60)
    finally:
        failpoints.disarm("staging_chunk")
        signal.signal(signal.SIGINT, previous)
    assert interrupted_step is not None, "the interrupt never landed inside before_update"
    state["w"].fill_(2.0)  # the caller goes on and changes the source
    result = in_thread(coord.wait_all, 60)
    assert result[0] == "raised" and isinstance(result[1], ckptd.CheckpointSaveError), result
    r = in_thread(lambda: coord.wait_committed(interrupted_step, timeout_s=10), 30)
    assert r[0] == "raised" and not isinstance(r[1], TimeoutError), f"interrupted step: {r}"
    assert read_manifest(root, interrupted_step, CKPT) is None, "an interrupted fenced save committed"
    assert_trackers_verified(root)
    nxt = interrupted_step + 1
    coord.register(nxt, checkpoint_thread_count=1)
    coord.save_state_async("model", state, nxt, fenced=True)
    coord.before_update()
    coord.wait_committed(nxt, timeout_s=60)
    assert assert_trackers_verified(root)[CKPT] == nxt
    from safetensors.torch import load_file
    d = ckptd.step_dir(root, nxt)
    assert torch.equal(load_file(f"{d}/model.safetensors")["w"][:8], torch.full((8,), 2.0))
    assert wait_all(coord) is None
    coord.close()


def test_state_dict_registrations_add_up_and_the_full_checkpoint_waits_for_both(make_monitor, tmp_path):
    """Invariant 3: register(S, state_dict_thread_count=1, checkpoint_thread_count=1, wait=False)
    twice (a SIGKILL restart in between) expects two state-dict and two checkpoint units; with both
    checkpoint units and one state-dict unit saved, neither kind commits; the second state-dict
    unit commits both."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    coord.register(8, state_dict_thread_count=1, checkpoint_thread_count=1, wait=False)
    restart_monitor(monitor, how="sigkill")
    coord.register(8, state_dict_thread_count=1, checkpoint_thread_count=1, wait=False)
    coord.save_sync(lambda: write_step_file(root, 8, "o1.bin"), 8)
    coord.save_sync(lambda: write_step_file(root, 8, "o2.bin"), 8)
    coord.save_sync(lambda: write_step_file(root, 8, "m1.bin"), 8, is_state_dict=True)
    assert_not_committed(coord, 8, is_state_dict=True)
    assert_not_committed(coord, 8)
    assert read_manifest(root, 8, CKPT) is None and read_manifest(root, 8, SD) is None
    coord.save_sync(lambda: write_step_file(root, 8, "m2.bin"), 8, is_state_dict=True)
    coord.wait_committed(8, timeout_s=30)
    assert assert_trackers_verified(root) == {CKPT: 8, SD: 8}
    assert sorted(f.path for f in read_manifest(root, 8, SD).files) == ["m1.bin", "m2.bin"]
    assert wait_all(coord) is None
    coord.close()
