"""A helper's second attack on the registration barrier of ``register(..., wait=False)`` (session 17b).

A save unit a coordinator starts after a background registration reports itself finished (receipt,
then notification) only once that registration was applied (``Registrar.barrier``). These tests hold
the registrar deterministically (a commit of a holding step held in ``before_manifest``, and a
wait=False registration of that step queued behind it: the monitor answers it only after the commit)
and check, in every path that makes units, that the barrier neither deadlocks nor lets a step commit
short, that it orders only its own coordinator and the units made after the registration, that a
failed registration releases it, and that monitor restarts and back-pressure combine with it.
It found one bug, fixed since: with writer slots (a throttling save strategy) a unit took its slot
and then waited at the barrier after its write, holding up other writers; it now waits before it
asks for a slot.

The tests that only look at their own steps share one monitor (``env``: each its own block of steps,
the first of them its holding step, ``hold_commit(..., step=)``); those that kill or restart the monitor, or need
another save strategy, have their own (holding step ``HOLD_STEP``).
"""

from __future__ import annotations

import glob
import json
import os
import threading

import pytest
import ray
import torch

import ckptd
from ckptd.config import Kind

from .helpers import (
    HOLD_STEP,
    hold_commit,
    hold_registrar,
    in_thread,
    read_manifest,
    registrar_held,
    restart_monitor,
    status,
    wait_for,
    weights,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT = Kind.CHECKPOINT

SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}  # no test's steps go while another runs


def _files(root: str, step: int, kind: Kind = CKPT) -> list[str] | None:
    m = read_manifest(root, step, kind)
    return None if m is None else sorted(f.path for f in m.files)


def _finished(monitor, step: int, kind: Kind = CKPT) -> list[str]:
    s = status(monitor).step(step, kind)
    return [] if s is None else list(s.finished)


def _receipts(root: str, step: int) -> dict[str, list[str]]:
    """The unit receipts and registration records on disk for ``step`` (every attempt): status ->
    unit names, and "reg" -> registration files."""
    out: dict[str, list[str]] = {"reg": []}
    for path in glob.glob(f"{root}/.ckptd/pending/*/{step}/*.json"):
        name = os.path.basename(path)
        if name.startswith("reg-"):
            out["reg"].append(name)
        elif name.startswith("unit-"):
            try:
                with open(path) as f:
                    body = json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                continue  # replaced meanwhile
            out.setdefault(body["status"], []).append(body["unit"]["name"])
    return out


def _state(step: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in weights(step).items()}


# -- 1. every path that makes units: no deadlock, no short commit --------------------------------


def test_every_thread_path_waits_for_earlier_registrations_and_before_update_does_not(env):
    """save_state_async fenced (streamed) and eager, save_async and save_sync, all after four
    background registrations of step S+5: none reports itself finished while the registrations are
    held, before_update returns meanwhile, and the step commits with all four units."""
    root, monitor, hold, s5 = env.root, env.monitor, env.s + 1, env.s + 5
    coord = env.coord()
    release = hold_registrar(coord, monitor, root, step=hold)
    for _ in range(4):
        coord.register(s5, checkpoint_thread_count=1, wait=False)
    wrote = threading.Event()
    coord.save_state_async("fenced", _state(5), s5, fenced=True)
    coord.before_update()  # the fence waits for the copy only, never for the registrations
    assert registrar_held(monitor, hold), "before_update waited for the held registrations"
    coord.save_state_async("eager", _state(5), s5)
    coord.save_async("a", lambda: (write_step_file(root, s5, "a.bin"), wrote.set()) and None, s5)
    wait_for(wrote.is_set, what="a.bin to be written")
    wait_for(lambda: os.path.exists(os.path.join(ckptd.step_dir(root, s5), "eager.safetensors")),
             what="the eager snapshot to be written")
    assert registrar_held(monitor, hold)
    assert _finished(monitor, s5) == [] and "finished" not in _receipts(root, s5)
    release()
    coord.save_sync(lambda: write_step_file(root, s5, "sync.bin"), s5)  # returns once its barrier passed
    s = status(monitor).step(s5)
    assert s.expected == 4 and "sync" in " ".join(s.finished)
    coord.wait_all()
    coord.wait_committed(s5, timeout_s=30)
    assert _files(root, s5) == ["a.bin", "eager.safetensors", "fenced.safetensors", "sync.bin"]
    assert len(read_manifest(root, s5, CKPT).registrations) == 4
    coord.close()


