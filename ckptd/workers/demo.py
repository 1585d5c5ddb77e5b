"""The demo job (``ckptd demo``): a real FSDP2 training job on Ray actors, saving through ckptd.

Two rank actors form a gloo process group and train a tiny Llama sharded with ``fully_shard``
(AdamW, warm-up schedule, a synthetic dataset). Every step each rank publishes its block of the
weights (a state-dict save); every few steps it saves a full checkpoint: its blocks of the model
and of the optimizer's moments, staged in the background while the next forward and backward
run (fenced), plus the schedule, RNG and data position. Nothing is gathered on any rank. The
monitor commits a step when every rank's units have finished, and applies retention.

At the end the job is resumed on three ranks from the newest checkpoint, re-sharded, and must
hold exactly what the two ranks held and train on with the same losses; DCP's own
``HuggingFaceStorageReader`` loads the same files; and a Ray task exports the checkpoint to
HuggingFace format, which ``transformers`` loads with the same outputs.

With ``address`` the demo joins an existing cluster instead of starting Ray, places its ranks
round-robin over the nodes and prints where each ran (``deploy/local/two_nodes.sh`` runs it on
two nodes); ``mirror`` adds the mirror tier.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import ray
import torch

import ckptd
from ckptd.config import Kind
from ckptd.layout import scan_steps
from ckptd.storage import Storage
from ckptd.workers.export import export_hf_async
from ckptd.workers.fsdp_job import MODEL_DIR, FSDPJob, tiny_llama_config

LOSS_RTOL = 1e-5


def _commit_step(job: FSDPJob, full: bool) -> int:
    return ray.get(job.actors[0].register.remote(2 if full else 1, not full))


def run_demo(root: str, steps: int = 20, ckpt_every: int = 5, workers: int = 2, keep: int = 2,
             resume_on: int = 3, address: str | None = None, mirror: str | None = None) -> int | None:
    """Run the demo job; return the latest committed full checkpoint step.

    Args:
        root: The checkpoint root: a path every node sees (shared filesystem) or a URL.
        address: Connect to this Ray cluster (``"auto"`` or ``host:port``) instead of starting
            a local one; the ranks are then spread over its nodes.
        mirror: Also upload committed steps to this URL (the monitor's mirror tier).

    Raises:
        CheckpointConfigError: the root (or mirror) is not storage that every rank and the
            monitor see alike, among other configuration errors.
    """
    started = time.perf_counter()
    if not ray.is_initialized():
        if address is None:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    run = f"demo-{os.getpid()}"
    nodes = [n for n in ray.nodes() if n["Alive"]]
    print(f"Ray cluster: {len(nodes)} node(s); run {run}, checkpoint root {root}"
          + (f", mirror {mirror}" if mirror else ""))
    monitor = ckptd.start_monitor(root, run=run, max_ckpt_to_keep=keep, max_state_dict_to_keep=keep,
                                  **({"mirror": mirror} if mirror else {}))
    root = ray.get(monitor.worker_config.remote())["root"]
    spread = address is not None
    job = FSDPJob(workers, run=run, spread=spread)
    _print_nodes(job)
    driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")

    rows, reference, after = [], {}, []
    for step in range(1, steps + 1):
        full = step % ckpt_every == 0
        loss = job.call("train", 1)[0][0]
        job.call("save" if full else "save_weights", **({"fenced": True} if full else {}))
        _commit_step(job, full)
        rows.append((step, full, loss))
        if full and step == steps - steps % ckpt_every:
            reference = job.call("full_state")[0]
    job.call("wait_saves")
    blocked = [b for per_rank in job.call("blocked_ms") for b in per_rank]
    last_full = steps - steps % ckpt_every
    driver.wait_committed(steps, is_state_dict=True, timeout_s=120)
    if last_full:
        driver.wait_committed(last_full, timeout_s=120)
    ray.get(monitor.wait_retention.remote(60))
    status = ray.get(monitor.status.remote())

    print(f"FSDP2 tiny Llama on {workers} Ray actors (gloo), weights every step, full checkpoint every {ckpt_every}")
    print(f"{'step':>5} {'saved':<18} {'loss':>9} {'committed':>10}")
    for step, full, loss in rows:
        st = status.step(step, Kind.CHECKPOINT if full else Kind.STATE_DICT)
        done = "-" if st is None else ("yes" if st.committed else st.state.value)
        print(f"{step:>5} {'weights+checkpoint' if full else 'weights':<18} {loss:>9.5f} {done:>10}")
    kept = sorted(scan_steps(Storage(root)))
    print()
    print(f"training blocked per save:  median {statistics.median(blocked):.2f} ms, max {max(blocked):.2f} ms "
          f"(every rank, every save; nothing gathered)")
    print(f"kept after retention:       steps {kept} (max {keep} checkpoints, {keep} state dicts)")
    latest = ckptd.latest_step(root)
    print(f"latest checkpoint:          {latest} -> {ckptd.step_dir(root, latest) if latest is not None else '-'}")
    print(f"latest state dict:          {ckptd.latest_step(root, 'state_dict')}")
    if mirror and latest is not None:
        mirrored = ray.get(monitor.wait_mirrored.remote(latest, 120))
        print(f"mirrored:                   step {latest} -> {mirror}: "
              f"{'yes' if mirrored['mirrored'] else 'NO ' + str(mirrored['error'])}")
    if latest is not None:
        ckptd.verify(root, latest)
        if latest == steps:
            after = job.call("train", 2)[0]
        job.teardown()
        _resumed(root, latest, job, resume_on, run, reference, after, spread)
    print(f"wall time:                  {time.perf_counter() - started:.1f} s")
    job.teardown()
    ray.kill(monitor, no_restart=True)
    return latest


def _print_nodes(job: FSDPJob) -> None:
    for rank, where in enumerate(job.call("node")):
        print(f"rank {rank} runs on {where}")


def _resumed(root: str, latest: int, old: FSDPJob, world: int, run: str, reference: dict, after: list,
             spread: bool = False) -> None:
    """Resume on ``world`` ranks, read the step with DCP, export it to HF; print what matched."""
    job = FSDPJob(world, actors=old.actors, run=run, spread=spread)
    _print_nodes(job)
    state = job.call("resume", root)[0]
    resumed = job.call("full_state")[0]  # a collective on every rank: once, not once per tensor
    same = not [k for k, v in reference.items() if not torch.equal(v, resumed[k])]
    losses = job.call("train", 2)[0] if after else []
    match = "n/a" if not after else ("yes" if all(
        abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(losses, after, strict=True)) else "NO")
    print(f"resume on {world} ranks:          step {state['step']}, epoch {state['epoch']}, "
          f"{state['consumed']} samples consumed; model and AdamW state equal the {len(old.actors)} ranks': "
          f"{'yes' if same else 'NO'}; next losses match: {match}")
    step_dir = ckptd.step_dir(root, latest)
    fresh = FSDPJob(world, actors=job.actors, spread=spread)
    if "://" in root:  # DCP's FileSystemReader (under HuggingFaceStorageReader) opens local paths only
        fresh.call("resume", root, latest, True)  # the weights alone, for the HF comparison below
        print(f"dcp.load (HuggingFaceStorageReader) on {world} ranks: skipped, it reads local paths only")
    else:
        fresh.call("load_with_dcp", f"{step_dir}/{MODEL_DIR}")
        dcp_same = not [k for k, v in fresh.call("full_state")[0].items()
                        if not k.startswith(("optim.", "lr")) and not torch.equal(v, reference[k])]
        print(f"dcp.load (HuggingFaceStorageReader) on {world} ranks: weights equal: {'yes' if dcp_same else 'NO'}")
    ids = torch.arange(16).reshape(1, 16) % 96
    logits = fresh.call("logits", ids)[0]
    fresh.teardown()
    out = f"{root.rstrip('/')}-hf/step_{latest}"  # next to the root: committed steps never change
    t0 = time.perf_counter()
    ray.get(export_hf_async(root, latest, out, tiny_llama_config().to_dict()))
    with tempfile.TemporaryDirectory() as local:
        hf_logits = _hf_logits(out, local, ids)
    close = torch.allclose(hf_logits, logits, rtol=1e-5, atol=1e-5)
    print(f"HF export (Ray task):       {out} in {time.perf_counter() - t0:.1f} s; from_pretrained outputs equal "
          f"the FSDP2 model's: {'yes' if close else 'NO'}")


def _hf_logits(out: str, local: str, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the HF export at ``out`` (a path, or a URL copied to ``local`` first:
    ``from_pretrained`` reads local directories)."""
    from transformers import AutoModelForCausalLM

    if "://" in out:
        import fsspec

        fs, path = fsspec.core.url_to_fs(out)
        fs.get(f"{path.rstrip('/')}/", f"{local}/", recursive=True)
        out = local
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
