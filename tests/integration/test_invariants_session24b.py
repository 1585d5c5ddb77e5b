"""Session 24b: the session-24 changes, attacked.

What was attacked: ``close()`` refusing saves from the moment it is called (``_closing``,
``_queueing``, ``_queued``); ``Registrar.flush`` split into ``wait()`` + ``raise_failures()`` and
the notes that name failures beside the one raised; ``UnitRunner._execute`` / ``_step_path`` with
an ``{epoch}`` template; ``MonitorClient`` refusing calls once Ray is not running
(``require_ray``); the monitor's ``CommitFlow._back_off`` fold. Real local Ray, real monitors,
real files, subprocesses that join the running cluster; nothing mocked (the tests only look at
which frame a thread is in, to know that a call is blocked where it is meant to be).

What broke (both cases failed before their fixes, in the same session):

* ``close()`` from a signal handler (a SIGTERM "graceful shutdown" handler, say) that runs while
  the same thread is blocked in ``save_async`` on a full lane (``max_pending``) deadlocks for ever.
  The interrupted ``_queue`` has counted itself in ``_queueing``; ``close()`` waits under
  ``_queued.wait_for(lambda: self._queueing == 0)`` for a put that can only finish once the
  handler returns. Before session 24 (``close()`` at 80183cd, checked by hand) the same handler's
  ``close()`` returned; the interrupted put then landed behind the lanes' end (the lost save that
  session 24 fixed for other threads). Responsible: ``CheckpointCoordinator.close`` /
  ``_queue`` (coordinator.py). Expected: ``close()`` returns (and the interrupted save is either
  refused when it resumes or waited for). Fixed: ``close()`` does not wait for its own thread's
  save call, the lock is reentrant, and a save call whose job landed once the save threads were
  told to end raises ``CheckpointError`` ("was not run") when it resumes.
* ``ray.shutdown()`` while a monitor call is retrying (the monitor is unreachable: killed,
  restarting) re-initialises Ray in the process. ``_require_ray`` is checked at the top of each
  try, but after ``RayActorError`` the retry sleeps and then ``MonitorClient._reattach`` calls
  ``ray.get_actor``, one of Ray's auto-init APIs: Ray is started (or, without ``RAY_ADDRESS``,
  a new local cluster is started: the "It might be dead or it's from a different cluster" error
  that session 24 set out to remove, seen with a subprocess that had no ``RAY_ADDRESS``), and the
  next try passes ``_require_ray``. The save is still raised by ``wait_all`` (the invariant on
  failed saves holds); what breaks is the new guarantee that nothing auto-inits Ray after
  ``ray.shutdown()``. The relay route has the same shape by reading, not run here:
  ``_Route.send`` after ``RayActorError`` calls ``_failed``, sleeps, then ``handle()`` ->
  ``start_relay`` -> ``NodeRelay.options(...).remote`` (``ActorClass._remote`` is wrapped with
  ``wrap_auto_init``), and ``post_quietly`` checks ``is_initialized`` before a ``handle()`` that
  may start a relay. ``ray.get(ref, ...)`` in ``call`` / ``_get_while_alive`` right after
  ``_require_ray`` is also an auto-init API (a narrow race). Fixed: ``_reattach`` and the relay
  route's ``handle()`` (before it starts a relay) check too (``require_ray``); the race between a
  check and the call right after it remains.

What held:

* ``close()`` while another thread is blocked in ``save_async`` on a full lane: ``close()``
  waits for that put, then for the save, and raises its failure (the guard case below). Saves
  after ``close()`` began are refused in ``_queue``; a refused ``save_state_async`` hands its
  buffers back (``snap.abort``, which joins a fenced copy first); a fenced copy needs no
  ``before_update`` to finish, so ``close()`` without one does not hang; ``close()`` twice or from
  two threads joins the same lanes and raises each failure once; a save_fn that queues a save of
  another name after ``close()`` began fails its own unit, which ``close()`` raises. (By reading.)
* ``save_sync`` was not refused after ``close()`` (it does not go through ``_queue``); it ran on
  the caller's thread and raised its own failure, so no failure went unraised, but with a
  writer-slot strategy its slot was no longer renewed (the heartbeat had stopped). Since this
  attack, it is refused from the moment ``close()`` is called, as ``save_async`` is
  (``test_a_save_made_while_close_waits_is_refused``).
* ``Registrar.wait`` / ``raise_failures``: each failure is taken out under ``_cond`` once and
  raised once, later ones as notes; ``register_and_monitor`` still sends its registration only
  after every earlier background one was applied (the wait is the same ``queue.join``), and a
  cancelled call leaves the failures for the next call. ``wait_all`` names the saves that failed
  on a registration failure it raises and keeps them; the next ``wait_all`` (also one after
  ``close()``) raises them. ``PreemptionGuard._wait_saves`` records ``str(e)``, which leaves the
  notes out of the outcome, but the saves stay kept and are logged when they failed.
* ``{epoch}`` templates: absolute paths (POSIX, ``file://``, object-store keys with and without
  a protocol), ``WrittenFile`` records, step-relative paths, and a save_fn that creates the step
  directory itself are still accepted (``find_step_dir`` runs after save_fn). A returned path in
  another step's directory is refused, as is one in no directory of the step. A unit that writes
  into a directory of its step with another epoch is accepted, but the step then fails at commit
  ("step 5 has several directories"), raised by ``wait_committed``: not committed short (that
  case was run while attacking; the others by reading ``_step_path``, ``step_path_of`` and
  ``describe_returned_files``).
* ``_require_ray`` in a Ray actor, a task, an actor's threads and a relay actor:
  ``ray.is_initialized()`` is the process's worker connection there, True. The writer process
  never calls the monitor. ``DrainWatch`` and ``_restarting`` use ``ray._private.state``, which
  raises after shutdown instead of starting Ray; metrics check ``is_initialized`` first.
* ``CommitFlow._back_off``: the three loops count the try before the wait, compute the same
  delay, bump the same ``RETRIED_REQUESTS`` labels (``failure_record``, ``revoke``, ``check``)
  and sleep in the ``except`` block as before; only the log wording changed. Sessions 23, 23c,
  23d and 23e pass with it.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import ray

import ckptd
from ckptd.coordinator.client import MonitorClient
from tests.integration.helpers import REPO, actor_gone, disk_full, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 30.0


def _script_env(**extra: str) -> dict:
    return {**os.environ, **extra, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


def _join_cluster(run_name: str) -> str:
    return textwrap.dedent(f"""
        import os, signal, sys, threading, time, ray, ckptd
        ray.init(address=os.environ["RAY_ADDRESS"], namespace={ray.get_runtime_context().namespace!r},
                 log_to_driver=False, configure_logging=False)
        monitor = ckptd.get_monitor({run_name!r})
    """)


def _in(thread: threading.Thread, *names: str) -> bool:
    """Whether ``thread``'s stack holds a frame of each of ``names``."""
    frame = sys._current_frames().get(thread.ident)
    seen = set()
    while frame is not None:
        seen.add(frame.f_code.co_name)
        frame = frame.f_back
    return set(names) <= seen