def test_staged_saves_written_by_a_writer_process_wait_for_the_barrier(env):
    root, monitor, hold, s5, s6 = env.root, env.monitor, env.s + 1, env.s + 5, env.s + 6
    coord = env.coord(writer="process", max_staged=1)
    release = hold_registrar(coord, monitor, root, step=hold)
    coord.register(s5, checkpoint_thread_count=1, wait=False)
    coord.register(s5, checkpoint_thread_count=1, wait=False)
    coord.register(s6, checkpoint_thread_count=1, wait=False)
    coord.save_state_async("model", _state(5), s5, fenced=True)
    coord.before_update()
    coord.save_state_async("optim", _state(5), s5)
    # max_staged=1: the next save of "model" needs the buffers of the first, handed back when its
    # write ended, not when its barrier passed.
    assert in_thread(lambda: coord.save_state_async("model", _state(6), s6), timeout_s=20)[0] == "ok"
    assert registrar_held(monitor, hold), "a staged save of the writer process waited for the held registrations"
    assert _finished(monitor, s5) == [] and _finished(monitor, s6) == []
    release()
    coord.wait_all()
    for step in (s5, s6):  # steps commit independently: s6's commit says nothing of s5's
        coord.wait_committed(step, timeout_s=30)
    assert _files(root, s5) == ["model.safetensors", "optim.safetensors"]
    assert _files(root, s6) == ["model.safetensors"]
    for step in (s5, s6):
        ckptd.verify(root, step)
    coord.close()


@ray.remote(num_cpus=0)
class _ActorCoordinator:
    """A training worker whose coordinator lives in a Ray actor."""

    def __init__(self, run: str, root: str) -> None:
        self.root = root
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id="actor")

    def register_bg(self, step: int, count: int) -> None:
        self.coord.register(step, checkpoint_thread_count=count, wait=False)

    def save(self, step: int, name: str) -> None:
        self.coord.save_async(name, lambda: write_step_file(self.root, step, f"{name}.bin"), step)

    def save_sync(self, step: int, name: str) -> None:
        self.coord.save_sync(lambda: write_step_file(self.root, step, f"{name}.bin"), step)

    def wait_all(self) -> None:
        self.coord.wait_all()

    def close(self) -> None:
        self.coord.close()


def test_a_coordinator_in_a_ray_actor_waits_for_its_own_background_registrations(env, shared_run):
    root, monitor, hold, s5, run = env.root, env.monitor, env.s + 1, env.s + 5, shared_run
    actor = _ActorCoordinator.remote(run, root)
    driver = env.coord()
    # Released below: the bound only ends a hold that a failing test left (8 s ran out in
    # session 41's run on a loaded machine before the actor's calls were done).
    release = hold_commit(driver, monitor, root, 60, step=hold)
    ray.get(actor.register_bg.remote(hold, 0))  # the actor's registrar is held now
    ray.get(actor.register_bg.remote(s5, 1))
    ray.get(actor.register_bg.remote(s5, 1))
    ray.get(actor.save.remote(s5, "a"))
    wait_for(lambda: os.path.exists(os.path.join(ckptd.step_dir(root, s5), "a.bin")), what="a.bin")
    assert registrar_held(monitor, hold) and _finished(monitor, s5) == []
    release()
    ray.get(actor.wait_all.remote(), timeout=30)
    s = status(monitor).step(s5)
    assert (s.expected, len(s.finished), s.committed) == (2, 1, False)  # never committed short
    ray.get(actor.save_sync.remote(s5, "b"), timeout=30)
    driver.wait_committed(s5, timeout_s=30)
    assert _files(root, s5) == ["a.bin", "b.bin"]
    ray.get(actor.close.remote(), timeout=30)
    ray.kill(actor)
    driver.close()


# -- 2. the barrier orders only this coordinator, and only the units after it ----------------------


def test_another_coordinator_of_the_process_does_not_wait_for_held_registrations(env):
    root, monitor, hold, s8, s9 = env.root, env.monitor, env.s + 1, env.s + 8, env.s + 9
    a = ckptd.CheckpointCoordinator(monitor, worker_id=f"ca{env.s}")
    b = ckptd.CheckpointCoordinator(monitor, worker_id=f"cb{env.s}")  # same process: one shared notifier
    # Held long enough for b's two saves and its commit on a loaded CI machine (3 s once was not).
    release = hold_registrar(a, monitor, root, seconds=12, step=hold)
    a.register(s8, checkpoint_thread_count=1, wait=False)
    a.save_async("a", lambda: write_step_file(root, s8, "a.bin"), s8)
    # b, with background registrations of its own, saves and commits while a's are held.
    b.register(s9, checkpoint_thread_count=1, wait=False)
    b.register(s9, checkpoint_thread_count=1, wait=False)
    b.save_async("b1", lambda: write_step_file(root, s9, "b1.bin"), s9)
    b.save_sync(lambda: write_step_file(root, s9, "b2.bin"), s9)
    b.wait_committed(s9, timeout_s=30)
    assert registrar_held(monitor, hold), "coordinator b waited for coordinator a's registrations"
    assert _finished(monitor, s8) == []
    assert _files(root, s9) == ["b1.bin", "b2.bin"]
    release()
    a.wait_all()
    a.wait_committed(s8, timeout_s=30)
    assert _files(root, s8) == ["a.bin"]
    a.close()
    b.close()


