"""The main job: `python -m ckptd demo` on a fresh local Ray instance."""

from __future__ import annotations

import os
import subprocess
import sys

import ckptd


def test_demo_runs_and_leaves_a_readable_checkpoint(tmp_path):
    root = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptd", "demo", "--root", str(root), "--steps", "7", "--ckpt-every", "3"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "committed full checkpoints: 2" in proc.stdout
    assert "training blocked per save" in proc.stdout
    assert ckptd.latest_step(str(root)) == 6
    assert ckptd.latest_step(str(root), "state_dict") == 7
    assert sorted(os.listdir(root / "global_step_6")) == [
        "ckptd_manifest.json", "ckptd_state_dict_manifest.json",
        "model_rank0.safetensors", "model_rank1.safetensors", "optim_rank0.pt", "optim_rank1.pt",
    ]
