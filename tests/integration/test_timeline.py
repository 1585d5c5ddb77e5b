"""``ckptd timeline`` on a real run: a real local Ray, a real monitor (a Ray actor) with a mirror
(a local directory), and two training workers, each with its own CheckpointCoordinator, driven
from two threads of the driver (actors would cost seconds of process start-up on a loaded
machine, and nothing here depends on the process). Each stages a fenced checkpoint, saves a
training state and waits at the fence, as a training loop does. The picture is drawn from the
live monitor (once through the CLI in its own process, as a user would) and from the events
persisted under the root after the monitor is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

import ckptd
from ckptd.cli import main as cli_main
from ckptd.monitor.events import BLOCKED, COMMIT, MIRROR, UNIT
from ckptd.timeline import build_layout, render, spans_of_root, spans_of_run
from tests.integration.helpers import restart_monitor

STEPS = 4
WORKERS = 2


class Trainer:
    """A training worker: per step, a fenced staged save of its shard, a training-state save, a
    forward/backward stand-in, then the fence before the optimizer step."""

    def __init__(self, run: str, rank: int) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id=f"rank{rank}")
        self.state = {"w": torch.randn(256, 256), "b": torch.randn(256)}

    def step(self, step: int) -> None:
        from safetensors.torch import save_file

        out = self.coord.step_dir(step)

        def write_shard(sd: dict) -> list[str]:
            os.makedirs(out, exist_ok=True)
            path = f"{out}/shard_rank{self.rank}.safetensors"
            save_file(sd, path)
            return [path]

        def write_train_state() -> list[str]:
            os.makedirs(out, exist_ok=True)
            path = f"{out}/train_state_rank{self.rank}.json"
            with open(path, "w") as f:
                json.dump({"step": step, "rank": self.rank}, f)
            return [path]

        self.coord.save_state_async("shards", self.state, step, write_shard, fenced=True)
        self.coord.save_async("train_state", write_train_state, step)
        x = torch.randn(64, 256)
        for _ in range(3):  # forward and backward stand-in, overlapping the staging copy
            x = torch.tanh(x @ self.state["w"])
        self.coord.before_update()
        self.state["w"].add_(0.01)  # the optimizer step

    def wait_all(self) -> None:
        self.coord.wait_all()


@pytest.fixture(scope="module")
def finished_run(ray_local, tmp_path_factory):
    """A run of STEPS steps on WORKERS workers, committed and mirrored; the monitor still live."""
    base = tmp_path_factory.mktemp("timeline")
    root, mirror = str(base / "ckpt"), str(base / "mirror")
    run = f"timeline-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run, mirror=mirror, max_ckpt_to_keep=None, timeline_flush_s=0.2)
    workers = [Trainer(run, r) for r in range(WORKERS)]
    driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
    with ThreadPoolExecutor(WORKERS) as pool:
        for step in range(1, STEPS + 1):
            driver.register(step, checkpoint_thread_count=2 * WORKERS)
            list(pool.map(lambda w, step=step: w.step(step), workers))
        list(pool.map(lambda w: w.wait_all(), workers))  # sends the last fence's timing
    driver.wait_committed(STEPS, timeout_s=60)
    driver.wait_mirrored(STEPS, timeout_s=60)
    yield {"root": root, "run": run, "monitor": monitor, "base": base}
    for w in workers:
        w.coord.close()
    ray.kill(monitor, no_restart=True)


def _wait_for_spans(monitor, done) -> list:
    """The monitor's spans, once ``done(spans)`` holds (the last timing is fire-and-forget)."""
    deadline = time.monotonic() + 30
    while True:
        run, spans = spans_of_run(monitor)
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def _complete(spans) -> bool:
    fences = {(s.worker, s.step) for s in spans if s.lane == BLOCKED and s.name == "before_update (fence)"}
    return len(fences) == WORKERS * STEPS and len([s for s in spans if s.lane == MIRROR and s.ok]) >= STEPS


