"""A helper's attack on ``register(..., wait=False)`` (session 17): background registrations must
change when the caller learns the monitor's answer, never what commits. Each test states one
invariant and would fail if it broke. It found two bugs, fixed since: a step could commit short
(a unit finishing before its coordinator's earlier background registrations arrived), and a
closed coordinator accepted a first wait=False registration.

The tests that only look at their own steps share one monitor (``env``: each its own block of
steps); those that restart or kill the monitor, or look at its trackers, have their own."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import ray

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS, TRACKERS

from .helpers import (
    REPO,
    disk_full,
    hold_registrar,
    in_thread,
    read_manifest,
    restart_monitor,
    status,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT = Kind.CHECKPOINT

SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}  # no test's steps go while another runs


def _files(root: str, step: int, kind: Kind = CKPT) -> list[str] | None:
    m = read_manifest(root, step, kind)
    return None if m is None else sorted(f.path for f in m.files)


def _snapshot(root: str, steps: list[int]) -> dict[str, bytes | None]:
    """The bytes of the trackers and of the manifests of ``steps``: what a commit publishes."""
    paths = [os.path.join(root, name) for name in TRACKERS.values()]
    paths += [os.path.join(ckptd.step_dir(root, s), MANIFESTS[k]) for s in steps for k in Kind]
    out = {}
    for p in paths:
        try:
            with open(p, "rb") as f:
                out[p] = f.read()
        except FileNotFoundError:
            out[p] = None
    return out


def _registrar_threads(worker: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"ckptd-register-{worker}"]


# -- 1. a step commits whole, counts once ------------------------------------------------------


def test_two_background_registrations_made_before_any_unit_never_commit_the_step_short(env):
    """Steps S+1 (whose commit is held) and S+5 of the test's block on the shared monitor."""
    root, monitor, s1, s5 = env.root, env.monitor, env.s + 1, env.s + 5
    coord = env.coord()
    # Hold the registrar deterministically: a registration of step S+1 waits (quiesce) while the
    # commit of step S+1 is in flight, held in before_manifest for 3 s. Everything queued behind it
    # waits too.
    hold_registrar(coord, monitor, root, seconds=3, step=s1)
    # Trinity's additive counting, both registrations made before any unit of step S+5 starts.
    coord.register(s5, checkpoint_thread_count=1, wait=False)
    coord.register(s5, checkpoint_thread_count=1, wait=False)
    coord.save_sync(lambda: write_step_file(root, s5, "a.bin"), s5)
    # The registrar was held while a.bin was written, and the unit reported itself finished only
    # once both registrations made before it were applied (before the fix: expected 0, finished 1).
    s = status(monitor).step(s5)
    assert (s.expected, len(s.finished)) == (2, 1)
    errors = []
    # The same call sequence with blocking registrations (register, register, save, wait_all, save)
    # commits both units.
    for call in (coord.wait_all, lambda: coord.save_sync(lambda: write_step_file(root, s5, "b.bin"), s5),
                 coord.wait_all):
        try:
            call()
        except ckptd.CheckpointError as e:
            errors.append(e)
    coord.wait_committed(s5, timeout_s=30)
    # Two units were registered before either ran: the step commits with both, and nothing failed.
    assert _files(root, s5) == ["a.bin", "b.bin"]
    assert errors == []
    coord.close()


