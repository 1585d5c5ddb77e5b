"""Session 22b: the three commit-path fixes of 92c7075, attacked.

A (``attempts.clean_up_older_attempts``): a new job checksums the state dict of each step an
older attempt was still saving into, and withdraws it if a listed file changed. B
(``Committer.commit``): committed files are checked before the units' reports. C
(``CheckpointMonitor._resume_step``): a restarted monitor checks finished units' reports against
the committed state dict.

Real local Ray, real monitors (a new job's, or Ray's restart after SIGSTOP + SIGKILL), real
coordinators (in this process, or in their own actor process) and real files; nothing mocked.

What was attacked, and what held:

* I2 against fix A (``test_i2_a_new_job_keeps_an_intact_state_dict_of_a_touched_step``): job 1
  commits a state dict of step 3 (a file in a subdirectory among its files), registers its full
  checkpoint, and a checkpoint unit of step 3 is still writing (a partial file on storage, ledger
  records of attempt 1 for step 3, so the step is "touched") when job 2 starts on the root.
  Variants: the plain layout; a 20 MiB listed file (three 8 MiB read chunks); the
  ``epoch-{epoch}_step-{step}`` template; a unit that wrote a committed file again with the same
  bytes (new mtime). Each time the intact state dict survives (its manifest and every listed file
  byte for byte), the partial file goes, the trackers stay on (2, 3) and verify, job 1's released
  unit is fenced and publishes nothing, and job 2 then saves into step 3: its full checkpoint
  commits, both manifests verify on their own, and the state dict's bytes are unchanged.
* I1 against fix A and the new ``_repair_trackers`` branch
  (``test_i1_a_new_job_withdraws_the_only_state_dict_and_removes_its_tracker``): the only
  committed step is a state dict whose listed file an in-flight unit of job 1 replaced; job 2
  removes the manifest and the step directory and removes the state-dict tracker (nothing left to
  name); job 1's unit, released, publishes nothing (I3).
* I4 against fixes B and C, live (``test_i4_...[live]``, ``[new-job-live]``): a checkpoint unit
  of step 3 reports a committed state-dict file it never touched, with the right size but a wrong
  CRC-32 (a ``WrittenFile`` whose checksum is wrong; storage and the committed manifest agree).
  The monitor refuses the unit ("its report is wrong"), the full checkpoint of step 3 fails, and
  the intact state dict stays, whether it was committed by this job or an older one.

What broke, fixed since (these cases fail without the fix):

1. I1 + I4, ``test_i4_...[new-job-restart]``: the state dict of step 3 was committed by job 1;
   in job 2 the lying unit finishes while job 2's monitor is frozen, and the monitor is
   SIGKILLed, so the restarted monitor learns of the unit only from its receipt.
   ``CheckpointMonitor._resume_step`` (fix C) sees the report differ from the committed state
   dict and calls ``withdraw_if_changed``, which finds storage intact and rightly keeps the state
   dict; but the unit stays *finished* with its wrong report (live, ``_finished`` refuses it).
   ``Committer.commit`` then commits step 3's full checkpoint: ``_check_reports`` accepts a report
   whose size and mtime match storage without its CRC (``_same``), and ``merged.update(claimed)``
   lets the report's entry replace the committed one. The checkpoint manifest lists weights.bin
   with CRC 0badc0de, the checkpoint tracker names step 3, and that manifest on its own does not
   verify (``ckptd.verify`` passes only because it merges both manifests with the state dict's
   entry last, which masks the checkpoint's).
2. I4, ``test_i4_...[restart]``: the same, with the state dict committed by the same job: the
   state dict unit's report is in the commit too, so the CRC read picks the right entry and the
   manifest is correct, but step 3's full checkpoint commits, counting the unit whose report was
   wrong, where live it fails.

Fixed in ``Committer.commit``: after ``_check_reports``, any unit's report (every entry of
``plan.reports``, not only the claimed winner) of a file a committed manifest lists with another
(size, crc32) than the committed entry fails the commit: the committed files were just checked
against storage, so such a report is wrong. ``CommitCheckError`` without ``committed_changed``:
the state dict stays, and the full checkpoint of the step fails, as it does live.
"""

