"""P3: training throughput with a full checkpoint every k steps, against no checkpointing and
against a synchronous torch.save of the same state."""

from __future__ import annotations

import os

import torch

from ckptd.storage import Storage
from ckptd.workers.files import write_torch

from .common import MiB, Row, fsync_tree, timed
from .saves import SaveHarness


def _model(model_mib: int, width: int) -> torch.nn.Module:
    layers = max(1, model_mib * MiB // (width * width * 4))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def p3_training(h: SaveHarness, model_mib: int, steps: int, every: int, reps: int, width: int = 2048) -> list[Row]:
    torch.manual_seed(0)
    model = _model(model_mib, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, width)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    rows = {m: Row("P3 training", m, "s/step") for m in ("no checkpointing", "ckptd (fenced staging)",
                                                         "torch.save, synchronous")}
    note = f"{nbytes / MiB:.0f} MiB model + AdamW, 1 torch thread, full checkpoint every {every} steps"
    for row in rows.values():
        row.note = note

    def run(mode: str) -> float:
        def loop() -> None:
            for step in range(1, steps + 1):
                loss = model(x).square().mean()
                opt.zero_grad()
                loss.backward()
                h.coord.before_update()  # fenced copies of the last checkpoint must be done
                opt.step()
                if step % every or step == steps:
                    continue
                if mode == "ckptd (fenced staging)":
                    s = h.next_step()
                    out = h.coord.step_dir(s)

                    def write_optim(snapshot, out=out):
                        storage = Storage(out)
                        storage.makedirs(storage.root)
                        return [write_torch(storage, storage.join("optim.pt"), snapshot)]

                    h.coord.save_state_async("model", model.state_dict(), s, fenced=True)
                    h.coord.save_state_async("optim", opt.state_dict(), s, write_optim, fenced=True)
                    h.coord.register(s, checkpoint_thread_count=2)
                elif mode == "torch.save, synchronous":
                    path = h.fresh("p3-sync")
                    os.makedirs(path)
                    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{path}/ckpt.pt")
                    fsync_tree(path)

        t = timed(loop)
        h.coord.wait_all()
        return t / steps

    run("no checkpointing")  # warm-up: first steps allocate gradients and optimizer state
    for _ in range(reps):
        for mode, row in rows.items():
            row.samples.append(run(mode))
    return list(rows.values())
