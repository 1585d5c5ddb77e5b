"""Session 22: the retried withdrawal of a committed state dict, and resume(optimizer_name=).

Attacked with a real local Ray, real monitors (restarted by Ray after a crash failpoint or a
SIGKILL, frozen with SIGSTOP, replaced by a new job), real coordinators in their own processes
(``_Rewriter``: a checkpoint unit of a step that replaces a file of the step's committed state
dict with other bytes of the same size, so only a checksum tells) and real files. The situation
is always the same: step 2 is a full checkpoint, step 3 a committed state dict (the nested
"optim" pair plus a file written outside any unit), both trackers name them; then a unit of
step 3 replaces a committed file. Nothing is mocked; faults go through the named failpoint
``before_revoke`` (raise: storage refusing the withdrawal; delay; crash, once).

What held:

* I4 (``test_i4_...``): while the withdrawal retries (``raise``) or stalls (``delay``), an older
  state dict that commits does not move the tracker back (it stays on 3, then goes to 2, the
  newest step that verifies, not to 1); newer state dicts and full checkpoints that commit move
  the trackers forward and verify during the retry; once the retry succeeds the manifest is gone,
  the trackers name the newest step that verifies, and both kinds of step 3 report failed.
* I2/I3 with concurrency (``test_i2_two_units_and_a_duplicate...``): two units of step 3 replacing
  both files of the state dict (one reporting it, one failing) and a duplicate of the first
  unit's report, all arriving during the retry, run three withdrawals side by side; they all end,
  the manifest is gone, the trackers verify, and step 3 never commits, also after a SIGKILL.
* Fencing (``test_a_fenced_monitor_gives_up...``): a newer attempt opened on the root during the
  retry ends the retry loop (FencedError) instead of letting it spin, and the fenced monitor
  touches neither the manifest nor the trackers.
* I5 (``test_i5_...``): the monitor crashes inside the withdrawal (``before_revoke=crash``, once),
  on each of its three ways in: a finished unit's report (``UnitReports._finished``; Ray retries
  the notification on the restarted monitor), a failed unit (``withdraw_if_changed``, from the
  retried notification or ``_resume_step``), and a full checkpoint's commit check on a file
  written outside units (``_commit_once``, ``committed_changed``). The restarted monitor finishes
  the withdrawal each time, and I1 holds.
* I6 (``test_i6_resume_by_name...``): the optimizer comes back bit-exact (tensors, param_groups,
  key order and types) and trains on exactly as the saved one; its in-place updates leave the
  committed files intact (verify passes); a flipped byte in either file raises
  CorruptCheckpointError and changes neither the model nor the optimizer; a name the step does
  not hold raises CheckpointConfigError listing the states it does hold, changing nothing; with
  torch.load and pickle's entry points tripped, nothing is unpickled.

What broke, each fixed since (the tests below fail without the fix):

1. I1/I2 (``test_i2_a_committed_state_dict_file_replaced_without_a_report_is_withdrawn``): a
   committed state-dict file replaced by something that does not report it (a checkpoint unit
   that reports another file, or a plain ``torch.save`` outside units) fails the full checkpoint
   but the state dict is never withdrawn: ``Committer.commit`` checks the units' reports before
   the earlier manifests, and the state-dict unit's stale report raises a CommitCheckError
   without ``committed_changed``. Fixed: the committed files are checked first.
2. I1 (``test_i1_a_new_job_on_the_root_during_a_retried_withdrawal``): a new job's monitor
   started while the old one was retrying a withdrawal keeps the stale state-dict manifest and
   the tracker on it; nothing at a new attempt's start checks it. Fixed in
   ``attempts.clean_up_older_attempts``: a state dict committed in a step an older attempt was
   saving into is checksummed, and withdrawn if a listed file changed (then the step is cleaned
   as uncommitted and the tracker repaired; a tracker left with no committed step is removed).
3. I2 after a restart (``test_i2_a_restart_withdraws_for_a_finished_unit_it_never_heard_of``): a
   finished unit known only from its receipt, which replaced a committed state-dict file, is not
   checked by ``_resume_step`` (only failed units are); the manifest and tracker stay until a
   checkpoint registration of the step arrives. Fixed: ``_resume_step`` checks finished units'
   reports against the committed state dict, as ``_finished`` does live.
4. I6 (``test_i6_a_name_of_another_state_is_refused_before_anything_changes``): an
   ``optimizer_name`` that names another state the step holds is not refused before anything
   changes: another optimizer's state with other shapes loads silently (the next step raises),
   the flat model state raises torch's KeyError after the model was loaded. Fixed:
   ``resume._check_optimizer_state`` checks the structure and parameter groups (what
   ``load_state_dict`` checks) and, for torch's optimizers whose state has the parameters'
   shapes, each tensor's shape, before anything is applied; also for ``save_training_state``'s
   per-rank files.

Noted, not asserted: until a refused withdrawal succeeds the state-dict tracker names the step
being withdrawn (storage refuses the fix: by design, and why it is retried); the withdrawal
removes the manifest before it moves the tracker, so a reader between the two sees a tracker on
a step with no manifest (readers fall back to the manifests). Noted and fixed since: retention
counted a state dict being withdrawn among the newest ``max_state_dict_to_keep``, so it could
delete a valid older one that the withdrawal would have left among them (I4 now runs with the
default window of 2, and its "older" case fails without the fix); ``save_state_async`` refused an
optimizer state with no tensors (never stepped, or SGD without momentum), so such an optimizer
could not be saved for ``optimizer_name=`` at all.
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import ray
import torch

import ckptd
from ckptd.layout import TRACKERS, parse_tracker
from ckptd.monitor.attempts import open_attempt
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    assert_same_state,
    assert_trackers_verified,
    busy_coroutines,
    end_unheard,
    failpoint_env,
    read_manifest,
    restart_monitor,
    revoke_loops,
    start_new_job,
    unit_receipt,
    wait_all,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
OUTSIDE = "rank1.pt"


# -- helpers ---------------------------------------------------------------------------------------


def _optim(seed: int) -> dict:
    """An optimizer-like nested state: the default writer saves it as two files."""
    g = torch.Generator().manual_seed(seed)
    return {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(64, generator=g)}},
            "param_groups": [{"lr": 0.01 * seed, "betas": (0.9, 0.999), "params": [0]}]}


def _commit(coord, step: int, is_state_dict: bool) -> None:
    if is_state_dict:
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    else:
        coord.register(step, checkpoint_thread_count=1)
    coord.save_state_async("optim", _optim(step), step, is_state_dict=is_state_dict)
    coord.wait_committed(step, is_state_dict=is_state_dict, timeout_s=DEADLINE_S)


def _tracker(root: str, kind: ckptd.Kind) -> int | None:
    path = os.path.join(root, TRACKERS[kind])
    return parse_tracker(open(path).read()) if os.path.exists(path) else None


def _setup(coord, root: str, register_checkpoint: bool = True) -> None:
    """Step 2: a full checkpoint; step 3: a committed state dict (both trackers name them). With
    ``register_checkpoint``, the full checkpoint of step 3 is asked for too (one more unit)."""
    _commit(coord, 2, is_state_dict=False)
    write_step_file(root, 3, OUTSIDE)  # a plain save outside any unit: the state dict lists it too
    _commit(coord, 3, is_state_dict=True)
    assert OUTSIDE in {f.path for f in read_manifest(root, 3, SD).files}
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 3}
    if register_checkpoint:
        coord.register(3, checkpoint_thread_count=1)


@ray.remote(num_cpus=0, max_restarts=0)
class _Rewriter:
    """A worker process with its own coordinator: its checkpoint unit of a step replaces a file of
    the step's committed state dict with other bytes of the same size (only a checksum tells)."""

    def __init__(self, run: str, worker_id: str) -> None:
        monitor = ckptd.get_monitor(run)
        self.root = ray.get(monitor.worker_config.remote())["root"]
        self.worker_id = worker_id
        self.coord = ckptd.CheckpointCoordinator(monitor, worker_id=worker_id)

    def pid(self) -> int:
        return os.getpid()

    def rewrite(self, step: int, rel: str, how: str, gate: str | None = None) -> None:
        """``how``: "reports" (returns the replaced file), "fails" (replaces it, then raises),
        "silent" (replaces it, returns another file it wrote)."""
        path = f"{ckptd.step_dir(self.root, step)}/{rel}"

        def save_fn():
            if gate is not None:
                open(f"{gate}.waiting", "w").close()
                wait_for(lambda: os.path.exists(gate), timeout_s=DEADLINE_S, what="the gate")
            data = os.urandom(os.path.getsize(path))
            with open(path, "wb") as f:
                f.write(data)
            if how == "fails":
                raise OSError(f"disk full after replacing {rel}")
            if how == "silent":
                return write_step_file(self.root, step, f"extra-{self.worker_id}.bin")
            return [path]

        self.coord.save_async(f"rewrite-{rel}", save_fn, step)

    def wait_all(self) -> str | None:
        return wait_all(self.coord)