from __future__ import annotations

import os

import pytest
import ray

import ckptd
from ckptd.layout import MANIFESTS, TRACKERS, parse_tracker
from ckptd.manifest import Manifest, changed_files
from ckptd.storage import Storage

from .helpers import (
    assert_trackers_verified,
    busy_coroutines,
    end_unheard,
    ledger_records,
    read_manifest,
    start_new_job,
    wait_all,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
EPOCH_TEMPLATE = "epoch-{epoch}_step-{step}"


def _write(d: str, name: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(f"{d}/{name}"), exist_ok=True)
    with open(f"{d}/{name}", "wb") as f:
        f.write(data)
    return f"{d}/{name}"


def _save(coord, step: int, files: dict[str, bytes], is_state_dict: bool, epoch: int | None) -> None:
    """One unit of ``step`` writing ``files``; waits until the kind commits."""
    if is_state_dict:
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    else:
        coord.register(step, checkpoint_thread_count=1)
    d = coord.step_dir(step, epoch=epoch)
    coord.save_async(f"u{step}{is_state_dict}", lambda: [_write(d, n, b) for n, b in files.items()], step,
                     is_state_dict=is_state_dict)
    coord.wait_committed(step, is_state_dict=is_state_dict, timeout_s=DEADLINE_S)


def _trackers(root: str) -> dict:
    out = {}
    for kind, name in TRACKERS.items():
        path = os.path.join(root, name)
        out[kind] = parse_tracker(open(path).read()) if os.path.exists(path) else None
    return out


def _trackers_verified(root: str, epoch_layout: bool) -> dict:
    """I1: assert_trackers_verified, which builds the directory name without an epoch; for the
    epoch layout, ckptd.verify on each tracked step (it finds the directory by the template)."""
    if not epoch_layout:
        return assert_trackers_verified(root)
    named = _trackers(root)
    for step in named.values():
        if step is not None:
            ckptd.verify(root, step)
    return named


def _kind_verifies(root: str, step: int, kind: ckptd.Kind, epoch_layout: bool) -> list[str]:
    """The files the manifest of ``kind`` alone lists with other bytes than storage holds."""
    name = os.path.basename(_step_dir(root, step, epoch_layout))
    with open(f"{root}/{name}/{MANIFESTS[kind]}") as f:
        manifest = Manifest.model_validate_json(f.read())
    return changed_files(Storage(root), name, manifest.files)


def _step_dir(root: str, step: int, epoch_layout: bool) -> str:
    return f"{root}/epoch-1_step-{step}" if epoch_layout else ckptd.step_dir(root, step)


def _files(d: str) -> dict[str, bytes]:
    out = {}
    for base, _dirs, names in os.walk(d):
        for n in names:
            p = os.path.join(base, n)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


# -- I2 against fix A ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["plain", "large", "epoch", "same-bytes"])
def test_i2_a_new_job_keeps_an_intact_state_dict_of_a_touched_step(make_monitor, tmp_path, variant):
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    epoch_layout = variant == "epoch"
    opts = {"step_dir_template": EPOCH_TEMPLATE} if epoch_layout else {}
    epoch = 1 if epoch_layout else None
    monitor = make_monitor(root, max_state_dict_to_keep=None, **opts)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _save(coord, 2, {"model.bin": os.urandom(256)}, is_state_dict=False, epoch=epoch)
    sd_files = {"weights.bin": os.urandom((20 << 20) + 17 if variant == "large" else 4096),
                "meta.json": b'{"a": 1}', "sub/extra.bin": os.urandom(100)}
    _save(coord, 3, sd_files, is_state_dict=True, epoch=epoch)
    d3 = _step_dir(root, 3, epoch_layout)
    assert _trackers_verified(root, epoch_layout) == {CKPT: 2, SD: 3}

    # Job 1 goes on with step 3's full checkpoint: a unit writes part of its file, then is held.
    coord.register(3, checkpoint_thread_count=2)

    def partial():
        _write(d3, "ckpt.partial", os.urandom(128))
        if variant == "same-bytes":  # a committed file written again with the same bytes: intact
            _write(d3, "weights.bin", sd_files["weights.bin"])
        open(f"{gate}.waiting", "w").close()
        wait_for(lambda: os.path.exists(gate), timeout_s=DEADLINE_S, what="the gate")
        return [f"{d3}/ckpt.partial"]

    coord.save_async("held", partial, 3)
    wait_for(lambda: os.path.exists(f"{gate}.waiting"), timeout_s=DEADLINE_S, what="the held unit")
    assert "1/3" in ledger_records(root, 3)  # step 3 is "touched" by attempt 1: fix A looks at it
    committed_sd = read_manifest(root, 3, SD) if not epoch_layout else None
    before = _files(d3)

    monitor2 = start_new_job(make_monitor, root, monitor, max_state_dict_to_keep=None, **opts)
    wait_for(lambda: not busy_coroutines(monitor2), what="job 2's monitor's start-up")
    after = _files(d3)
    assert "ckpt.partial" not in after  # what job 1 left uncommitted goes ...
    for rel in (*sd_files, MANIFESTS[SD]):  # ... the committed state dict stays, byte for byte
        assert rel in after, f"job 2 removed {rel} of the intact committed state dict of step 3"
        assert after[rel] == before[rel], rel
    assert _trackers_verified(root, epoch_layout) == {CKPT: 2, SD: 3}
    if committed_sd is not None:
        assert read_manifest(root, 3, SD) == committed_sd

    # Job 1's held unit, released now, is fenced: it publishes nothing.
    open(gate, "w").close()
    assert wait_all(coord) is not None
    assert _trackers_verified(root, epoch_layout) == {CKPT: 2, SD: 3}

    # Job 2 saves into step 3: its full checkpoint holds the state dict's files, as committed.
    coord2 = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    _save(coord2, 3, {"optim.bin": os.urandom(512)}, is_state_dict=False, epoch=epoch)
    listed = set(ckptd.verify(root, 3).files)
    assert set(sd_files) | {"optim.bin"} <= listed, sorted(listed)
    assert _trackers_verified(root, epoch_layout) == {CKPT: 3, SD: 3}
    assert _kind_verifies(root, 3, CKPT, epoch_layout) == [] and _kind_verifies(root, 3, SD, epoch_layout) == []
    for rel, data in sd_files.items():
        assert open(f"{d3}/{rel}", "rb").read() == data
    coord.close()
    coord2.close()


# -- I4 against fixes B and C: a wrong report of an intact committed file --------------------------


@ray.remote(num_cpus=0, max_restarts=0)
class _Liar:
    """A worker process whose checkpoint unit of a step reports a file of the step's committed
    state dict without touching it: right size, wrong CRC-32 (a WrittenFile the monitor trusts)."""

    def __init__(self, run: str, worker_id: str) -> None:
        monitor = ckptd.get_monitor(run)
        self.root = ray.get(monitor.worker_config.remote())["root"]
        self.coord = ckptd.CheckpointCoordinator(monitor, worker_id=worker_id)

    def lie(self, step: int, rel: str, gate: str | None = None) -> None:
        path = f"{ckptd.step_dir(self.root, step)}/{rel}"

        def save_fn():
            if gate is not None:
                open(f"{gate}.waiting", "w").close()
                wait_for(lambda: os.path.exists(gate), timeout_s=DEADLINE_S, what="the gate")
            return [ckptd.WrittenFile(path=path, size=os.path.getsize(path), crc32="0badc0de")]

        self.coord.save_async(f"lie-{rel}", save_fn, step)

    def wait_all(self) -> str | None:
        return wait_all(self.coord)


@pytest.mark.parametrize("when", ["live", "new-job-live", "restart", "new-job-restart"])
def test_i4_a_wrong_report_of_an_intact_committed_file_keeps_the_state_dict(make_monitor, tmp_path, run_name,
                                                                              when):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _save(coord, 2, {"model.bin": os.urandom(256)}, is_state_dict=False, epoch=None)
    _save(coord, 3, {"weights.bin": os.urandom(4096)}, is_state_dict=True, epoch=None)
    sd_manifest = read_manifest(root, 3, SD)
    if when.startswith("new-job"):  # the state dict is the older attempt's: none of its units is in this job
        coord.close()
        monitor = start_new_job(make_monitor, root, monitor)
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
        assert read_manifest(root, 3, SD) == sd_manifest
    coord.register(3, checkpoint_thread_count=1)
    liar = _Liar.remote(run_name, "w1")
    if when.endswith("live"):
        ray.get(liar.lie.remote(3, "weights.bin"))
        err = ray.get(liar.wait_all.remote())
        assert err is not None and "report is wrong" in err, err
    else:
        gate = str(tmp_path / "gate")
        ray.get(liar.lie.remote(3, "weights.bin", gate))
        end_unheard(monitor, root, 3, "w1", gate, liar, "finished", method="wait_all", timeout_s=DEADLINE_S)
    wait_for(lambda: not busy_coroutines(monitor), what="the monitor to settle step 3")
    # I4: the intact state dict is not withdrawn.
    assert read_manifest(root, 3, SD) == sd_manifest
    # I1: whatever step 3's checkpoint did, no tracker names a manifest that does not verify.
    if read_manifest(root, 3, CKPT) is not None:
        ckptd.verify(root, 3)
        # ckptd.verify lets the state dict's entry of a file mask the checkpoint's: check the
        # checkpoint manifest on its own, as a reader of it alone (once the state dict's manifest
        # is retired) would.
        assert _kind_verifies(root, 3, CKPT, epoch_layout=False) == []
    assert assert_trackers_verified(root)[SD] == 3
    # I4: step 3's full checkpoint, whose one unit reported wrongly, fails (as it does live).
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, timeout_s=DEADLINE_S)
    coord.close()