def test_background_registrations_survive_a_sigkill_of_the_monitor_and_count_once(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(3, checkpoint_thread_count=1, wait=False)
    coord.wait_all()  # applied (durable) before the monitor dies
    restart_monitor(monitor, how="sigkill")
    coord.register(3, checkpoint_thread_count=1, wait=False)  # to the restarted monitor
    coord.save_async("a", lambda: write_step_file(root, 3, "a.bin"), 3)
    coord.wait_all()
    s = status(monitor).step(3)
    assert (s.expected, len(s.finished), s.committed) == (2, 1, False)  # replayed 1 + new 1, not 1 or 3
    assert ckptd.latest_step(root) is None
    restart_monitor(monitor, how="ray.kill")
    coord.save_async("b", lambda: write_step_file(root, 3, "b.bin"), 3)
    coord.wait_committed(3, timeout_s=30)
    assert _files(root, 3) == ["a.bin", "b.bin"]
    assert len(read_manifest(root, 3, CKPT).registrations) == 2
    assert ckptd.latest_step(root) == 3
    coord.close()


def test_registrations_queued_while_the_monitor_restarts_all_arrive_once(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    ray.kill(monitor, no_restart=False)
    for _ in range(4):  # queued and retried while Ray restarts the monitor
        coord.register(6, checkpoint_thread_count=1, wait=False)
    coord.wait_all()
    assert status(monitor).step(6).expected == 4
    for i in range(4):
        coord.save_async(f"u{i}", lambda i=i: write_step_file(root, 6, f"u{i}.bin"), 6)
    coord.wait_committed(6, timeout_s=30)
    assert _files(root, 6) == [f"u{i}.bin" for i in range(4)]
    coord.close()


# -- 2. ordering -------------------------------------------------------------------------------


def test_a_blocking_register_is_applied_after_the_background_ones_made_before_it(make_monitor, tmp_path):
    """Step 7 has one finished unit: the first registration to arrive commits it and any later one
    adding units is refused. Which call is refused shows the order the monitor applied them in."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_sync(lambda: write_step_file(root, 7, "a.bin"), 7)
    coord.register(7, checkpoint_thread_count=1, wait=False)  # made first: commits step 7
    with pytest.raises(ckptd.RegistrationConflictError, match="step 7"):
        coord.register(7, checkpoint_thread_count=1)  # made second: refused itself
    coord.wait_all()  # the background one was accepted: nothing to raise
    assert _files(root, 7) == ["a.bin"] and ckptd.latest_step(root) == 7
    coord.close()


def test_register_and_monitor_from_an_event_loop_is_applied_after_earlier_background_registrations(env):
    root, s8, s9 = env.root, env.s + 8, env.s + 9
    coord = env.coord()
    coord.save_sync(lambda: write_step_file(root, s8, "a.bin"), s8)
    coord.save_sync(lambda: write_step_file(root, s9, "a.bin"), s9)

    async def loop():
        coord.register(s8, checkpoint_thread_count=1, wait=False)
        with pytest.raises(ckptd.RegistrationConflictError, match=f"step {s8}"):
            await coord.register_and_monitor(s8, checkpoint_thread_count=1)
        # and after the async one, a background one: applied after it (refused, raised by wait_all)
        await coord.register_and_monitor(s9, checkpoint_thread_count=1)
        coord.register(s9, checkpoint_thread_count=1, wait=False)

    asyncio.run(loop())
    with pytest.raises(ckptd.RegistrationConflictError, match=f"step {s9}"):
        coord.wait_all()
    coord.wait_all()
    assert _files(root, s8) == ["a.bin"] and _files(root, s9) == ["a.bin"]
    coord.close()


def test_background_registrations_of_one_thread_are_applied_in_order(make_monitor, tmp_path):
    """Five steps, each with a finished unit, registered in the background, then step 10 once more:
    each step commits with the registration made first, and only the one made last is refused."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    steps = list(range(10, 15))
    for s in steps:
        coord.save_sync(lambda s=s: write_step_file(root, s, "a.bin"), s)
    for s in steps:
        coord.register(s, checkpoint_thread_count=1, wait=False)
    coord.register(steps[0], checkpoint_thread_count=1, wait=False)  # refused: step 10 committed first
    with pytest.raises(ckptd.RegistrationConflictError, match=f"step {steps[0]} "):
        coord.wait_all()
    for s in steps:
        # wait_all returns once the registrations are applied; the commits they start may still run
        coord.wait_committed(s, timeout_s=30)
        assert _files(root, s) == ["a.bin"]
        assert len(read_manifest(root, s, CKPT).registrations) == 1
    assert ckptd.latest_step(root) == steps[-1]
    coord.close()


# -- 3. failures are raised once, never lost ---------------------------------------------------


def test_two_background_failures_the_first_is_raised_once_and_the_second_named_on_it(env):
    root, s1, s2 = env.root, env.s + 1, env.s + 2
    coord = env.coord()
    for s in (s1, s2):
        coord.save_sync(lambda s=s: write_step_file(root, s, "a.bin"), s)
        coord.register(s, checkpoint_thread_count=1)
    coord.register(s1, checkpoint_thread_count=1, wait=False)
    coord.register(s2, checkpoint_thread_count=1, wait=False)
    with pytest.raises(ckptd.RegistrationConflictError, match=f"step {s1} ") as raised:
        coord.wait_committed(s2, timeout_s=10)  # a blocking call: raises, before its own question
    assert any(f"step {s2} " in n for n in getattr(raised.value, "__notes__", [])), "the second failure was lost"
    coord.wait_all()  # each raised once
    coord.wait_committed(s2, timeout_s=10)
    coord.close()


def test_a_background_failure_is_raised_by_close_and_the_thread_stops(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="wclose")
    coord.save_sync(lambda: write_step_file(root, 1, "a.bin"), 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    before = _snapshot(root, [1])
    coord.register(1, checkpoint_thread_count=1, wait=False)
    with pytest.raises(ckptd.RegistrationConflictError):
        coord.close()
    wait_for(lambda: not _registrar_threads("wclose"), what="the registrar thread to stop")
    assert _snapshot(root, [1]) == before
    with pytest.raises(ckptd.CheckpointError, match="closed"):
        coord.register(2, checkpoint_thread_count=1, wait=False)
    assert in_thread(coord.wait_all)[0] == "ok"  # raised once: nothing left, and no hang


def test_close_loses_no_save_failure_when_a_background_registration_also_failed(make_monitor, tmp_path, caplog):
    """close() raises the refused registration; the save that failed before it is not silently lost
    (logged when it failed, named on what close() raises, and still raised by a wait_all), and the
    failed step never commits.

    The save fails once step 2's registration was applied: had it failed first, that registration
    would be answered with the save's failure (step 2 failed), a second error from the registrar."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="wsavefail")
    coord.save_sync(lambda: write_step_file(root, 1, "a.bin"), 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    registered = threading.Event()

    def fail_once_registered() -> None:
        assert registered.wait(60), "step 2's registration was never applied"
        disk_full()

    coord.save_async("optim", fail_once_registered, 2)  # fails: raised by the next wait_all
    coord.register(2, checkpoint_thread_count=1, wait=False)
    coord.register(1, checkpoint_thread_count=1, wait=False)  # refused
    wait_for(lambda: getattr(status(monitor).step(2), "expected", 0) == 1, what="step 2's registration")
    registered.set()
    with caplog.at_level(logging.ERROR, logger="ckptd"):
        with pytest.raises(ckptd.RegistrationConflictError) as raised:
            coord.close()
    assert any("disk full" in r.getMessage() for r in caplog.records), "the failed save of step 2 was lost"
    assert any("disk full" in n for n in raised.value.__notes__)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_all()
    assert status(monitor).step(2).state.value == "failed" and ckptd.latest_step(root) == 1


def test_a_registration_failing_at_exit_is_logged_and_one_still_queued_is_delivered(make_monitor, tmp_path, run_name):
    """A process that ends without close(): the exit drain sends what is queued (the last registration
    of step 2 commits it) and logs, does not raise, a refused one; the process exits 0."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
    coord.save_sync(lambda: write_step_file(root, 1, "a.bin"), 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.save_sync(lambda: write_step_file(root, 2, "a.bin"), 2)
    before = _snapshot(root, [1])
    script = textwrap.dedent(f"""
        import ray, ckptd
        ray.init(address="auto", namespace={ray.get_runtime_context().namespace!r}, log_to_driver=False,
                 configure_logging=False)
        coord = ckptd.CheckpointCoordinator(ckptd.get_monitor({run_name!r}), worker_id="exiting")
        coord.register(1, checkpoint_thread_count=1, wait=False)  # refused: step 1 is committed
        coord.register(2, checkpoint_thread_count=1, wait=False)  # the last registration of step 2
        print("returned", flush=True)
    """)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "returned" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "registration failed before exit" in proc.stderr and "step 1" in proc.stderr, proc.stderr[-3000:]
    coord.wait_committed(2, timeout_s=30)
    assert _files(root, 2) == ["a.bin"] and ckptd.latest_step(root) == 2
    manifests_of_1 = [p for p in before if p.startswith(ckptd.step_dir(root, 1))]
    assert {p: _snapshot(root, [1])[p] for p in manifests_of_1} == {p: before[p] for p in manifests_of_1}
    coord.close()


def test_one_background_failure_is_raised_by_exactly_one_of_two_concurrent_wait_alls(env):
    root, s1 = env.root, env.s + 1
    coord = env.coord()
    coord.save_sync(lambda: write_step_file(root, s1, "a.bin"), s1)
    coord.register(s1, checkpoint_thread_count=1)
    coord.wait_committed(s1, timeout_s=30)
    coord.register(s1, checkpoint_thread_count=1, wait=False)
    start = threading.Barrier(2)

    def both():
        start.wait()
        return coord.wait_all()

    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, in_thread(both))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r[0] for r in results) == ["ok", "raised"]
    assert all(isinstance(r[1], ckptd.RegistrationConflictError) for r in results if r[0] == "raised")
    coord.close()


# -- 4. nothing committed changes --------------------------------------------------------------


def test_background_registrations_of_committed_steps_change_nothing(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_sync(lambda: write_step_file(root, 1, "a.bin"), 1)
    coord.save_sync(lambda: write_step_file(root, 1, "sd.bin"), 1, is_state_dict=True)
    coord.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    before, st = _snapshot(root, [1]), status(monitor).step(1)
    for kwargs in ({"checkpoint_thread_count": 1}, {"state_dict_thread_count": 1},
                   {"state_dict_thread_count": 2, "is_state_dict": True}):
        coord.register(1, wait=False, **kwargs)
        with pytest.raises(ckptd.RegistrationConflictError):
            coord.wait_all()
    coord.register(1, wait=False)  # adds nothing: accepted, changes nothing
    coord.wait_all()
    assert _snapshot(root, [1]) == before
    after = status(monitor).step(1)
    assert (after.expected, after.finished, after.committed) == (st.expected, st.finished, True)
    ckptd.verify(root, 1)
    coord.close()


def test_an_older_step_committed_by_a_late_background_registration_does_not_move_latest_back(
        make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_sync(lambda: write_step_file(root, 2, "a.bin"), 2)
    coord.save_sync(lambda: write_step_file(root, 3, "a.bin"), 3)
    coord.register(3, checkpoint_thread_count=1)
    coord.wait_committed(3, timeout_s=30)
    coord.register(2, checkpoint_thread_count=1, wait=False)
    coord.wait_committed(2, timeout_s=30)
    assert ckptd.latest_step(root) == 3
    ckptd.verify(root, 2)
    ckptd.verify(root, 3)
    coord.close()


# -- 5. a coordinator's process dies right after register(wait=False) ------------------------------


@ray.remote(num_cpus=0, max_restarts=0)
class DyingRegistrar:
    def __init__(self, run: str) -> None:
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id="dying")

    def ready(self) -> bool:
        return True

    def register_and_die(self, step: int, times: int) -> None:
        for _ in range(times):
            self.coord.register(step, checkpoint_thread_count=1, wait=False)
        os._exit(1)


def test_a_process_dying_after_register_wait_false_never_leaves_a_step_committed_short(
        make_monitor, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    actor = DyingRegistrar.remote(run_name)
    ray.get(actor.ready.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.register_and_die.remote(4, 3))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for i in range(2):
        try:
            coord.save_sync(lambda i=i: write_step_file(root, 4, f"u{i}.bin"), 4)
        except ckptd.CheckpointSaveError:  # only if one registration of three arrived: committed by u0
            assert status(monitor).step(4).expected == 1
    s = status(monitor).step(4)
    arrived = s.expected
    assert arrived <= 3
    if s.committed:  # committed whole: as many units as the registrations that arrived
        assert len(_files(root, 4)) >= arrived == len(read_manifest(root, 4, CKPT).registrations)
    else:
        assert ckptd.latest_step(root) is None
    ray.kill(actor)
    coord.close()


# -- 6. threads and close ----------------------------------------------------------------------


def test_background_registrations_from_several_threads_all_count_once(env):
    s11 = env.s + 11
    coord = ckptd.CheckpointCoordinator(env.monitor, worker_id=f"wthreads{env.s}")
    start = threading.Barrier(4)

    def burst():
        start.wait()
        for _ in range(10):
            coord.register(s11, checkpoint_thread_count=1, wait=False)

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    coord.wait_all()
    assert status(env.monitor).step(s11).expected == 40
    assert len(_registrar_threads(f"wthreads{env.s}")) == 1
    coord.close()


def test_close_applies_every_queued_registration_then_refuses_new_ones(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="wq")
    for s in range(20, 40):
        coord.save_async("m", lambda s=s: write_step_file(root, s, "a.bin"), s)
        coord.register(s, checkpoint_thread_count=1, wait=False)
    coord.close()
    st = status(monitor)
    assert all(st.step(s).expected == 1 for s in range(20, 40))
    coord_check = ckptd.CheckpointCoordinator(monitor, worker_id="check")
    coord_check.wait_committed(39, timeout_s=30)
    assert ckptd.latest_step(root) == 39
    wait_for(lambda: not _registrar_threads("wq"), what="the registrar thread to stop")
    with pytest.raises(ckptd.CheckpointError, match="closed"):
        coord.register(40, checkpoint_thread_count=1, wait=False)
    assert in_thread(coord.close)[0] == "ok"  # a second close neither hangs nor raises
    coord_check.close()


def test_register_wait_false_after_close_is_refused_even_if_never_used_before(env):
    coord = ckptd.CheckpointCoordinator(env.monitor, worker_id=f"wfresh{env.s}")
    coord.close()
    try:
        with pytest.raises(ckptd.CheckpointError, match="closed"):
            coord.register(env.s + 50, checkpoint_thread_count=1, wait=False)
        assert not _registrar_threads(f"wfresh{env.s}")
    finally:
        coord.wait_all()
