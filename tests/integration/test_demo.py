"""The main job: `python -m ckptd demo` on a fresh local Ray instance."""

from __future__ import annotations

import os
import subprocess
import sys

import ckptd


def test_demo_trains_fsdp2_saves_resumes_on_3_ranks_and_exports(tmp_path):
    root = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptd", "demo", "--root", str(root), "--steps", "6", "--ckpt-every", "3"],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FSDP2 tiny Llama on 2 Ray actors" in proc.stdout
    assert "training blocked per save" in proc.stdout
    assert "model and AdamW state equal the 2 ranks': yes; next losses match: yes" in proc.stdout
    assert "dcp.load (HuggingFaceStorageReader) on 3 ranks: weights equal: yes" in proc.stdout
    assert "from_pretrained outputs equal the FSDP2 model's: yes" in proc.stdout
    assert ckptd.latest_step(str(root)) == 6
    # Retention kept the 2 newest full checkpoints (3, 6) and 2 newest state dicts (5, 6).
    assert sorted(p for p in os.listdir(root) if p.startswith("global_step_")) == [
        "global_step_3", "global_step_5", "global_step_6"]
    assert sorted(os.listdir(root / "global_step_6" / "model")) == [
        "optimizer_groups.json", "shard-00000.safetensors", "shard-00001.safetensors", "sharded_metadata.json"]
    assert ckptd.verify(str(root)).step == 6


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