def _record(box: list, fn) -> None:
    try:
        box.append(("ok", fn()))
    except BaseException as e:  # noqa: BLE001 - handed back to the test
        box.append(("raised", e))


def test_close_waits_for_a_save_blocked_on_a_full_lane_and_raises_its_failure(make_monitor, tmp_path):
    """Held: a save_async blocked on back-pressure when close() is called is waited for, and its
    failure raised by close()."""
    coord = ckptd.CheckpointCoordinator(make_monitor(str(tmp_path / "ckpt")), worker_id="w0", notify_timeout_s=10)
    entered, gate = threading.Event(), threading.Event()
    coord.save_async("model", lambda: (entered.set(), gate.wait(DEADLINE_S)) and None, 1)
    try:
        assert entered.wait(DEADLINE_S)
        coord.save_async("model", lambda: None, 2)  # max_pending=1: the lane's queue is full now
        saving: list = []
        saver = threading.Thread(target=_record, args=(saving, lambda: coord.save_async("model", disk_full, 3)),
                                 daemon=True)
        saver.start()
        wait_for(lambda: _in(saver, "_queue", "put"), DEADLINE_S, "save_async to block on the full lane")
        closing: list = []
        closer = threading.Thread(target=_record, args=(closing, coord.close), daemon=True)
        closer.start()
        wait_for(lambda: _in(closer, "close", "wait_for"), DEADLINE_S, "close() to wait for the blocked save")
    finally:
        gate.set()
    saver.join(DEADLINE_S)
    closer.join(DEADLINE_S)
    assert saving and saving[0][0] == "ok", f"the save made before close() was not accepted: {saving!r}"
    assert closing and closing[0][0] == "raised", f"close() did not raise the failed save: {closing!r}"
    err = closing[0][1]
    assert isinstance(err, ckptd.CheckpointSaveError) and err.step == 3, repr(err)