# -- I4: commits while a withdrawal is retried -----------------------------------------------------


@pytest.mark.parametrize("meanwhile", ["older", "newer", "delayed"])
def test_i4_commits_while_a_withdrawal_is_retried(make_monitor, tmp_path, run_name, meanwhile):
    """Step 3's state dict is being withdrawn, its first tries refused by storage ("older",
    "newer") or its one try stalled holding the tracker lock ("delayed"), while other steps commit:
    an older state dict (1), or newer ones (a state dict 4, a full checkpoint 5)."""
    root = str(tmp_path / "ckpt")
    # The default window of 2 state dicts: step 1 must stay, as step 3 (withdrawn) does not count.
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _setup(coord, root)
    arm_in_monitor(monitor, "before_revoke", "delay:1" if meanwhile == "delayed" else "raise")
    rw = _Rewriter.remote(run_name, "w1")
    try:
        ray.get(rw.rewrite.remote(3, "optim.safetensors", "reports"))
        if meanwhile == "delayed":
            wait_for(lambda: revoke_loops(monitor, 3) == [0], what="the withdrawal to start")
            arm_in_monitor(monitor, "before_revoke", None)
            _commit(coord, 4, is_state_dict=True)  # its tracker move waits for the withdrawal
        else:
            wait_for(lambda: min(revoke_loops(monitor, 3), default=0) >= 1, what="the withdrawal to be retried")
            if meanwhile == "older":
                _commit(coord, 1, is_state_dict=True)
                assert (_tracker(root, CKPT), _tracker(root, SD)) == (2, 3)  # not moved back to 1
            else:
                _commit(coord, 4, is_state_dict=True)
                assert assert_trackers_verified(root) == {CKPT: 2, SD: 4}
                _commit(coord, 5, is_state_dict=False)
                assert assert_trackers_verified(root) == {CKPT: 5, SD: 5}
            assert read_manifest(root, 3, SD) is not None and revoke_loops(monitor, 3)  # still retrying
    finally:
        arm_in_monitor(monitor, "before_revoke", None)
    err = ray.get(rw.wait_all.remote())
    assert err is not None and "withdrawn" in err, err
    with pytest.raises(ckptd.CheckpointSaveError):  # answered once the withdrawal has ended
        coord.wait_committed(3, is_state_dict=True, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, timeout_s=DEADLINE_S)
    assert read_manifest(root, 3, SD) is None
    want = {"older": {CKPT: 2, SD: 2}, "newer": {CKPT: 5, SD: 5}, "delayed": {CKPT: 2, SD: 4}}[meanwhile]
    assert assert_trackers_verified(root) == want
    other = 1 if meanwhile == "older" else 4
    assert read_manifest(root, other, SD) is not None
    ckptd.verify(root, other)
    coord.close()


