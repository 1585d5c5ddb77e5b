"""Session 21b: the two files of a nested default-writer save, against failures, restarts and fencing.

``coord.save_state_async(name, state, step)`` with no ``write_fn`` and a nested state (an
optimizer's state dict) writes ONE save unit of TWO files: ``{name}.safetensors`` (the tensors,
staged as the file's image) and then ``{name}.state.json`` (the structure). This attacks the
window between the two files, with a real local Ray, real monitors (restarted with ``ray.kill``,
or replaced by a new job on the same root), real writer processes and a real file-size limit
(RLIMIT_FSIZE: EFBIG part-way through the structure file, as a full disk):

1. The structure's write fails after the tensors file was published (thread writer and writer
   process): the unit is failed, ``wait_all`` raises ``CheckpointSaveError``, the step never
   commits, not after a monitor restart either; what was committed before is unchanged and the
   trackers still name it; a new job on the root clears the leftover tensors file and commits its
   own (flat) save of the step with no stale structure beside it.
2. A committed state dict whose nested file pair a later checkpoint unit of the same step
   rewrites, failing between the two files: no manifest may keep claiming the replaced bytes.
   This broke (the state-dict manifest and tracker stayed on a step that no longer verified: a
   failed unit's report was never checked against the committed state dict, only a finished
   one's); fixed in ``UnitReports.withdraw_if_changed``, which withdraws that state dict. Also
   when the monitor learns of that failure only from its receipt, after a restart (the unit's
   process and its notification died while the monitor was frozen): ``actor._resume_step``.
3. A unit of an old job (a coordinator that outlived its job) held just before either file, or
   between the two, while a new job commits the step: neither of its files is published into the
   new job's step (save thread and writer process), the old unit fails naming both attempts.
4. Trinity's semantics with nested saves: a full checkpoint waits for the step's state-dict unit
   held between its two files, across a monitor restart; both trackers then name the step, the
   manifest lists all four files with their size and CRC-32, an older step committed afterwards
   does not move the trackers back.
"""

from __future__ import annotations

import copy
import os
import resource
import shutil
import signal
import sys
import threading
import zlib
from contextlib import contextmanager
from functools import partial

import pytest
import ray
import torch

import ckptd
from ckptd.commit import TMP_PREFIX
from ckptd.workers import state_file

