"""Commit-path invariants, attacked through session 14's monitor changes (the commit check's single
pass over reported files, the event log's amendment index) with a real monitor, real files and
real restarts.

1. A tracker only ever names a step that ``ckptd.verify`` accepts.
2. A step reported failed never commits, also after a monitor restart or a new job.
4. Duplicated and retried reports never make a commit accept a file that does not match storage.
5. Timing (spans, amendments) never makes a save or commit fail, and the timeline the monitor
   serves, what it persisted and what it serves after a restart agree.
"""

from __future__ import annotations

import os
import threading
import zlib

import pytest
import ray
import torch

import ckptd
from ckptd.layout import MANIFESTS
from ckptd.manifest import Manifest
from ckptd.monitor.event_store import read_events
from ckptd.storage import Storage

from .helpers import assert_trackers_verified, restart_monitor, status, wait_for

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _manifest(root: str, step: int) -> Manifest | None:
    path = os.path.join(ckptd.step_dir(root, step), MANIFESTS[CKPT])
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return Manifest.model_validate_json(f.read())


def _unit(name: str, step: int, call: str, worker: str = "raw") -> dict:
    return {"worker": worker, "name": name, "step": step, "kind": "checkpoint", "call": call}


def _entry(rel: str, data: bytes, mtime_ns: int) -> dict:
    return {"path": rel, "size": len(data), "crc32": f"{zlib.crc32(data):08x}", "mtime_ns": mtime_ns}


