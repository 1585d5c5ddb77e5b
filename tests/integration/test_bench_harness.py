"""The bench harness gives every method the same file lifecycle: each keeps its last two saves,
as ckptd's retention keeps two steps, and the next save is timed only once that clean-up ended."""

from __future__ import annotations

import os

from bench.common import make_state
from bench.saves import KEEP, SaveHarness


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