def test_a_unit_queued_before_a_held_registration_finishes_while_it_is_held(env):
    root, monitor, hold, st7, st8 = env.root, env.monitor, env.s + 1, env.s + 7, env.s + 8
    coord = env.coord()
    coord.register(st7, checkpoint_thread_count=1)
    gate = threading.Event()

    def early():
        assert gate.wait(20), "the gate was never opened"
        write_step_file(root, st7, "early.bin")

    coord.save_async("early", early, st7)  # before any wait=False registration
    release = hold_registrar(coord, monitor, root, step=hold)
    coord.register(st8, checkpoint_thread_count=1, wait=False)
    coord.save_async("late", lambda: write_step_file(root, st8, "late.bin"), st8)
    gate.set()
    wait_for(lambda: (s := status(monitor).step(st7)) is not None and s.committed, what="step S+7 to commit")
    release()
    coord.wait_committed(st7, timeout_s=30)  # a blocking call: also waits for the held registrations
    wait_for(lambda: _finished(monitor, st7), timeout_s=1, what="the early unit")
    # The early unit finished (and its step committed) before the commit of the holding step S+1
    # let the registrations go; wait_committed itself only returned after.
    s7 = status(monitor).step(st7)
    assert s7.committed and s7.committed_at < status(monitor).step(hold).committed_at
    coord.wait_all()
    coord.wait_committed(st8, timeout_s=30)
    s8 = status(monitor).step(st8)
    assert s8.committed_at >= status(monitor).step(hold).committed_at
    assert _files(root, st7) == ["early.bin"] and _files(root, st8) == ["late.bin"]
    coord.close()


def test_with_a_throttling_strategy_a_unit_waiting_on_the_barrier_does_not_hold_up_other_writers(
        make_monitor, tmp_path):
    """single_thread: one writer slot for the run. A unit of coordinator a waiting for a's held
    registrations must not hold the slot, so coordinator b's unit gets it and its step commits
    meanwhile. (Found by this attack: the unit used to take the slot first and wait after its
    write, holding the slot until its finished notification. With writer slots it now waits for
    the registrations before it asks for a slot.)"""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_thread")
    a = ckptd.CheckpointCoordinator(monitor, worker_id="ta")
    b = ckptd.CheckpointCoordinator(monitor, worker_id="tb")
    release = hold_registrar(a, monitor, root)
    wrote = threading.Event()
    a.register(8, checkpoint_thread_count=1, wait=False)
    a.save_async("a", lambda: (write_step_file(root, 8, "a.bin"), wrote.set()) and None, 8)
    b.register(9, checkpoint_thread_count=1)
    b.save_async("b", lambda: write_step_file(root, 9, "b.bin"), 9)
    b.wait_committed(9, timeout_s=30)
    written_while_held = wrote.is_set()
    held = registrar_held(monitor)
    release()
    a.wait_all()
    a.wait_committed(8, timeout_s=30)
    assert _files(root, 8) == ["a.bin"] and _files(root, 9) == ["b.bin"]
    a.close()
    b.close()
    assert held, "coordinator b's unit waited for coordinator a's registrations (for the writer slot)"
    assert not written_while_held, "with writer slots, a unit starts only once its registrations arrived"


# -- 3. a failed registration releases the barrier -------------------------------------------------


def test_a_refused_held_registration_releases_the_barrier_and_the_next_step_commits_whole(env):
    root, monitor, hold, s5 = env.root, env.monitor, env.s + 1, env.s + 5
    coord = env.coord()
    release = hold_commit(coord, monitor, root, 3, step=hold)
    coord.register(hold, checkpoint_thread_count=1, wait=False)  # refused once the commit ends
    coord.register(s5, checkpoint_thread_count=2, wait=False)
    coord.save_async("a", lambda: write_step_file(root, s5, "a.bin"), s5)
    coord.save_async("b", lambda: write_step_file(root, s5, "b.bin"), s5)
    release()
    result = in_thread(coord.wait_all)
    assert result[0] == "raised" and isinstance(result[1], ckptd.RegistrationConflictError), result
    assert in_thread(coord.wait_all)[0] == "ok"  # raised once; both units ended
    coord.wait_committed(s5, timeout_s=30)
    assert _files(root, s5) == ["a.bin", "b.bin"] and _files(root, hold) == ["hold.bin"]
    coord.close()


