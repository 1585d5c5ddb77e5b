"""Session 23b: a monitor that is alive but not answering (65016ac), attacked.

65016ac bounds ``MonitorClient.call`` / ``call_async`` by ``notify_timeout_s`` (retries included,
``wait_committed``'s own timeout on top, ``waits_s=None`` for unbounded waits): a unit whose
"started" or "finished" notification is not answered in time is reported failed, while the
monitor may still apply the call when it resumes.

Real local Ray, real monitors (frozen with SIGSTOP, resumed with SIGCONT, SIGKILLed while frozen
so that Ray restarts them), real coordinators (several in this process, with short and long
timeouts, straight to the monitor or through a node relay), real files; nothing mocked. The pid
is the monitor's own (``ping``); every freeze ends with SIGCONT in a ``finally``.

What held:

* I4, two timeouts in one process, straight to the monitor
  (``test_i4_a_short_timeout_bounds_its_calls_and_leaves_a_long_timeout_coordinator_alone``): while
  the monitor is frozen, the 1 s coordinator's ``wait_all``, ``register(wait=True)``,
  ``wait_committed(timeout_s=0.5)`` and a new coordinator's construction each end within a few
  timeouts; the 60 s coordinator of the same process (another notifier: its key holds the
  timeout) waits through the freeze, and its save commits once the monitor resumes. The short
  one's failed step settles failed (I3), and both then commit later steps.
* I2, I3, I5 across a restart (``test_i5_late_finished_reports_commit_whole_and_a_restart_keeps_them``):
  a state-dict unit whose "finished" and "failed" both time out (frozen monitor) is applied as
  finished on SIGCONT: the state dict commits whole and verifies, although ``wait_all`` said the
  save failed. A checkpoint unit of another step ends the same way, but the monitor is SIGKILLed
  while still frozen: Ray's restart reads its failure receipt and fails that step, and Ray's retry
  of the queued "finished" does not undo it. The same restart reads the state-dict unit's failure
  receipt: the committed state dict stays (manifest and bytes unchanged, tracker on it), only the
  step's full checkpoint fails (the live monitor would have committed it: "restarted before the
  commit reads the failure receipt"), also once the unit still writing into it has finished.
  Later steps commit normally.

What broke, fixed since (each case below fails without its fix):

1. I4, ``test_i4_a_node_relay_started_by_a_short_timeout_coordinator_does_not_cut_a_long_ones_saves_short``:
   a node relay (``start_monitor(node_relay=True)``) is started by the first coordinator that
   needs it, with that coordinator's ``notify_timeout_s`` (1 s), and forwards upstream through
   ``MonitorClient.call_async``, which 65016ac bounded by that timeout. A 60 s coordinator on the
   same node sends through the same relay: with the monitor frozen for a few seconds, the relay's
   upstream call raises ``CheckpointTimeoutError`` after 1 s, the relay hands it to every
   coordinator of the batch, and ``_Route.send`` passes it on (it is neither a timeout of its own
   wait nor a ``RayActorError``, so no ``RelayUnavailable`` and no direct send): the 60 s
   coordinator's save fails after 1 s. Straight to the monitor the same save survives (above).
   (``_Route.send_async``'s docstring says why a relay must not put a deadline on a batch that
   carries many coordinators' events; the node relay's own upstream call now has one.)
2. I4, ``test_i4_a_throttled_save_is_bounded_by_notify_timeout_s_while_the_monitor_is_stopped``:
   with a throttling ``save_strategy``, a unit asks to be admitted with ``acquire_slot``, which
   ``UnitRunner._start`` calls with ``waits_s=None``: while the monitor is frozen the call never
   returns, so ``wait_all`` (and ``save_sync``, ``close``) hang with it, as every call did before
   65016ac. The wait for other writers' slots is rightly unbounded, but the monitor's admission
   before it is not a wait for other writers.
3. I4, ``test_i4_background_registrations_queued_behind_a_frozen_monitor_share_one_timeout``:
   ``register(wait=False)`` returns at once, and the registrar sends its queue one registration
   at a time, each with its own ``notify_timeout_s`` from its first try: with the monitor frozen,
   ``close()`` (and ``wait_all``, ``wait_committed``, which flush the registrar first) takes N
   timeouts for N queued registrations (6 x 0.5 s here), not a small multiple of one. A
   trainer that registers every step in the background while the monitor is stuck queues one
   per step.

Fixes: (1) a relay's upstream call waits for a live monitor's answer without a bound
(``call_async(bounded=False)``), as before 65016ac, each coordinator bounding its own wait for the
relay; (2) ``MonitorClient.call(waits_s=None)`` waits for as long as the monitor answers a ping
within the timeout (``_get_while_alive``): the slot wait outlasts the timeout while the monitor is
alive (checked first in the throttled case), a stopped monitor fails it in about two; (3) the
registrations queued behind one that went unanswered share one more timeout (``Registrar``,
``call(until=)``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import ray

import ckptd

from .helpers import (
    Gate,
    assert_trackers_verified,
    in_thread,
    read_manifest,
    unit_receipt,
    wait_all,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
S = 1.0  # the short notify_timeout_s
LONG = 60.0  # a timeout no wait here comes near
#: A unit's "started" (or "finished") and then its "failed" notification, each up to two timeouts
#: (queued behind a call in flight, then its own), with a margin for a loaded machine.
BOUND_S = 4 * S + 2
DEADLINE_S = 60.0


SHARED_MONITOR_OPTIONS = {"max_ckpt_to_keep": None}


@contextmanager
def _frozen(monitor):
    """The monitor's process stopped (SIGSTOP) for the block; yields its pid. Resumed afterwards,
    unless the block killed it."""
    pid = ray.get(monitor.ping.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed in the block: Ray restarts it


def _commit(coord, root: str, step: int, name: str = "model.bin") -> None:
    coord.register(step, checkpoint_thread_count=1)
    coord.save_sync(lambda: write_step_file(root, step, name), step)
    coord.wait_committed(step, timeout_s=DEADLINE_S)


def _elapsed(t0: float) -> float:
    return time.monotonic() - t0


def _bounded(call, bound_s: float):
    """``call()`` raises a TimeoutError (CheckpointTimeoutError, a save failed for one) within
    ``bound_s``; the error."""
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, ckptd.CheckpointSaveError), match="did not answer") as info:
        call()
    assert _elapsed(t0) < bound_s, f"{call} took {_elapsed(t0):.1f} s with the monitor frozen"
    return info.value


def _long_survives_a_freeze(monitor, root: str, short, long, s: int, bound_s: float, while_frozen=()) -> None:
    """``long``'s save of step s + 1 starts while the monitor is frozen; the freeze lasts until
    ``short``'s save of step s + 2 has failed (its calls went unanswered for longer than its
    timeout, so the monitor was frozen that long), and ``while_frozen`` ran. Then ``long``'s save
    must succeed and commit, and ``short``'s step has settled failed (I3)."""
    with _frozen(monitor):
        long.save_async("model", lambda: write_step_file(root, s + 1, "long.bin"), s + 1)
        short.save_async("model", lambda: write_step_file(root, s + 2, "short.bin"), s + 2)
        error = _bounded(short.wait_all, bound_s)
        assert isinstance(error.__cause__, ckptd.CheckpointTimeoutError) and error.step == s + 2
        for call in while_frozen:
            _bounded(call, S + 2)
    error = wait_all(long)
    assert error is None, f"the {LONG:g} s coordinator's save was cut short by the {S:g} s one's timeout: {error}"
    long.register(s + 1, checkpoint_thread_count=1)
    long.wait_committed(s + 1, timeout_s=DEADLINE_S)
    assert assert_trackers_verified(root)[CKPT] == s + 1
    with pytest.raises(ckptd.CheckpointSaveError, match="did not answer"):
        short.wait_committed(s + 2, timeout_s=DEADLINE_S)