# -- I1 against fix A: the only committed step withdrawn, and its tracker with it ------------------


def test_i1_a_new_job_withdraws_the_only_state_dict_and_removes_its_tracker(make_monitor, tmp_path):
    """Job 1's one commit is step 1's state dict; a checkpoint unit of step 1 replaces a listed
    file with other bytes of the same size and is still running when job 2 starts. Nothing else
    is committed: the state dict goes, and so must the tracker naming it (no step to point at)."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _save(coord, 1, {"weights.bin": os.urandom(4096), "meta.json": b"{}"}, is_state_dict=True, epoch=None)
    assert assert_trackers_verified(root) == {CKPT: None, SD: 1}
    coord.register(1, checkpoint_thread_count=1)
    d1 = ckptd.step_dir(root, 1)

    def replace_and_hold():
        _write(d1, "weights.bin", os.urandom(4096))
        open(f"{gate}.waiting", "w").close()
        wait_for(lambda: os.path.exists(gate), timeout_s=DEADLINE_S, what="the gate")
        return [f"{d1}/weights.bin"]

    coord.save_async("replace", replace_and_hold, 1)
    wait_for(lambda: os.path.exists(f"{gate}.waiting"), timeout_s=DEADLINE_S, what="the held unit")
    assert _kind_verifies(root, 1, SD, epoch_layout=False) == ["weights.bin"]
    monitor2 = start_new_job(make_monitor, root, monitor)
    wait_for(lambda: not busy_coroutines(monitor2), what="job 2's monitor's start-up")
    assert read_manifest(root, 1, SD) is None
    assert not os.path.exists(d1)
    assert _trackers(root) == {CKPT: None, SD: None}
    open(gate, "w").close()
    assert wait_all(coord) is not None
    assert read_manifest(root, 1, SD) is None and read_manifest(root, 1, CKPT) is None  # I3
    assert _trackers(root) == {CKPT: None, SD: None}
    coord.close()
