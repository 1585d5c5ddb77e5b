"""The bench harness gives every method the same file lifecycle: each keeps its last two saves,
as ckptd's retention keeps two steps, and the next save is timed only once that clean-up ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ray

from bench.common import make_state
from bench.saves import KEEP, SaveHarness

from .helpers import REPO


def test_each_method_keeps_its_last_saves_and_settle_outlasts_ckptds_retention(ray_local, tmp_path):
    h = SaveHarness(str(tmp_path), "harness-test")
    try:
        sd = make_state(1 << 20, tensors=2)
        for n in range(1, 5):
            path = h.new_dir("st")
            assert path.endswith(f"st-{n}") and not os.path.exists(path)  # a new directory every save
            os.makedirs(path)
            with open(f"{path}/model.bin", "wb") as f:
                f.write(b"x" * 4096)
            h.retire("st")
            step = h.ckptd_save(sd, "p2")
            h.settle()
            kept = sorted(d for d in os.listdir(h.dir) if d.startswith("st-"))
            assert kept == [f"st-{i}" for i in range(max(1, n - KEEP + 1), n + 1)], (n, kept)
            # The monitor's retention pass has ended: exactly the last KEEP steps are left.
            present = [s for s in range(1, step + 1) if os.path.exists(h.coord.step_dir(s))]
            assert present == list(range(max(1, step - KEEP + 1), step + 1)), (step, present)
    finally:
        h.close()


def test_after_save_splits_a_checkpoints_cost_by_the_step_it_lands_in(ray_local, tmp_path):
    """``python -m bench.after_save`` (tiny sizes): per writer, one extra time per step after the
    save call, printed as step 0, groups of steps and the total."""
    out = tmp_path / "after.json"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, "-m", "bench.after_save", "--checkpoints", "2", "--every", "12",
                           "--py-ops", "50", "--model-mib", "2", "--dir", str(tmp_path), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["writer"] for r in results] == ["thread", "process"]
    for r in results:
        assert r["base_s"] > 0 and len(r["extra_s"]) == 12 and r["checkpoints"] == 2
    assert "| writer | baseline step | step 0 | steps 1-9 | steps 10-11 | all steps |" in proc.stdout
    assert "| process |" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.after_save", "--writers", "fork"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--writers takes thread and/or process" in bad.stderr