from .helpers import (
    assert_same_state,
    assert_trackers_verified,
    end_unheard,
    failpoint_env,
    read_manifest,
    restart_monitor,
    start_new_job,
    status,
    wait_all,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("ray_local")

MiB = 1 << 20
DEADLINE_S = 60.0  # far beyond any wait here: reaching it means a hang
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
LIMIT = 2 * MiB  # RLIMIT_FSIZE where a write must fail: the structure file is larger, the tensors file small


# -- helpers ---------------------------------------------------------------------------------------


def _optim(seed: int, big_structure: bool = False) -> dict:
    """An optimizer-like nested state (a few KiB of tensors); with ``big_structure`` its JSON
    structure is about 3 MiB (a long string), past ``LIMIT``, while its tensors file stays small."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "state": {0: {"step": torch.tensor(float(seed), dtype=torch.float64), "exp_avg": torch.randn(64, generator=g)},
                  1: {"step": torch.tensor(3.0, dtype=torch.float64), "exp_avg": torch.randn(8, 4, generator=g)}},
        "param_groups": [{"lr": 0.01 * seed, "betas": (0.9, 0.999), "params": [0, 1]}],
    }
    if big_structure:
        state["param_groups"][0]["note"] = "x" * (3 * MiB)
    return state


def _train_step(state: dict) -> None:
    """Every tensor and plain value of ``state`` changed in place, as the optimizer step does."""
    with torch.no_grad():
        for s in state["state"].values():
            for t in s.values():
                t.add_(1)
    state["param_groups"][0]["lr"] = -1.0
    state["param_groups"][0]["params"].append(99)


def _visible(step_dir: str) -> list[str]:
    if not os.path.isdir(step_dir):
        return []
    return sorted(n for n in os.listdir(step_dir) if not n.startswith(TMP_PREFIX))


def _tmp_files(step_dir: str) -> list[str]:
    return [n for n in os.listdir(step_dir) if n.startswith(TMP_PREFIX)] if os.path.isdir(step_dir) else []


def _snapshot_bytes(step_dir: str) -> dict[str, bytes]:
    out = {}
    for n in _visible(step_dir):
        with open(f"{step_dir}/{n}", "rb") as f:
            out[n] = f.read()
    return out


def _assert_manifest_matches_files(root: str, step: int, kind: ckptd.Kind, names: list[str]) -> None:
    """The manifest of ``kind`` lists exactly ``names`` (besides other manifests), each with the
    size and CRC-32 of the file on disk."""
    manifest = read_manifest(root, step, kind)
    assert manifest is not None, f"step {step} has no {kind} manifest"
    listed = {f.path: f for f in manifest.files}
    assert sorted(p for p in listed if not p.startswith("ckptd_")) == sorted(names)
    d = ckptd.step_dir(root, step)
    for name in names:
        with open(f"{d}/{name}", "rb") as f:
            data = f.read()
        assert (listed[name].size, listed[name].crc32) == (len(data), f"{zlib.crc32(data):08x}"), name


def _assert_failed(coord: ckptd.CheckpointCoordinator, step: int, is_state_dict: bool = False) -> None:
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(step, is_state_dict=is_state_dict, timeout_s=DEADLINE_S)


def _assert_pending(coord: ckptd.CheckpointCoordinator, step: int, is_state_dict: bool = False) -> None:
    """``step`` is neither committed nor failed (yet)."""
    with pytest.raises(TimeoutError):
        coord.wait_committed(step, is_state_dict=is_state_dict, timeout_s=1.0)


@contextmanager
def _file_size_limit(nbytes: int):
    """RLIMIT_FSIZE for this process (and any process it starts meanwhile): a write past
    ``nbytes`` fails with EFBIG (Python ignores SIGXFSZ)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


class _Hold:
    """Holds the first call of ``state_file.<fn>`` whose path ends with ``suffix`` (the save
    thread's, in this process) until :meth:`release`; every other call goes through at once."""

    def __init__(self, monkeypatch, fn: str, suffix: str) -> None:
        self.entered, self._go = threading.Event(), threading.Event()
        self._used = False
        self._lock = threading.Lock()
        original = getattr(state_file, fn)

        def held(storage, path, *args, **kwargs):
            with self._lock:
                mine = not self._used and path.endswith(suffix)
                self._used = self._used or mine
            if mine:
                self.entered.set()
                assert self._go.wait(DEADLINE_S), "never released"
            return original(storage, path, *args, **kwargs)

        monkeypatch.setattr(state_file, fn, held)

    def wait_entered(self) -> None:
        assert self.entered.wait(DEADLINE_S), "the save never reached the held write"

    def release(self) -> None:
        self._go.set()


def write_when_open(gate: str, snapshot) -> list:
    """A write_fn run by a writer process: it holds the process (which runs one job at a time)
    until the file ``gate`` exists, after creating ``{gate}.waiting``; writes nothing."""
    open(f"{gate}.waiting", "w").close()
    wait_for(lambda: os.path.exists(gate), timeout_s=DEADLINE_S, what="the gate")
    return []


def _in_writer_run(name: str) -> bool:
    """Whether the save thread of ``name`` is inside ``WriterProcess.run`` (past its admission)."""
    threads = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if threads.get(ident) != f"ckptd-save-{name}":
            continue
        while frame is not None:
            if frame.f_code.co_name == "run" and frame.f_code.co_filename.endswith("writer_process.py"):
                return True
            frame = frame.f_back
    return False


def _commit_nested(coord, root: str, step: int, name: str = "optim", seed: int | None = None, **kwargs) -> dict:
    """Save ``name`` (nested) as a checkpoint of ``step``, fenced, changed after before_update;
    wait for the commit; return what was saved."""
    state = _optim(step if seed is None else seed)
    want = copy.deepcopy(state)
    coord.register(step, checkpoint_thread_count=1)
    coord.save_state_async(name, state, step, fenced=True, **kwargs)
    coord.before_update()
    _train_step(state)
    coord.wait_committed(step, timeout_s=DEADLINE_S)
    return want


# -- 1: the structure's write fails after the tensors file was published --------------------------


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_structure_write_failing_after_the_tensors_file_never_commits_nor_after_a_restart_or_new_job(
        make_monitor, tmp_path, writer):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", writer=writer)
    # Step 1: committed, nested (both files); its bytes are what must never change. A writer
    # process must start under the limit (it inherits it), so there step 1 comes after step 2.
    if writer == "thread":
        want1 = _commit_nested(coord, root, 1)
        before = _snapshot_bytes(ckptd.step_dir(root, 1))

    # Step 2: the tensors file (a few KiB) is written and published, the structure (3 MiB) is not.
    state = _optim(2, big_structure=True)
    coord.register(2, checkpoint_thread_count=1)
    with _file_size_limit(LIMIT):
        coord.save_state_async("optim", state, 2, fenced=writer == "thread")
        if writer == "thread":
            coord.before_update()
        with pytest.raises(ckptd.CheckpointSaveError, match="File too large") as e:
            coord.wait_all()
    assert e.value.step == 2
    _assert_failed(coord, 2)
    d2 = ckptd.step_dir(root, 2)
    assert "optim.state.json" not in _visible(d2) and not _tmp_files(d2), _visible(d2)
    assert read_manifest(root, 2, CKPT) is None and read_manifest(root, 2, SD) is None
    if writer == "process":
        want1 = _commit_nested(coord, root, 1)  # the same writer process, limit and all: small files go
        before = _snapshot_bytes(ckptd.step_dir(root, 1))
    assert ckptd.latest_step(root) == 1
    assert assert_trackers_verified(root) == {CKPT: 1, SD: 1}

    # A restarted monitor rebuilds its ledger: step 2 is still failed, step 1 still the newest.
    restart_monitor(monitor)
    _assert_failed(coord, 2)
    assert assert_trackers_verified(root) == {CKPT: 1, SD: 1}
    assert_same_state(want1, ckptd.load_state(root, "optim", 1))
    assert _snapshot_bytes(ckptd.step_dir(root, 1)) == before
    coord.close()

    # A new job on the root: the old attempt's leftover of step 2 goes; its own flat save of step 2
    # commits with no structure file beside it, and step 1 is untouched.
    monitor2 = start_new_job(make_monitor, root, monitor)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", writer=writer)
    flat = {"w": torch.arange(5, dtype=torch.float32)}
    new.register(2, checkpoint_thread_count=1)
    new.save_state_async("optim", {"w": flat["w"].clone()}, 2)
    new.wait_all()
    new.wait_committed(2, timeout_s=DEADLINE_S)
    assert _visible(d2) == ["ckptd_manifest.json", "optim.safetensors"]
    _assert_manifest_matches_files(root, 2, CKPT, ["optim.safetensors"])
    assert_same_state(flat, ckptd.load_state(root, "optim", 2))
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    assert _snapshot_bytes(ckptd.step_dir(root, 1)) == before
    assert_same_state(want1, ckptd.load_state(root, "optim", 1))
    new.close()


# -- 2: a committed state dict's file pair rewritten by a unit that then fails ---------------------


def _checkpoint_2_and_state_dict_3(coord) -> None:
    """Step 2 committed as a full checkpoint, and the state dict of step 3, both the nested "optim"."""
    coord.register(2, checkpoint_thread_count=1)
    coord.save_state_async("optim", _optim(2), 2)
    coord.wait_committed(2, timeout_s=DEADLINE_S)
    coord.register(3, is_state_dict=True, state_dict_thread_count=1)
    coord.save_state_async("optim", _optim(3), 3, is_state_dict=True)
    coord.wait_committed(3, is_state_dict=True, timeout_s=DEADLINE_S)


@pytest.mark.parametrize("revoke_fails", [False, True], ids=["", "revoke-fails-once"])
def test_a_checkpoint_unit_that_replaces_a_committed_state_dicts_tensors_file_then_fails_withdraws_it(
        make_monitor, tmp_path, revoke_fails):
    """Trinity's save_state_dict(S) then save_checkpoint(S): the state dict of step 3 commits with
    the nested "optim" (both files); a checkpoint unit of step 3 saves "optim" again with other
    tensors, publishes the tensors file (replacing the committed one) and fails writing its
    structure (EFBIG). The unit and the full checkpoint fail; no manifest may keep claiming the
    replaced bytes, and the state-dict tracker must name a step that verifies. With
    ``revoke_fails``, the first withdrawal raises (storage refusing it, as the failpoint
    before_revoke does): the monitor must try again, not leave the manifest behind."""
    root = str(tmp_path / "ckpt")
    once = tmp_path / "once"
    monitor = make_monitor(root, **({"runtime_env": failpoint_env("before_revoke=raise", once)} if revoke_fails
                                    else {}))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _checkpoint_2_and_state_dict_3(coord)
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 3}

    coord.register(3, checkpoint_thread_count=1)
    with _file_size_limit(LIMIT):
        coord.save_state_async("optim", _optim(33, big_structure=True), 3)
        with pytest.raises(ckptd.CheckpointSaveError, match="File too large"):
            coord.wait_all()
    _assert_failed(coord, 3)
    # The tensors file of step 3 is now the failed unit's: the monitor withdrew the state dict
    # that listed the old one, so no tracker names a step whose manifest lists bytes that are gone.
    assert read_manifest(root, 3, SD) is None
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    assert (once / "before_revoke").exists() == revoke_fails
    coord.close()


