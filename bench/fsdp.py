"""P8: a 2-rank FSDP2 save of the model and its AdamW state, four ways in the same run.

Each repetition, on the same two Ray actors (a gloo process group), saves the same state with:

* ckptd eager: ``sharded_state`` + ``save_state_async`` (copy into reused host buffers on the
  training thread, write in the background), committed by the monitor;
* ckptd fenced: the same, with the copy overlapping the next forward and backward; the training
  thread waits only at ``before_update`` for what is not copied yet;
* ``dcp.async_save`` (its default stager, a second gloo group for its background collectives);
* ``dcp.save``.

After every save call the rank runs one forward and backward (the work a real loop overlaps
with the save). Blocked: the training thread's time in save calls (and, fenced, at the fence),
the slower rank's. Durable: from the first rank's save call until the checkpoint is complete
on disk (ckptd: committed, files fsynced; DCP: both ranks' futures done, ``sync_files``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import ray
import torch

import ckptd
from ckptd.workers.dtensor import sharded_state
from ckptd.workers.fsdp_job import FSDPJob, FSDPTrainer

from .common import MiB, Row, connect_ray

METHODS = ("ckptd fenced", "ckptd eager", "dcp.async_save", "dcp.save")


class P8Rank(FSDPTrainer):
    def _compute(self) -> None:
        batch = self._local_batch()
        self.model(input_ids=batch, labels=batch).loss.backward()

    def state_mib(self) -> float:
        return sharded_state(self.model, self.optimizer).nbytes / MiB

    def measure(self, method: str, out_dir: str, step: int) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        torch.distributed.barrier()
        start = time.time()
        t0 = time.perf_counter()
        if method.startswith("ckptd"):
            fenced = method == "ckptd fenced"
            if self.rank == 0:
                self.coord.register(step, checkpoint_thread_count=self.world_size)
            out = f"{self.coord.step_dir(step)}/model"
            sharded_state(self.model, self.optimizer).save(self.coord, "p8", step, out, fenced=fenced)
            blocked = time.perf_counter() - t0
            self._compute()
            if fenced:
                t1 = time.perf_counter()
                self.coord.before_update()
                blocked += time.perf_counter() - t1
            self.coord.wait_all()
            if self.rank == 0:
                self.coord.wait_committed(step, timeout_s=300)
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            sd = {"model": model_sd, "optim": optim_sd}
            if method == "dcp.save":
                dcp.save(sd, checkpoint_id=out_dir)
                blocked = time.perf_counter() - t0
                self._compute()
            else:
                if self._background_group is None:
                    self._background_group = torch.distributed.new_group(backend="gloo")
                future = dcp.async_save(sd, checkpoint_id=out_dir, process_group=self._background_group)
                blocked = time.perf_counter() - t0
                self._compute()
                future.result()
        self.optimizer.zero_grad()
        return {"blocked_s": blocked, "start": start, "done": time.time()}


def p8_fsdp(base_dir: str | None, reps: int, hidden: int, layers: int, vocab: int, warm_up: bool = True) -> list[Row]:
    started_ray = not ray.is_initialized()
    if started_ray:
        # The rank actors import this module: let Ray's workers find the repository.
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
        connect_ray()
    root = tempfile.mkdtemp(prefix="ckptd-bench-p8-", dir=base_dir)
    run = f"bench-p8-{os.getpid()}"
    monitor = ckptd.start_monitor(f"{root}/ckptd", run=run, max_ckpt_to_keep=2)
    actor = ray.remote(num_cpus=0)(P8Rank)
    config = {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers,
              "vocab_size": vocab, "num_attention_heads": max(1, hidden // 64),
              "num_key_value_heads": max(1, hidden // 128)}
    job = FSDPJob(2, actors=[actor.remote() for _ in range(2)], run=run, config=config)
    try:
        job.call("train", 1)  # AdamW's moments exist from the first step on
        mib = job.call("state_mib")
        blocked = {m: Row("P8 FSDP2 blocked", m, "s") for m in METHODS}
        durable = {m: Row("P8 FSDP2 durable", m, "s") for m in METHODS}
        step = 1
        for rep in range(-1 if warm_up else 0, reps):  # rep -1: the uncounted warm-up round
            # Interleaved, and the order rotates each repetition, so drift hits all methods alike.
            for method in METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]:
                step += 1
                out = f"{root}/dcp-{step}"
                res = job.call("measure", method, out, step)
                shutil.rmtree(out, ignore_errors=True)
                if rep < 0:
                    continue
                blocked[method].samples.append(max(r["blocked_s"] for r in res))
                durable[method].samples.append(max(r["done"] for r in res) - min(r["start"] for r in res))
        note = f"2 ranks, {sum(mib):.0f} MiB of model + AdamW state ({mib[0]:.0f} MiB per rank), gloo"
        for row in (*blocked.values(), *durable.values()):
            row.note = note
        return [*blocked.values(), *durable.values()]
    finally:
        job.teardown()
        for a in job.actors:
            ray.kill(a)
        ray.kill(monitor, no_restart=True)
        shutil.rmtree(root, ignore_errors=True)
        if started_ray:
            ray.shutdown()
