"""The operator's commands on a real run: ``status`` from a live monitor, ``gc`` on a root whose
job is gone, and the progress bar of the long commands on a terminal."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch

import ckptd
from ckptd.cli import main
from ckptd.layout import scan_steps
from ckptd.storage import Storage
from ckptd.verify import verify

from .helpers import actor_gone, wait_for


def cli(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ckptd", *argv], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_status_shows_steps_in_flight_failures_writers_and_the_mirror(make_monitor, tmp_path, run_name):
    monitor = make_monitor(str(tmp_path / "ckpt"), mirror=str(tmp_path / "mirror"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    release = threading.Event()

    def write(step: int, block: bool = False):
        def fn():
            os.makedirs(coord.step_dir(step), exist_ok=True)
            torch.save({"w": torch.ones(4) * step}, os.path.join(coord.step_dir(step), "model.pt"))
            if block:
                release.wait(60)
        return fn

    coord.register(1, checkpoint_thread_count=1)
    coord.save_async("model", write(1), 1)
    coord.wait_committed(1, timeout_s=30)
    ray.get(monitor.wait_mirrored.remote(1, 30))
    coord.register(2, checkpoint_thread_count=1)  # before the failure: a late registration is refused
    coord.save_async("model", lambda: (_ for _ in ()).throw(OSError("disk on fire")), 2)
    coord.register(3, checkpoint_thread_count=2)
    coord.save_async("model", write(3), 3)
    coord.save_async("optim", write(3, block=True), 3)
    deadline = time.monotonic() + 30
    while True:  # until the monitor has seen the failure and both units of step 3
        st = ray.get(monitor.status.remote())
        s2, s3 = st.step(2), st.step(3)
        if s2 and s2.state.value == "failed" and s3 and len(s3.started) == 2 and len(s3.finished) == 1:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    address = ray.get_runtime_context().gcs_address
    try:
        shown = json.loads(cli("status", run_name, "--address", address, "--json").stdout)
        assert shown["trackers"]["checkpoint"] == 1
        in_flight = next(s for s in shown["steps"] if s["step"] == 3)
        assert (in_flight["expected"], len(in_flight["started"]), len(in_flight["finished"])) == (2, 2, 1)
        assert shown["mirror"]["trackers"]["checkpoint"] == 1

        text = cli("status", run_name, "--address", address).stdout
        assert f"run {run_name}" in text and "latest checkpoint 1" in text
        flight = text[text.index("steps in flight"):]
        row = next(line.split() for line in flight.splitlines() if line.split()[:1] == ["3"])
        assert row[:7] == ["3", "checkpoint", "pending", "2", "2", "1", "0"], row
        failed = text[text.index("failed steps"):]
        assert "OSError: disk on fire" in failed and "w0/model" in failed
        assert "writer slots (unrestricted): " in text
        assert "mirror " in text and "lag 0 steps" in text  # step 1 mirrored, nothing newer committed

        # The commands that change a root ask the cluster first: this root's monitor is live.
        for argv in (("retire", "--after", "0", "--yes"), ("gc", "--min-idle", "0")):
            refused = cli(argv[0], str(tmp_path / "ckpt"), *argv[1:], "--address", address, check=False)
            assert refused.returncode == 1 and "is live" in refused.stderr, refused.stderr
        assert ckptd.latest_step(str(tmp_path / "ckpt")) == 1

        missing = cli("status", "no-such-run", "--address", address, check=False)
        assert missing.returncode == 1 and "no-such-run" in missing.stderr
    finally:
        release.set()
    with pytest.raises(ckptd.CheckpointSaveError, match="disk on fire"):
        coord.close()


def commit(coord, step: int, state_dict: bool = False) -> None:
    kw = {"state_dict_thread_count": 1} if state_dict else {"checkpoint_thread_count": 1}
    coord.register(step, is_state_dict=state_dict, **kw)
    out = coord.step_dir(step)
    os.makedirs(out, exist_ok=True)
    coord.save_async("model", lambda: torch.save({"w": torch.ones(4)}, os.path.join(out, "model.pt")), step,
                     is_state_dict=state_dict)
    coord.wait_committed(step, is_state_dict=state_dict, timeout_s=30)


def test_gc_removes_leftovers_of_a_dead_job_and_never_what_is_committed(make_monitor, tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2, 3):
        commit(coord, step)
    commit(coord, 4, state_dict=True)
    # The job dies while saving: step 5 half-written (no manifest), the checkpoint half of step 4
    # written next to its committed state dict, and a temp file of an atomic write in step 3.
    coord.register(5, checkpoint_thread_count=1)
    step5 = coord.step_dir(5)
    os.makedirs(step5)
    with open(os.path.join(step5, "model.pt"), "wb") as f:
        f.write(b"x" * 1000)
    with open(os.path.join(coord.step_dir(4), "optim.pt"), "wb") as f:
        f.write(b"y" * 500)
    stray_tmp = os.path.join(coord.step_dir(3), ".ckptd-tmp-model.pt-0123456789ab")
    with open(stray_tmp, "wb") as f:
        f.write(b"z" * 10)

    def gc(*argv: str) -> tuple[int, str, str]:  # in this driver: gc asks its Ray cluster for live monitors
        code = main(["gc", root, *argv])
        out = capsys.readouterr()
        # Ray's driver log lines share this process's stdout (a timing post the killed monitor never
        # answered is reported there, before or after): keep the command's JSON document alone.
        text = out.out
        start = 0 if text.startswith("{") else text.find("\n{") + 1
        if start or text.startswith("{"):
            doc, end = json.JSONDecoder().raw_decode(text, start)
            text = text[start:end]
        return code, text, out.err

    code, _, err = gc("--min-idle", "0")
    assert code == 1 and "is live" in err and "stop it" in err
    assert os.path.exists(step5)

    coord.close()
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="the killed monitor to be gone")  # ray.kill returns before
    recent = json.loads(gc("--dry-run", "--json")[1])
    assert recent["would_remove"] == [] and len(recent["not_idle_yet"]) == 3  # all just written

    dry = json.loads(gc("--dry-run", "--min-idle", "0", "--json")[1])
    planned = {g["path"]: g for g in dry["would_remove"]}
    name5, name4, name3 = (os.path.basename(coord.step_dir(s)) for s in (5, 4, 3))
    assert {name5, f"{name4}/optim.pt", f"{name3}/.ckptd-tmp-model.pt-0123456789ab"} <= set(planned)
    assert planned[name5]["bytes"] == 1000 and not any(g["committed"] for g in dry["would_remove"])
    assert os.path.exists(step5) and os.path.exists(stray_tmp)  # a dry run changes nothing

    text = gc("--min-idle", "0")[1]
    assert f"removed: {name5}" in text and "no manifest" in text
    assert not os.path.exists(step5) and not os.path.exists(stray_tmp)
    assert not os.path.exists(os.path.join(coord.step_dir(4), "optim.pt"))
    for step in (1, 2, 3, 4):
        verify(root, step)  # every committed step still whole
    assert sorted(scan_steps(Storage(root))) == [1, 2, 3, 4]

    # Committed steps go only under an explicit policy; the tracker targets (3 and 4) stay.
    code, _, err = gc("--keep-every", "2")
    assert code == 2 and "--keep-checkpoints" in err
    kept = gc("--min-idle", "0", "--keep-checkpoints", "1", "--keep-state-dicts", "1")[1]
    assert "past the retention policy" in kept
    assert sorted(scan_steps(Storage(root))) == [3, 4]
    verify(root, 3)
    verify(root, 4)
    assert ckptd.latest_step(root) == 3


def test_verify_draws_a_progress_bar_on_a_terminal_only(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0")
    commit(coord, 1)
    coord.close()
    piped = cli("verify", root)
    assert "step 1: 1 files match" in piped.stdout and "checking" not in piped.stderr
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "verify", root], stdout=subprocess.PIPE,
                            stderr=secondary, text=True)
    os.close(secondary)
    drawn = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the other end closed: the process exited
            break
        if not chunk:
            break
        drawn += chunk
    assert proc.wait(60) == 0 and "files match" in proc.stdout.read()
    os.close(primary)
    assert b"checking step 1" in drawn