def test_a_stale_duplicate_report_arriving_last_never_reaches_the_manifest(make_monitor, tmp_path):
    """Two units report one file with the same size and mtime (rewritten within one clock tick)
    but other CRC-32s; the unit with the stale report started last. The monitor commits the
    report that matches storage (it kept the last unit's: the tracker named a step verify rejects)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(1, checkpoint_thread_count=2)
    path = os.path.join(coord.step_dir(1), "shared.bin")
    os.makedirs(os.path.dirname(path))
    old, new = b"o" * 256, b"n" * 256
    with open(path, "wb") as f:
        f.write(old)
    mtime = os.stat(path).st_mtime_ns
    with open(path, "wb") as f:
        f.write(new)
    os.utime(path, ns=(mtime, mtime))  # what a rewrite within the kernel's clock tick leaves
    a, b = _unit("a", 1, "c1"), _unit("b", 1, "c2")
    answers = ray.get(monitor.notify_batch.remote([
        ("started", b, None), ("started", a, None),
        ("finished", b, {"files": [_entry("shared.bin", new, mtime)], "found": True}),
        ("finished", a, {"files": [_entry("shared.bin", old, mtime)], "found": False}),
    ]))
    assert answers == [{"admitted": True}, {"admitted": True}, None, None]
    coord.wait_committed(1, timeout_s=30)
    assert [(f.path, f.crc32) for f in _manifest(root, 1).files] == [("shared.bin", f"{zlib.crc32(new):08x}")]
    assert assert_trackers_verified(root)[CKPT] == 1
    coord.close()


def test_paths_returned_with_dot_or_double_slash_commit_and_verify(make_monitor, tmp_path):
    """A save function returns "./model.pt" and "<step_dir>//sub/optim.pt": real files of the
    step. The step commits listing them by their names on storage (it failed: "missing from
    storage")."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(2)

    def save() -> list[str]:
        os.makedirs(os.path.join(out, "sub"), exist_ok=True)
        torch.save({"w": torch.ones(3)}, os.path.join(out, "model.pt"))
        torch.save({"m": torch.zeros(3)}, os.path.join(out, "sub", "optim.pt"))
        return ["./model.pt", out + "//sub/optim.pt"]

    coord.register(2, checkpoint_thread_count=1)
    coord.save_async("model", save, 2)
    coord.wait_committed(2, timeout_s=30)
    assert sorted(f.path for f in _manifest(root, 2).files) == ["model.pt", "sub/optim.pt"]
    assert assert_trackers_verified(root)[CKPT] == 2
    coord.close()



def test_a_state_dict_file_also_found_by_a_checkpoint_unit_stays_in_the_state_dict_manifest(make_monitor, tmp_path):
    """Trinity's full checkpoint beside its state dict: the state-dict unit names its weights file;
    a checkpoint unit whose save_fn returns None ran while the weights were written and finds
    them too. The state dict's manifest must list the weights (it listed nothing: the later
    unit's report won), and both trackers name step 8."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(8)
    os.makedirs(out)
    coord.register(8, is_state_dict=True, state_dict_thread_count=1)
    coord.register(8, checkpoint_thread_count=1)
    running, written, reported = threading.Event(), threading.Event(), threading.Event()

    def weights() -> list[str]:
        assert running.wait(60), "the checkpoint unit never ran"
        torch.save({"w": torch.ones(4)}, f"{out}/model.pt")  # while the checkpoint unit runs
        written.set()
        assert reported.wait(60), "the checkpoint unit never reported"
        return [f"{out}/model.pt"]

    def optimizer() -> None:
        running.set()
        assert written.wait(60), "the weights were never written"
        torch.save({"m": torch.zeros(4)}, f"{out}/optim.pt")

    coord.save_async("weights", weights, 8, is_state_dict=True)
    wait_for(lambda: len(status(monitor).step(8, SD).started) == 1, what="the state-dict unit's admission")
    coord.save_async("optim", optimizer, 8)
    wait_for(lambda: len(status(monitor).step(8).finished) == 1, what="the checkpoint unit's report")
    reported.set()
    coord.wait_committed(8, timeout_s=30)
    coord.close()
    path = os.path.join(out, MANIFESTS[SD])
    with open(path) as f:
        sd_files = [e.path for e in Manifest.model_validate_json(f.read()).files]
    assert sd_files == ["model.pt"]
    assert sorted(e.path for e in _manifest(root, 8).files) == ["model.pt", "optim.pt"]
    assert assert_trackers_verified(root) == {SD: 8, CKPT: 8}


def _timing(units=(), amended=()) -> tuple:
    return ("timing", None, {"timing": {"units": list(units), "blocked": [], "amended": list(amended)}})


def test_timeline_amendments_late_trimmed_duplicated_and_after_a_restart(make_monitor, tmp_path, run_name):
    """Amendments that arrive after their step committed, after it left the log (timeline_steps),
    twice, for units the log never saw, and after a restart; a unit span delivered twice (a
    retried notification). Commits go on; the monitor's timeline, the events on storage and the
    timeline after a restart agree, one record per span, amendments included."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, timeline_steps=3, timeline_flush_s=60)  # flushed by the test only
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in range(1, 6):
        out = coord.step_dir(step)
        os.makedirs(out)
        coord.register(step, checkpoint_thread_count=1)
        coord.save_async("model", lambda o=out: torch.save({"w": torch.ones(2)}, f"{o}/model.pt"), step)
        coord.wait_committed(step, timeout_s=30)
    coord.wait_all()  # what the outbox still held (the last unit's notification time) goes too

    live = ray.get(monitor.timeline.remote(flush=True))
    assert live["flushed"] is True
    assert sorted({s["step"] for s in live["spans"]}) == [3, 4, 5]
    real = next(s for s in live["spans"] if s["lane"] == "unit" and s["step"] == 5)
    u5 = _unit("model", 5, "x", worker="w0")
    ghost = _unit("ghost", 5, "g1", worker="nobody")
    raw = _unit("raw", 5, "r1")
    raw_span = {"unit": raw, "start": 100.0, "admitted": 100.5, "end": 101.0, "error": None,
                "phases": {"write": 0.25}}
    answers = ray.get(monitor.notify_batch.remote([
        _timing(amended=[{"unit": _unit("model", 1, "x", worker="w0"), "start": 1.0, "phases": {"x": 1.0}}]),
        _timing(amended=[{"unit": ghost, "start": real["start"], "phases": {"receipt": 9.0}}]),
        _timing(amended=[{"unit": u5, "start": real["start"], "phases": {"receipt": 0.5}}] * 2),
        _timing(amended=[{"unit": u5, "start": real["start"], "phases": {"late": 0.75}}]),
        _timing(units=[raw_span]),
        _timing(units=[raw_span]),  # the same payload again: Ray retried the call
        _timing(amended=[{"unit": raw, "start": 100.0, "phases": {"notification": 0.125}}]),
    ]))
    assert answers == [None] * 7

    def by_identity(spans) -> dict[tuple, list[dict]]:
        out: dict[tuple, list[dict]] = {}
        for s in spans:
            out.setdefault((s["lane"], s.get("worker"), s.get("name", ""), s["step"], s["start"]), []).append(s)
        return out

    live = ray.get(monitor.timeline.remote(flush=True))
    assert live["flushed"] is True
    served = by_identity(live["spans"])
    assert all(len(records) == 1 for records in served.values()), [r for r in served.values() if len(r) > 1]
    amended = served[("unit", "w0", "model", 5, real["start"])][0]
    assert {"receipt": 0.5, "late": 0.75}.items() <= amended["phases"].items()
    assert served[("unit", "raw", "raw", 5, 100.0)][0]["phases"] == {"write": 0.25, "notification": 0.125}
    assert not any(s.get("worker") == "nobody" for s in live["spans"])

    persisted = {s.identity: s.to_dict() for s in read_events(Storage(root), run_name)}
    assert persisted == {k: v[0] for k, v in served.items()}

    restart_monitor(monitor)
    back = ray.get(monitor.timeline.remote())
    assert by_identity(back["spans"]) == served
    # A reloaded span amended again is persisted again.
    ray.get(monitor.notify_batch.remote([
        _timing(amended=[{"unit": raw, "start": 100.0, "phases": {"receipt": 0.0625}}])]))
    assert ray.get(monitor.timeline.remote(flush=True))["flushed"] is True
    again = {s.identity: s for s in read_events(Storage(root), run_name)}
    assert again[("unit", "raw", "raw", 5, 100.0)].phases == {"write": 0.25, "notification": 0.125, "receipt": 0.0625}

    out = coord.step_dir(6)
    os.makedirs(out)
    coord.register(6, checkpoint_thread_count=1)
    coord.save_async("model", lambda: torch.save({"w": torch.ones(2)}, f"{out}/model.pt"), 6)
    coord.wait_committed(6, timeout_s=30)
    coord.close()
    assert status(monitor).step(6).state.value == "committed"
    assert assert_trackers_verified(root)[CKPT] == 6


def _failpoint_in(monitor, action: str | None) -> None:
    def set_it(_self):
        from ckptd import failpoints
        if action is None:
            failpoints.disarm("before_failure_record")
        else:
            failpoints.arm("before_failure_record", action)
    ray.get(monitor.__ray_call__.remote(set_it))


def test_a_failure_is_reported_only_once_recorded_and_then_survives_a_restart(make_monitor, tmp_path):
    """The commit check fails a step (a reported file changed size before the commit) while the
    failure record cannot be written (storage refuses it). Nobody may be told the step failed
    until the record is written, since a monitor restarted before then would rebuild the step from
    its units' receipts and commit it. Once recorded, the failure is reported, and it survives a
    restart even after the file is put back."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    _failpoint_in(monitor, "raise")
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(7)
    os.makedirs(out)
    coord.register(7, checkpoint_thread_count=2)
    path = os.path.join(out, "a.bin")
    original = b"a" * 100
    with open(path, "wb") as f:
        f.write(original)
    coord.save_sync(lambda: [path], 7)
    with open(path, "ab") as f:  # changed after its unit reported it
        f.write(b"more")
    coord.save_sync(lambda: [], 7)  # the second unit: the commit runs, and its check fails
    wait_for(lambda: status(monitor).step(7).state.value == "failed", what="step 7 failed in memory")
    with pytest.raises(TimeoutError):  # failed in memory, but not recorded: nobody is told yet
        coord.wait_committed(7, timeout_s=1.5)
    _failpoint_in(monitor, None)  # storage takes the record at the next retry
    with pytest.raises(ckptd.CheckpointSaveError, match="commit failed"):
        coord.wait_committed(7, timeout_s=30)
    with open(path, "wb") as f:
        f.write(original)
    restart_monitor(monitor)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(7, timeout_s=30)
    coord.close()
    assert _manifest(root, 7) is None
    assert ckptd.latest_step(root) is None
