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
        [sys.executable, "-m", "ckptd", "demo", "--root", str(root), "--steps", "9", "--ckpt-every", "3"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "training blocked per save" in proc.stdout
    assert "weights equal rank 0's: yes" in proc.stdout
    assert ckptd.latest_step(str(root)) == 9
    # Retention kept the 2 newest full checkpoints (6, 9) and 2 newest state dicts (8, 9).
    assert sorted(p for p in os.listdir(root) if p.startswith("global_step_")) == [
        "global_step_6", "global_step_8", "global_step_9"]
    assert sorted(os.listdir(root / "global_step_9" / "model")) == [
        "shard-00000.safetensors", "shard-00001.safetensors", "sharded_metadata.json"]
    assert ckptd.verify(str(root)).step == 9


def test_rl_demo_rollouts_follow_the_trainer_and_serve_its_weights(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptd", "demo", "--rl", "--root", str(tmp_path / "rl"), "--steps", "6",
         "--ckpt-every", "3"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "commit -> rollout notified:   median" in proc.stdout
    assert "serving at the end:           {'rollout-0': 6, 'rollout-1': 6}; newest state dict 6" in proc.stdout
    assert "rollout weights equal the trainer's: yes" in proc.stdout