@ray.remote(num_cpus=0, max_restarts=0)
class _HeldSaver:
    """A coordinator in its own process. Its nested save waits before the structure file until
    the file ``gate`` exists (after creating ``{gate}.waiting``); with ``fail``, under a file-size
    limit that then fails that file."""

    def __init__(self, run: str) -> None:
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id="w1")

    def ping(self) -> bool:
        return True

    def save(self, step: int, gate: str, fail: bool) -> None:
        if fail:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        original = state_file.write_json

        def held(storage, path, *args, **kwargs):
            if path.endswith(".state.json"):
                open(f"{gate}.waiting", "w").close()
                wait_for(lambda: os.path.exists(gate), timeout_s=DEADLINE_S, what="the gate")
            return original(storage, path, *args, **kwargs)

        state_file.write_json = held
        self.coord.save_state_async("optim", _optim(33, big_structure=fail), step)


@pytest.mark.parametrize("outcome", ["failed", "finished"])
def test_a_unit_that_replaced_a_committed_state_dicts_file_unheard_is_refused_by_a_restart(
        make_monitor, tmp_path, run_name, outcome):
    """Case 2 with the unit's outcome known only from its receipt: the checkpoint unit of step 3
    runs in another process and replaces the committed state dict's tensors file. The monitor is
    frozen (SIGSTOP) before the unit ends (failing its structure file, or writing it), so its
    notification waits; that process is killed once the receipt is written (the notification dies
    with it), then the monitor is SIGKILLed. The restarted monitor rebuilds step 3 from the
    receipts (the unit, a committed state dict) and must, by itself, withdraw that state dict and
    fail the full checkpoint, as it would have on hearing the unit: nothing will tell it."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _checkpoint_2_and_state_dict_3(coord)
    coord.register(3, checkpoint_thread_count=1)
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 3}

    saver = _HeldSaver.remote(run_name)
    gate = str(tmp_path / "gate")
    ray.get(saver.save.remote(3, gate, outcome == "failed"))
    end_unheard(monitor, root, 3, "w1", gate, saver, outcome, timeout_s=DEADLINE_S)
    _assert_failed(coord, 3)
    wait_for(lambda: read_manifest(root, 3, SD) is None, timeout_s=DEADLINE_S,
             what="the restarted monitor to withdraw the state dict of step 3")
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    coord.close()


# -- 3: an old job's unit cannot publish either file into the new job's step -----------------------


@pytest.mark.parametrize("held", ["write_safetensors", "write_json"], ids=["before-both", "between-the-two"])
@pytest.mark.parametrize("new_state", ["nested", "flat"])
def test_an_old_jobs_nested_save_thread_publishes_neither_file_into_the_new_jobs_step(
        make_monitor, tmp_path, monkeypatch, held, new_state):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=10.0)
    suffix = "optim.safetensors" if held == "write_safetensors" else "optim.state.json"
    hold = _Hold(monkeypatch, held, f"/{suffix}")
    old.register(5, checkpoint_thread_count=1)
    old_state = _optim(500)
    old.save_state_async("optim", old_state, 5, fenced=True)
    old.before_update()
    hold.wait_entered()  # admitted by job 1, and about to publish (one of) its files
    d5 = ckptd.step_dir(root, 5)
    if held == "write_json":
        assert _visible(d5) == ["optim.safetensors"]  # the tensors file is out, the structure is not

    monitor2 = start_new_job(make_monitor, root, monitor)
    assert _visible(d5) == []  # the new job cleared what the old attempt left in a step it never committed
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    want = _optim(5) if new_state == "nested" else {"w": torch.full((7,), 5.0)}
    new.register(5, checkpoint_thread_count=1)
    new.save_state_async("optim", copy.deepcopy(want), 5)
    new.wait_all()
    new.wait_committed(5, timeout_s=DEADLINE_S)
    committed = _snapshot_bytes(d5)

    hold.release()
    error = wait_all(old)
    assert error is not None and "superseded by attempt" in error, error
    names = ["optim.safetensors", "optim.state.json"] if new_state == "nested" else ["optim.safetensors"]
    assert _visible(d5) == sorted(["ckptd_manifest.json", *names]), _visible(d5)
    assert _snapshot_bytes(d5) == committed and not _tmp_files(d5)
    _assert_manifest_matches_files(root, 5, CKPT, names)
    assert_same_state(want, ckptd.load_state(root, "optim", 5))
    assert assert_trackers_verified(root) == {CKPT: 5, SD: 5}
    new.close()
    old.close()


def test_an_old_jobs_nested_save_in_a_writer_process_publishes_neither_file_into_the_new_jobs_step(
        make_monitor, tmp_path):
    """The writer process runs one job at a time: a gated job holds it, the old job's nested
    default save is admitted and queued behind it; a new job commits step 5; then the writer
    process writes the old save, which must be fenced for both files."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=10.0, writer="process")
    old.register(4, checkpoint_thread_count=1)
    old.save_state_async("gate", {"g": torch.zeros(2)}, 4, partial(write_when_open, gate))
    wait_for(lambda: os.path.exists(f"{gate}.waiting"), timeout_s=DEADLINE_S, what="the writer process to hold")
    old.register(5, checkpoint_thread_count=1)
    old.save_state_async("optim", _optim(500), 5)
    # Admitted by job 1's monitor, its save thread now waits for the writer process to be free.
    wait_for(lambda: _in_writer_run("optim"), timeout_s=DEADLINE_S, what="the old unit to wait for the writer")
    assert status(monitor).step(5).started

    monitor2 = start_new_job(make_monitor, root, monitor)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    want = _optim(5)
    new.register(5, checkpoint_thread_count=1)
    new.save_state_async("optim", copy.deepcopy(want), 5)
    new.wait_all()
    new.wait_committed(5, timeout_s=DEADLINE_S)
    d5 = ckptd.step_dir(root, 5)
    committed = _snapshot_bytes(d5)

    open(gate, "w").close()
    errors = []
    for _ in range(2):  # the gated unit's failure, then the old nested save's
        error = wait_all(old)
        if error is None:
            break
        errors.append(error)
    assert any("superseded by attempt" in e and "did not publish" in e for e in errors), errors
    assert _visible(d5) == ["ckptd_manifest.json", "optim.safetensors", "optim.state.json"]
    assert _snapshot_bytes(d5) == committed and not _tmp_files(d5)
    _assert_manifest_matches_files(root, 5, CKPT, ["optim.safetensors", "optim.state.json"])
    assert_same_state(want, ckptd.load_state(root, "optim", 5))
    assert assert_trackers_verified(root) == {CKPT: 5, SD: 5}
    new.close()
    old.close()


