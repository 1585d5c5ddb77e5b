"""The CUDA generators in the training state: captured, written, read back the way ``resume``
reads them (``weights_only``, checked against the manifest) and restored. Needs CUDA: runs on a
GPU machine (``pytest --noconftest -n 0 tests/unit/test_cuda_training_state.py``), skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from ckptd.storage import Storage
from ckptd.verify import read_file
from ckptd.workers.files import load_torch
from ckptd.workers.training_state import capture_training_state, rank_file, save_training_state, set_rng_state
from tests.unit.helpers import committed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_random_draws_resume_where_the_checkpoint_left_them(tmp_path):
    torch.cuda.manual_seed_all(123)
    torch.rand(10, device="cuda")  # a generator that has moved on from its seed
    state = capture_training_state(epoch=0, step=7, step_in_epoch=7)
    assert "cuda" in state.rng and len(state.rng["cuda"]) == torch.cuda.device_count()
    root = str(tmp_path)
    out = os.path.join(root, "global_step_7")
    step = committed(root, save_training_state(out, state))
    expected = torch.rand(1000, device="cuda")  # what training would draw next
    torch.cuda.manual_seed_all(999)
    rel = f"global_step_7/{rank_file('rng', 0)}"
    rng = load_torch(read_file(Storage(root), step, rel), rel)
    set_rng_state(rng)
    assert torch.equal(torch.rand(1000, device="cuda"), expected)