# -- I4: two timeouts in one process ---------------------------------------------------------------


def test_i4_a_short_timeout_bounds_its_calls_and_leaves_a_long_timeout_coordinator_alone(env):
    root, monitor, s = env.root, env.monitor, env.s
    short = ckptd.CheckpointCoordinator(monitor, worker_id=f"w{s}-short", notify_timeout_s=S)
    long = ckptd.CheckpointCoordinator(monitor, worker_id=f"w{s}-long", notify_timeout_s=LONG)
    _long_survives_a_freeze(monitor, root, short, long, s, BOUND_S, while_frozen=(
        lambda: short.register(s + 3, checkpoint_thread_count=1),
        lambda: ckptd.CheckpointCoordinator(monitor, worker_id=f"w{s}-new", notify_timeout_s=S),
        lambda: short.wait_committed(s + 5, timeout_s=0.5),  # its own timeout, then the client's
    ))
    _commit(short, root, s + 4)
    assert assert_trackers_verified(root)[CKPT] == s + 4
    short.close()
    long.close()


def test_i4_a_node_relay_started_by_a_short_timeout_coordinator_does_not_cut_a_long_ones_saves_short(
        make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    short = ckptd.CheckpointCoordinator(monitor, worker_id="short", notify_timeout_s=S)
    long = ckptd.CheckpointCoordinator(monitor, worker_id="long", notify_timeout_s=LONG)
    _commit(short, root, 1)  # the short one's first notification starts the node's relay
    # Each notification of the short one waits for the relay, then goes straight: twice as long.
    _long_survives_a_freeze(monitor, root, short, long, 1, 2 * BOUND_S)


# -- I4: throttled saves and background registrations ----------------------------------------------


def test_i4_a_throttled_save_is_bounded_by_notify_timeout_s_while_the_monitor_is_stopped(
        make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_thread")
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=S)
    _commit(coord, root, 1)
    # Alive, the monitor keeps a unit waiting for the slot another writer holds for longer than
    # the timeout: that wait is not bounded by it.
    holding, hold = threading.Event(), threading.Event()

    def holder():
        holding.set()
        hold.wait(DEADLINE_S)
        return write_step_file(root, 2, "a.bin")

    coord.register(2, checkpoint_thread_count=2)
    coord.save_async("holder", holder, 2)
    assert holding.wait(DEADLINE_S)
    coord.save_async("waiter", lambda: write_step_file(root, 2, "b.bin"), 2)
    threading.Event().wait(3 * S)  # time must pass: the waiter's wait for the slot outlasts the timeout
    hold.set()
    assert wait_all(coord) is None
    coord.wait_committed(2, timeout_s=DEADLINE_S)
    with _frozen(monitor):
        t0 = time.monotonic()
        coord.save_async("model", lambda: write_step_file(root, 3, "model.bin"), 3)
        outcome, error = in_thread(coord.wait_all, 3 * S + 1)  # its admission, then its "failed"
        took = _elapsed(t0)
    # Resumed: the unit ends either way (failed within the bound, or admitted late and written).
    wait_all(coord)
    _commit(coord, root, 4)
    assert assert_trackers_verified(root)[CKPT] == 4
    coord.close()
    assert outcome == "raised", f"wait_all was still waiting {took:.1f} s into the freeze ({S:g} s timeout)"
    assert isinstance(error, ckptd.CheckpointSaveError) and "did not answer" in str(error)


def test_i4_background_registrations_queued_behind_a_frozen_monitor_share_one_timeout(env):
    timeout_s, queued = 0.5, 6
    coord = ckptd.CheckpointCoordinator(env.monitor, worker_id=f"w{env.s}", notify_timeout_s=timeout_s)
    with _frozen(env.monitor):
        for i in range(queued):  # a training loop registering each step in the background
            coord.register(env.s + 1 + i, checkpoint_thread_count=1, wait=False)
        t0 = time.monotonic()
        outcome, error = in_thread(coord.close, DEADLINE_S)
        took = _elapsed(t0)
    assert outcome == "raised" and isinstance(error, ckptd.CheckpointTimeoutError), (outcome, error)
    assert took < 5 * timeout_s, (
        f"close() took {took:.1f} s with {queued} background registrations queued and a {timeout_s:g} s timeout")


# -- I2, I3, I5: late "finished" reports, live and across a restart --------------------------------


def test_i5_late_finished_reports_commit_whole_and_a_restart_keeps_them(env):
    root, monitor, s = env.root, env.monitor, env.s
    sd_step, ck_step = s + 1, s + 2
    coords = {w: ckptd.CheckpointCoordinator(monitor, worker_id=f"w{s}-{w}", notify_timeout_s=S)
              for w in ("c", "d", "e")}
    c, d, e = coords["c"], coords["d"], coords["e"]
    _commit(e, root, s)
    # Step sd_step: a full checkpoint of one state-dict unit (d) and one checkpoint unit (c).
    c.register(sd_step, is_state_dict=True, state_dict_thread_count=1)
    c.register(sd_step, checkpoint_thread_count=1)
    e.register(ck_step, checkpoint_thread_count=1)
    gates = {"c": Gate(root, sd_step, "optim.bin"), "d": Gate(root, sd_step, "weights.bin"),
             "e": Gate(root, ck_step, "model.bin")}
    c.save_async("optim", gates["c"], sd_step)
    d.save_async("weights", gates["d"], sd_step, is_state_dict=True)
    e.save_async("model", gates["e"], ck_step)
    for gate in gates.values():  # admitted, and held before they write
        assert gate.entered.wait(DEADLINE_S)
    attempt = ray.get(monitor.ping.remote())["attempt"]

    # d writes while the monitor is frozen: its "finished", then its "failed", go unanswered.
    with _frozen(monitor):
        gates["d"].open()
        error = wait_all(d)
        assert error is not None and "did not answer" in error
        assert unit_receipt(root, attempt, sd_step, f"w{s}-d")["status"] == "failed"
    # Resumed, the monitor applies d's "finished" first, most often: the state dict commits, whole.
    # Ray may apply the "failed" first (tasks pushed to a stopped process are retried, and a
    # retry keeps no order): then the step fails, once, and nothing names it.
    try:
        d.wait_committed(sd_step, is_state_dict=True, timeout_s=DEADLINE_S)
    except ckptd.CheckpointSaveError as e:
        assert "did not answer" in str(e)
        assert read_manifest(root, sd_step, SD) is None and assert_trackers_verified(root) == {CKPT: s, SD: s}
        gates["c"].open()
        gates["e"].open()
        for coord in coords.values():
            wait_all(coord)
            coord.close()
        return
    assert assert_trackers_verified(root) == {CKPT: s, SD: sd_step}
    sd_manifest = read_manifest(root, sd_step, SD)
    weights = open(f"{ckptd.step_dir(root, sd_step)}/weights.bin", "rb").read()

    # e ends the same way, and the monitor is SIGKILLed before it resumes: Ray restarts it.
    with _frozen(monitor) as pid:
        gates["e"].open()
        error = wait_all(e)
        assert error is not None and "did not answer" in error
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != pid, timeout_s=DEADLINE_S,
             what="the monitor to restart")

    # The restart read e's failure receipt: its step fails (Ray's retried "finished" changes nothing).
    with pytest.raises(ckptd.CheckpointSaveError, match="did not answer"):
        e.wait_committed(ck_step, timeout_s=DEADLINE_S)
    # And d's: the committed state dict stays as it was; the full checkpoint of its step fails.
    d.wait_committed(sd_step, is_state_dict=True, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError, match="did not answer"):
        c.wait_committed(sd_step, timeout_s=DEADLINE_S)
    assert read_manifest(root, sd_step, SD) == sd_manifest
    assert open(f"{ckptd.step_dir(root, sd_step)}/weights.bin", "rb").read() == weights
    gates["c"].open()  # the unit still writing into it ends; its step stays failed
    wait_all(c)
    with pytest.raises(ckptd.CheckpointSaveError, match="did not answer"):
        c.wait_committed(sd_step, timeout_s=DEADLINE_S)
    assert read_manifest(root, sd_step, CKPT) is None and read_manifest(root, ck_step, CKPT) is None
    assert assert_trackers_verified(root) == {CKPT: s, SD: sd_step}

    _commit(e, root, s + 3)  # later steps commit normally
    assert assert_trackers_verified(root) == {CKPT: s + 3, SD: s + 3}
    for coord in coords.values():
        coord.close()