# -- I2/I3: two units and a duplicate report during a retried withdrawal, then a restart -----------


def test_i2_two_units_and_a_duplicate_report_during_a_retried_withdrawal(make_monitor, tmp_path, run_name):
    """Two checkpoint units of step 3 replace the two files of its committed state dict (one
    reports its file, the other fails after writing), and the first unit's report arrives a
    second time, all while storage refuses the withdrawal; then the monitor is SIGKILLed. The
    later reports join the withdrawal under way (one per step), and every report is answered
    while storage still refuses it."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _setup(coord, root, register_checkpoint=False)
    coord.register(3, checkpoint_thread_count=2)
    arm_in_monitor(monitor, "before_revoke", "raise")
    rw1, rw2 = _Rewriter.remote(run_name, "w1"), _Rewriter.remote(run_name, "w2")
    try:
        ray.get(rw1.rewrite.remote(3, "optim.safetensors", "reports"))
        wait_for(lambda: revoke_loops(monitor, 3), what="the first withdrawal")
        ray.get(rw2.rewrite.remote(3, "optim.state.json", "fails"))
        assert ray.get(rw2.wait_all.remote(), timeout=DEADLINE_S) is not None
        # The first unit's report again, as a relay's fallback sends it straight to the monitor.
        body = unit_receipt(root, ray.get(monitor.ping.remote())["attempt"], 3, "w1")
        assert body is not None and body["status"] == "finished"
        dup = monitor.notify_batch.remote([("finished", body["unit"], {"files": body["files"],
                                                                        "found": body["found"]})])
        assert "withdrawn" in ray.get(dup, timeout=DEADLINE_S)[0]["refused"]
        assert "withdrawn" in ray.get(rw1.wait_all.remote(), timeout=DEADLINE_S)
        assert len(revoke_loops(monitor, 3)) == 1  # one withdrawal, still refused
        assert read_manifest(root, 3, SD) is not None
    finally:
        arm_in_monitor(monitor, "before_revoke", None)
    for is_sd in (True, False):  # answered once the withdrawal has ended
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(3, is_state_dict=is_sd, timeout_s=DEADLINE_S)
    assert read_manifest(root, 3, SD) is None and read_manifest(root, 3, CKPT) is None
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    # I3: after a SIGKILL the step is still failed, and nothing of it commits.
    restart_monitor(monitor, how="sigkill")
    for is_sd in (False, True):
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(3, is_state_dict=is_sd, timeout_s=DEADLINE_S)
    assert read_manifest(root, 3, SD) is None and read_manifest(root, 3, CKPT) is None
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    coord.close()


def _retried_withdrawal(make_monitor, root: str, run_name: str):
    """The set-up, then a unit that replaces the state dict's tensors file and reports it, while
    storage refuses the withdrawal (before_revoke raises): returns once it is being retried."""
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _setup(coord, root)
    arm_in_monitor(monitor, "before_revoke", "raise")
    rw = _Rewriter.remote(run_name, "w1")
    ray.get(rw.rewrite.remote(3, "optim.safetensors", "reports"))
    wait_for(lambda: min(revoke_loops(monitor, 3), default=0) >= 1, what="the withdrawal to be retried")
    return monitor, coord, rw


def test_a_fenced_monitor_gives_up_its_retried_withdrawal_and_publishes_nothing(make_monitor, tmp_path, run_name):
    """A newer job opens an attempt on the root (from another cluster: no monitor of it here yet)
    while job 1's monitor retries a withdrawal: the retry loop must end on the fence instead of
    spinning for ever, and the fenced monitor must not touch the manifest or the trackers."""
    root = str(tmp_path / "ckpt")
    monitor, coord, rw = _retried_withdrawal(make_monitor, root, run_name)
    open_attempt(Storage(root), f"{run_name}-elsewhere", None)
    wait_for(lambda: not revoke_loops(monitor, 3), timeout_s=DEADLINE_S, what="the withdrawal to give up")
    assert "superseded" in ray.get(monitor.__ray_call__.remote(lambda self: self._fenced))
    assert ray.get(rw.wait_all.remote()) is not None
    assert read_manifest(root, 3, SD) is not None  # left to the newer job's monitor
    assert (_tracker(root, CKPT), _tracker(root, SD)) == (2, 3)
    coord.close()


# -- I5: a monitor killed in a withdrawal ----------------------------------------------------------


def _withdrawn(monitor, root: str, step: int) -> bool:
    """The state dict of ``step`` is withdrawn and the monitor is done with it (the manifest goes
    before the tracker is pointed back: wait for both)."""
    return read_manifest(root, step, SD) is None and not busy_coroutines(monitor)


@pytest.mark.parametrize("how, rel", [("reports", "optim.safetensors"), ("fails", "optim.safetensors"),
                                      ("silent", OUTSIDE)], ids=["finished", "failed", "commit-check"])
def test_i5_a_monitor_killed_in_a_withdrawal_finishes_it_after_its_restart(make_monitor, tmp_path, run_name,
                                                                             how, rel):
    """The monitor dies inside the withdrawal (before its manifest goes), reached from a finished
    unit's report, a failed unit, or the full checkpoint's commit check; Ray restarts it."""
    root = str(tmp_path / "ckpt")
    once = tmp_path / "once"
    monitor = make_monitor(root, runtime_env=failpoint_env("before_revoke=crash", once))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _setup(coord, root)
    pid = ray.get(monitor.ping.remote())["pid"]
    rw = _Rewriter.remote(run_name, "w1")
    ray.get(rw.rewrite.remote(3, rel, how))
    wait_for(lambda: (once / "before_revoke").exists(), timeout_s=DEADLINE_S, what="the crash")
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != pid, timeout_s=DEADLINE_S, what="the restart")
    wait_for(lambda: _withdrawn(monitor, root, 3), timeout_s=DEADLINE_S, what="the withdrawal")
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    for is_sd in (False, True):
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(3, is_state_dict=is_sd, timeout_s=DEADLINE_S)
    err = ray.get(rw.wait_all.remote())
    assert (err is None) == (how == "silent"), err  # a unit that reported nothing wrong is not refused
    assert read_manifest(root, 3, CKPT) is None
    coord.close()


# -- I6: resume(optimizer_name=) ------------------------------------------------------------------


def _model_and_optim(seed: int, stepped: bool = True, width: int = 5):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * seed, betas=(0.8, 0.95))
    if stepped:
        _train(model, opt)
        _train(model, opt)
    return model, opt


def _train(model, opt) -> None:
    opt.zero_grad()
    model(torch.linspace(-1, 1, 24).reshape(4, 6)).square().mean().backward()
    opt.step()


def _snapshot(model, opt) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _unchanged(model, opt, before: tuple[dict, dict]) -> None:
    assert_same_state(before[0], model.state_dict(), "model")
    assert_same_state(before[1], opt.state_dict(), "optimizer")


def _save_three_states(coord) -> tuple:
    """Step 1, a full checkpoint: "model" (flat), "optim" (its AdamW) and "critic_optim" (another
    model's AdamW), all with the default writer."""
    model, opt = _model_and_optim(1)
    _, critic = _model_and_optim(2, width=7)
    coord.register(1, checkpoint_thread_count=3)
    coord.save_state_async("model", model.state_dict(), 1)
    coord.save_state_async("optim", opt.state_dict(), 1)
    coord.save_state_async("critic_optim", critic.state_dict(), 1)
    coord.wait_all()
    coord.wait_committed(1, timeout_s=DEADLINE_S)
    return model, opt


def _no_unpickling(monkeypatch) -> None:
    """Trip wires: anything that unpickles while they are set fails the test."""
    def tripped(*args, **kwargs):
        raise AssertionError("resume(optimizer_name=) unpickled something")

    monkeypatch.setattr(torch, "load", tripped)
    monkeypatch.setattr(pickle, "load", tripped)
    monkeypatch.setattr(pickle, "loads", tripped)
    monkeypatch.setattr(pickle, "Unpickler", tripped)


def test_i6_resume_by_name_is_bit_exact_checked_and_never_unpickles(make_monitor, tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0")
    model, opt = _save_three_states(coord)
    coord.close()
    want_model, want_opt = _snapshot(model, opt)
    d1 = ckptd.step_dir(root, 1)
    with monkeypatch.context() as m:
        _no_unpickling(m)
        fresh, fresh_opt = _model_and_optim(9, stepped=False)
        state = ckptd.resume(root, model=fresh, optimizer=fresh_opt, optimizer_name="optim", restore_rng=False)
    assert state.step == 1
    assert_same_state(want_model, fresh.state_dict(), "model")
    assert_same_state(want_opt, fresh_opt.state_dict(), "optimizer")
    # It trains on exactly as the saved optimizer does, and its in-place updates (of tensors that
    # may be mapped from the checkpoint) leave the committed files as they were.
    ref, ref_opt = _model_and_optim(9, stepped=False)
    ref.load_state_dict(want_model)
    ref_opt.load_state_dict(copy.deepcopy(want_opt))
    _train(fresh, fresh_opt)
    _train(ref, ref_opt)
    assert_same_state(ref.state_dict(), fresh.state_dict(), "model after a step")
    assert_same_state(ref_opt.state_dict(), fresh_opt.state_dict(), "optimizer after a step")
    ckptd.verify(root, 1)

    # A flipped byte in either file: refused, and neither object changes.
    for rel in ("optim.safetensors", "optim.state.json"):
        path = f"{d1}/{rel}"
        good = open(path, "rb").read()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x01
        with open(path, "wb") as f:
            f.write(bad)
        victim, victim_opt = _model_and_optim(5)
        before = _snapshot(victim, victim_opt)
        with pytest.raises(ckptd.CorruptCheckpointError, match=rel.replace(".", r"\.")):
            ckptd.resume(root, model=victim, optimizer=victim_opt, optimizer_name="optim", restore_rng=False)
        _unchanged(victim, victim_opt, before)
        with open(path, "wb") as f:
            f.write(good)
    ckptd.verify(root, 1)

    # A name the step does not hold: refused, naming the states it does hold, and nothing changes.
    victim, victim_opt = _model_and_optim(5)
    before = _snapshot(victim, victim_opt)
    with pytest.raises(ckptd.CheckpointConfigError, match=r"'optimizer'.*\['critic_optim', 'model', 'optim'\]"):
        ckptd.resume(root, model=victim, optimizer=victim_opt, optimizer_name="optimizer", restore_rng=False)
    _unchanged(victim, victim_opt, before)


def test_i6_a_name_of_another_state_is_refused_before_anything_changes(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0")
    _save_three_states(coord)
    coord.close()
    problems = []
    for name in ("critic_optim", "model"):
        victim, victim_opt = _model_and_optim(5)
        before = _snapshot(victim, victim_opt)
        try:
            ckptd.resume(root, model=victim, optimizer=victim_opt, optimizer_name=name, restore_rng=False)
            error = None
        except Exception as e:  # noqa: BLE001 - what it raised is checked below, with the objects
            error = e
        if not isinstance(error, ckptd.CheckpointConfigError):
            problems.append(f"optimizer_name={name!r} raised {error!r}, not CheckpointConfigError")
        for what, obj, was in (("model", victim, before[0]), ("optimizer", victim_opt, before[1])):
            try:
                assert_same_state(was, obj.state_dict(), what)
            except AssertionError:
                problems.append(f"optimizer_name={name!r} changed the {what}")
    assert not problems, problems


# -- I1/I2: the cases that broke, fixed since ------------------------------------------------------


def test_i2_a_committed_state_dict_file_replaced_without_a_report_is_withdrawn(make_monitor, tmp_path, run_name):
    """A checkpoint unit of step 3 replaces the committed state dict's optim.safetensors but reports
    only another file it wrote (as a plain ``torch.save`` of another rank, outside any unit, would):
    the full checkpoint's commit finds the change and fails, and must withdraw the state dict."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _setup(coord, root)
    rw = _Rewriter.remote(run_name, "w1")
    ray.get(rw.rewrite.remote(3, "optim.safetensors", "silent"))
    assert ray.get(rw.wait_all.remote()) is None
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, timeout_s=DEADLINE_S)
    wait_for(lambda: not busy_coroutines(monitor), what="the monitor to settle step 3")
    assert read_manifest(root, 3, CKPT) is None
    assert read_manifest(root, 3, SD) is None, "the state dict still lists the replaced optim.safetensors"
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    coord.close()


def test_i1_a_new_job_on_the_root_during_a_retried_withdrawal(make_monitor, tmp_path, run_name):
    """Job 1's monitor is retrying the withdrawal of step 3's state dict (storage refuses it) when
    job 2 starts on the root (job 1's monitor is killed, as a new job does)."""
    root = str(tmp_path / "ckpt")
    monitor, coord, rw = _retried_withdrawal(make_monitor, root, run_name)
    coord.close()
    monitor2 = start_new_job(make_monitor, root, monitor)
    assert ray.get(rw.wait_all.remote()) is not None  # its report went to job 1's monitor, now gone
    wait_for(lambda: not busy_coroutines(monitor2), what="the new monitor's start-up")
    assert read_manifest(root, 3, SD) is None, "the state dict still lists the replaced optim.safetensors"
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}


def test_i2_a_restart_withdraws_for_a_finished_unit_it_never_heard_of(make_monitor, tmp_path, run_name):
    """The checkpoint unit of step 3 (not registered yet) replaces the committed state dict's
    optim.safetensors and finishes while the monitor is frozen (SIGSTOP); its process dies with the
    notification, then the monitor is SIGKILLed. Only the unit's receipt tells the restarted
    monitor: it must withdraw the state dict as it would have on hearing the unit."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _setup(coord, root, register_checkpoint=False)
    rw = _Rewriter.remote(run_name, "w1")
    gate = str(tmp_path / "gate")
    ray.get(rw.rewrite.remote(3, "optim.safetensors", "reports", gate))
    end_unheard(monitor, root, 3, "w1", gate, rw, "finished", method="pid", timeout_s=DEADLINE_S)
    wait_for(lambda: not busy_coroutines(monitor), what="the restarted monitor's start-up")
    assert read_manifest(root, 3, SD) is None, "the state dict still lists the replaced optim.safetensors"
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    coord.close()