def _check_layout(layout) -> None:
    steps = list(range(1, STEPS + 1))
    keys = [r.key for r in layout.rows]
    expected = []
    for r in range(WORKERS):
        expected += [f"unit:rank{r}:shards", f"unit:rank{r}:train_state", f"blocked:rank{r}"]
    assert keys == expected + ["commit", "mirror"]
    for r in range(WORKERS):
        for name in ("shards", "train_state"):
            bars = layout.row(f"unit:rank{r}:{name}").bars
            assert [b.step for b in bars] == steps
            assert all(b.color == "checkpoint" and b.start <= b.ready <= b.end for b in bars)
        blocked = layout.row(f"blocked:rank{r}").bars
        # Per step: the staging call, the save_async call and the fence.
        assert sorted(b.step for b in blocked) == sorted(steps * 3)
        assert all(b.end >= b.start >= 0 for b in blocked)
    commits = layout.row("commit").bars
    assert [b.step for b in commits] == steps and all(b.color == "commit" for b in commits)
    uploads = layout.row("mirror").bars
    assert [b.step for b in uploads] == steps and all(b.color == "mirror" for b in uploads)
    for step in steps:
        unit_end = max(b.end for r in layout.rows if r.lane == UNIT for b in r.bars if b.step == step)
        commit = next(b for b in commits if b.step == step)
        upload = next(b for b in uploads if b.step == step)
        # Times come from where things happened: the commit follows the step's last unit (whose
        # receipt was written before it told the monitor), the upload follows the commit.
        assert commit.start >= unit_end
        assert upload.start >= commit.end - 1e-3
    assert [m.step for m in layout.steps] == steps
    assert 0 < layout.duration < 300  # every time is this run's wall clock, none a stray 0
    assert all(m.committed is not None for m in layout.steps)
    assert [(t.step, t.kinds, t.units, t.failed) for t in layout.table] == [(s, "checkpoint", 4, 0) for s in steps]
    assert all(set(t.blocked_ms) == {"rank0", "rank1"} for t in layout.table)


def _check_png(path: str) -> None:
    from PIL import Image

    with Image.open(path) as img:
        assert img.format == "PNG"
        width, height = img.size
        assert 1200 <= width <= 2000 and 400 <= height <= 1400
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20  # drawn, not blank


def _check_html(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        page = f.read()
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for r in range(WORKERS):
        for name in ("shards", "train_state"):
            assert page.count(f'data-row="unit:rank{r}:{name}"') == 1
            for step in range(1, STEPS + 1):
                assert f"<title>step {step}: rank{r}/{name} (checkpoint)" in page
    assert page.count('data-kind="commit"') == STEPS and page.count('data-kind="mirror"') == STEPS
    assert page.count("<tr data-step=") == STEPS


def test_live_run_drawn_through_the_cli(finished_run, tmp_path):
    spans = _wait_for_spans(finished_run["monitor"], _complete)
    _check_layout(build_layout(spans, finished_run["run"]))
    png, html = str(tmp_path / "live.png"), str(tmp_path / "live.html")
    _check_layout(render(spans, png, finished_run["run"]))
    _check_png(png)
    # The CLI, as a user runs it against the live cluster (HTML: no matplotlib import to wait for).
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "ckptd", "timeline", finished_run["run"], "--out", html,
                           "--address", address], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"{STEPS} steps, {WORKERS * 2 * STEPS} units" in proc.stdout
    _check_html(html)


def test_a_crashed_monitor_comes_back_with_the_history_it_flushed(finished_run):
    monitor = finished_run["monitor"]
    before = _wait_for_spans(monitor, _complete)
    assert ray.get(monitor.timeline.remote(flush=True))["flushed"] is True
    restart_monitor(monitor, how="SIGKILL")
    run, after = spans_of_run(monitor)
    assert run == finished_run["run"]
    assert sorted(after, key=repr) == sorted(before, key=repr)


def test_finished_run_drawn_from_the_root(finished_run, tmp_path):
    monitor = finished_run["monitor"]
    live = _wait_for_spans(monitor, _complete)
    assert ray.get(monitor.timeline.remote(flush=True))["flushed"] is True
    ray.kill(monitor, no_restart=True)
    run, persisted = spans_of_root(finished_run["root"])
    assert run == finished_run["run"]
    assert sorted(persisted, key=repr) == sorted(live, key=repr)
    png, html = str(tmp_path / "done.png"), str(tmp_path / "done.html")
    assert cli_main(["timeline", finished_run["root"], "--out", png]) == 0
    assert cli_main(["timeline", finished_run["root"], "--out", html, "--run", run]) == 0
    _check_layout(render(persisted, str(tmp_path / "again.png"), run))
    _check_png(png)
    _check_html(html)
    assert cli_main(["timeline", finished_run["root"], "--out", html, "--run", "nope"]) == 1


def test_events_persist_on_an_object_store(s3_root):
    """Chunks and snapshots on a real S3-protocol server: no append, no rename needed."""
    from ckptd.monitor.event_store import EventStore, read_events
    from ckptd.monitor.events import EventLog, Span
    from ckptd.storage import Storage

    url, options = s3_root
    storage = Storage(url, options)
    log, store = EventLog(max_steps=4), EventStore(storage, "s3-run", max_chunks=2)
    for step in range(1, 7):
        log.add([Span(UNIT, step, 100.0 + step, 100.5 + step, worker="rank0", name="model", kind="checkpoint"),
                 Span(COMMIT, step, 101.0 + step, 101.1 + step, name="checkpoint")])
        store.write(log.take_unflushed(), log.spans())
    # Two chunks, a snapshot (superseding them), two chunks, a snapshot: steps 3-6 are kept.
    assert [s.step for s in read_events(storage, "s3-run")] == [3, 3, 4, 4, 5, 5, 6, 6]
    run, spans = spans_of_root(url, storage_options=options)
    assert run == "s3-run" and spans == log.spans()