def test_close_in_a_signal_handler_that_interrupted_a_blocked_save_async_returns(make_monitor, tmp_path, run_name):
    make_monitor(str(tmp_path / "ckpt"))
    script = _join_cluster(run_name) + textwrap.dedent("""
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="sig", notify_timeout_s=10)
        gate, entered, in_handler = threading.Event(), threading.Event(), threading.Event()
        coord.save_async("model", lambda: (entered.set(), gate.wait()) and None, 1)
        entered.wait()
        coord.save_async("model", lambda: None, 2)  # max_pending=1: the lane's queue is full now
        main = threading.main_thread().ident

        def blocked_in_put():
            f, names = sys._current_frames().get(main), set()
            while f is not None:
                names.add(f.f_code.co_name)
                f = f.f_back
            return {"put", "_queue"} <= names

        def helper():
            while not blocked_in_put():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGUSR1)
            in_handler.wait()
            gate.set()  # the lane drains: close() has everything it needs but the interrupted put

        def graceful_shutdown(*_):  # what a SIGTERM handler of a training script does
            print("closing", flush=True)
            in_handler.set()
            try:
                coord.close()
                print("closed", flush=True)
            except BaseException as e:
                print("close raised", type(e).__name__, flush=True)

        signal.signal(signal.SIGUSR1, graceful_shutdown)
        threading.Thread(target=helper, daemon=True).start()
        try:
            coord.save_async("model", lambda: None, 3)  # blocks on the full lane; the handler runs here
            print("save 3 accepted", flush=True)
        except ckptd.CheckpointError as e:
            print("save 3 refused:", e, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_script_env())
    try:
        first = proc.stdout.readline()  # once the handler runs (or the script died)
        out, err = proc.communicate(timeout=4)  # close() needs a moment once the lane drained
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    out = first + out
    assert "closing" in out, err[-3000:]
    assert "closed" in out or "close raised" in out, f"close() in the handler never returned: {out!r}"
    # The interrupted call resumes once the handler returned: its save can no longer run, and says so.
    assert "save 3 refused: save sig/model of step 3 was not run: close() was called" in out, (out, err[-3000:])


def test_ray_shutdown_during_a_retried_monitor_call_does_not_start_ray_again(make_monitor, tmp_path, run_name):
    monitor = make_monitor(str(tmp_path / "ckpt"))
    lines, first = inspect.getsourcelines(MonitorClient.call)
    sleep_line = first + next(i for i, line in enumerate(lines) if "time.sleep(" in line)
    script = _join_cluster(run_name) + textwrap.dedent(f"""
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="shut", notify_timeout_s=3)
        print("ready", flush=True)
        input()  # the monitor is gone now: every call to it retries until notify_timeout_s
        coord.save_async("model", lambda: None, 1)
        save_thread = next(t for t in threading.enumerate() if t.name == "ckptd-save-model")

        def retrying():  # the save's "started" notification sleeps between two tries
            f = sys._current_frames().get(save_thread.ident)
            return f is not None and f.f_code.co_name == "call" and f.f_lineno == {sleep_line}

        give_up = time.monotonic() + 10
        while not retrying():
            assert time.monotonic() < give_up, "the save's call never retried"
            time.sleep(0.005)
        ray.shutdown()
        print("after shutdown:", ray.is_initialized(), flush=True)
        try:
            coord.wait_all()
            print("wait_all returned", flush=True)
        except Exception as e:
            print("wait_all raised", type(e).__name__, flush=True)
        print("after wait_all:", ray.is_initialized(), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_script_env())
    try:
        assert proc.stdout.readline().strip() == "ready"
        ray.kill(monitor, no_restart=True)
        wait_for(lambda: actor_gone(monitor), DEADLINE_S, "the monitor to be gone")
        out, err = proc.communicate("\n", timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "after shutdown: False" in out and "wait_all raised CheckpointSaveError" in out, (out, err[-3000:])
    assert "after wait_all: False" in out, f"Ray was started again after ray.shutdown(): {out!r}"