def test_a_monitor_gone_for_good_releases_the_barrier_and_the_waiting_unit_ends_failed(make_monitor, tmp_path):
    """The registrations the unit waits for fail (the monitor is unreachable past notify_timeout_s):
    the unit ends, its receipt says failed (no later monitor of this attempt could count it), and
    no call hangs."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="wgone", notify_timeout_s=0.5)
    hold_registrar(coord, monitor, root)
    wrote = threading.Event()
    coord.register(5, checkpoint_thread_count=1, wait=False)
    coord.save_async("a", lambda: (write_step_file(root, 5, "a.bin"), wrote.set()) and None, 5)
    assert wrote.wait(20)
    assert registrar_held(monitor) and "finished" not in _receipts(root, 5)
    ray.kill(monitor, no_restart=True)
    first = in_thread(coord.wait_all)
    # Dead, or holding the registration past the timeout before it was killed: either way it fails.
    gone = (ray.exceptions.RayActorError, ckptd.CheckpointTimeoutError)
    assert first[0] == "raised" and isinstance(first[1], gone), first
    second = in_thread(coord.wait_all)
    assert second[0] == "raised" and isinstance(second[1], ckptd.CheckpointSaveError), second
    assert _receipts(root, 5).get("failed") == ["a"] and "finished" not in _receipts(root, 5)
    assert ckptd.latest_step(root) is None
    assert in_thread(coord.close)[0] in ("ok", "raised")


# -- 4. monitor restarts while units wait on the barrier --------------------------------------------


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
def test_a_monitor_restart_while_units_wait_on_the_barrier_never_commits_short(make_monitor, tmp_path, how):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    hold_registrar(coord, monitor, root)
    wrote = threading.Event()
    coord.register(5, checkpoint_thread_count=1, wait=False)
    coord.register(5, checkpoint_thread_count=1, wait=False)
    coord.save_async("a", lambda: (write_step_file(root, 5, "a.bin"), wrote.set()) and None, 5)
    assert wrote.wait(20)
    # What a restarted monitor reads: the unit is still running, and no registration of step 5.
    on_disk = _receipts(root, 5)
    assert registrar_held(monitor) and on_disk == {"reg": [], "started": ["a"]}, on_disk
    restart_monitor(monitor, how=how)  # the held registration is retried on the new monitor
    coord.wait_all()
    s = status(monitor).step(5)
    assert (s.expected, len(s.finished), s.committed) == (2, 1, False)
    assert ckptd.latest_step(root) == HOLD_STEP
    coord.save_sync(lambda: write_step_file(root, 5, "b.bin"), 5)
    coord.wait_committed(5, timeout_s=30)
    assert _files(root, 5) == ["a.bin", "b.bin"]
    assert len(read_manifest(root, 5, CKPT).registrations) == 2
    assert _files(root, HOLD_STEP) == ["hold.bin"]
    coord.close()


# -- 5. back-pressure with the barrier ----------------------------------------------------------


def test_full_lanes_and_staging_behind_held_registrations_unblock_once_released(env):
    root, monitor, hold, s5, s6 = env.root, env.monitor, env.s + 1, env.s + 5, env.s + 6
    coord = env.coord(max_pending=1, max_staged=1)
    release = hold_registrar(coord, monitor, root, step=hold)
    coord.register(s5, checkpoint_thread_count=3, wait=False)
    coord.register(s6, checkpoint_thread_count=2, wait=False)
    done = threading.Event()

    def training():
        for name in ("m0", "m1", "m2"):  # one lane: running (at its barrier), queued, then blocked
            coord.save_async("m", lambda name=name: write_step_file(root, s5, f"{name}.bin"), s5)
        coord.save_state_async("s", _state(6), s6)
        coord.save_async("m", lambda: write_step_file(root, s6, "m3.bin"), s6)
        done.set()

    worker = threading.Thread(target=training, daemon=True)
    worker.start()
    wait_for(lambda: os.path.exists(os.path.join(ckptd.step_dir(root, s5), "m0.bin")), what="m0.bin")
    # m0 waits at its barrier, so the third save of the lane cannot have returned yet.
    assert registrar_held(monitor, hold) and not done.is_set()
    release()
    worker.join(20)
    assert done.is_set(), "the training thread stayed blocked after the registrations were applied"
    coord.wait_all()
    for step in (s5, s6):  # steps commit independently: s6's commit says nothing of s5's
        coord.wait_committed(step, timeout_s=30)
    assert _files(root, s5) == ["m0.bin", "m1.bin", "m2.bin"]
    assert _files(root, s6) == ["m3.bin", "s.safetensors"]
    coord.close()