# -- 4: Trinity's semantics with nested saves ------------------------------------------------------


def test_a_full_checkpoint_waits_for_a_nested_state_dict_unit_held_between_its_files_across_a_restart(
        make_monitor, tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    hold = _Hold(monkeypatch, "write_json", "/model.state.json")
    coord.register(7, state_dict_thread_count=1, checkpoint_thread_count=1)  # a full checkpoint
    model, optim = _optim(70), _optim(71)
    want_model, want_optim = copy.deepcopy(model), copy.deepcopy(optim)
    coord.save_state_async("model", model, 7, is_state_dict=True, fenced=True)
    coord.save_state_async("optim", optim, 7, fenced=True)
    coord.before_update()
    _train_step(model)
    _train_step(optim)
    hold.wait_entered()  # the state-dict unit's tensors file is out, its structure is not
    d7 = ckptd.step_dir(root, 7)
    wait_for(lambda: "optim.state.json" in _visible(d7), timeout_s=DEADLINE_S, what="the checkpoint unit's files")
    _assert_pending(coord, 7)
    _assert_pending(coord, 7, is_state_dict=True)
    assert read_manifest(root, 7, SD) is None and read_manifest(root, 7, CKPT) is None
    assert assert_trackers_verified(root) == {CKPT: None, SD: None}

    restart_monitor(monitor)  # the running unit must still hold the commit after the restart
    _assert_pending(coord, 7)
    assert read_manifest(root, 7, CKPT) is None
    hold.release()
    coord.wait_all()
    coord.wait_committed(7, timeout_s=DEADLINE_S)
    files = ["model.safetensors", "model.state.json", "optim.safetensors", "optim.state.json"]
    _assert_manifest_matches_files(root, 7, CKPT, files)
    assert_same_state(want_model, ckptd.load_state(root, "model", 7))
    assert_same_state(want_optim, ckptd.load_state(root, "optim", 7))
    assert assert_trackers_verified(root) == {CKPT: 7, SD: 7}

    # An older step committed afterwards verifies, and moves neither tracker back.
    want6 = _commit_nested(coord, root, 6)
    assert_same_state(want6, ckptd.load_state(root, "optim", 6))
    assert assert_trackers_verified(root) == {CKPT: 7, SD: 7}
    assert_same_state(want_optim, ckptd.load_state(root, "optim"))
    coord.close()


def test_a_state_dict_then_a_full_checkpoint_of_one_step_with_nested_saves_commits_every_file(make_monitor, tmp_path):
    """save_state_dict(S) (nested "model", registered as a state dict), then save_checkpoint(S)
    (nested "optim"): registrations add up, the full checkpoint lists the state dict's pair and its
    own, each with its size and CRC-32."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    model, optim = _optim(80), _optim(81)
    want_model, want_optim = copy.deepcopy(model), copy.deepcopy(optim)
    coord.register(8, is_state_dict=True, state_dict_thread_count=1)
    coord.save_state_async("model", model, 8, is_state_dict=True)
    _train_step(model)
    coord.wait_committed(8, is_state_dict=True, timeout_s=DEADLINE_S)
    _assert_manifest_matches_files(root, 8, SD, ["model.safetensors", "model.state.json"])
    assert assert_trackers_verified(root) == {CKPT: None, SD: 8}
    coord.register(8, checkpoint_thread_count=1)
    coord.save_state_async("optim", optim, 8)
    _train_step(optim)
    coord.wait_committed(8, timeout_s=DEADLINE_S)
    _assert_manifest_matches_files(
        root, 8, CKPT, ["model.safetensors", "model.state.json", "optim.safetensors", "optim.state.json"])
    assert_same_state(want_model, ckptd.load_state(root, "model", 8))
    assert_same_state(want_optim, ckptd.load_state(root, "optim", 8))
    assert assert_trackers_verified(root) == {CKPT: 8, SD: 8}
    coord.close()
    shutil.rmtree(root, ignore_errors=True)

