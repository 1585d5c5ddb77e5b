"""P1 on a GPU: how long a save keeps the training thread from CUDA tensors, against the copy limit.

``python -m bench.gpu`` (needs CUDA; ``--device cpu`` runs the same code on the CPU as a smoke
run). Every method copies the same state, a list of CUDA tensors, in interleaved rounds:

* the copy limit: ``dst.copy_(src, non_blocking=True)`` into preallocated pinned buffers, then
  the stream synchronized;
* ``tensor.to("cpu", non_blocking=True)``: the same, into pinned memory it allocates (cached);
* ckptd eager: the staging layer's copy (:class:`~ckptd.coordinator.staging.StagingArea`) on
  the training thread; and the same into the shared-memory buffers of ``writer="process"``
  (page-locked in place), beside a plain copy into pageable shared memory;
* ckptd fenced: the save call returns at once, a forward/backward stand-in (matrix products
  queued on the training stream for about twice the copy's time) runs, then the fence; blocked
  is the call plus the fence;
* ``dcp.async_save`` as users call it, and with DCP's pinned asynchronous stager (then blocked is
  the call plus the wait for staging after the same stand-in, as for the fence).

The coordinator's Ray round trips are not part of this: Ray need not be installed where this
runs, and they are measured by ``python -m bench`` (P1 on the CPU). Ratios are median blocked
time over the copy limit's median in the same rounds, with a bootstrap 95 % interval.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckptd.coordinator.staging import StagingArea, tensors_of

from .common import one_rank_group
from .stats import bootstrap_ratio, interleave_rounds, verdict

MiB = 1 << 20
TARGETS = {"ckptd eager": 1.2, "ckptd fenced": 0.1}  # P1: at most this times the copy limit


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-mib", default="256,1024", help="state sizes, comma-separated")
    p.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor of the state")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds of every method")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the code")
    p.add_argument("--dcp-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="where dcp.async_save writes (RAM, so its background write competes least)")
    p.add_argument("--json", help="write every sample and ratio here")
    return p.parse_args(argv)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def _stand_in(device: str, seconds: float) -> Callable[[], None]:
    """Forward and backward: matrix products queued on the training stream for about
    ``seconds``, then that stream synchronized (as reading the loss would). Calibrated after a
    warm-up (the first products pay for the library's start-up), then checked once and scaled."""
    size = 4096 if device == "cuda" else 256
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    n = 1

    def step() -> None:
        for _ in range(n):
            a @ a
        _sync(device)

    for _ in range(2):
        step()  # warm-up
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        n = max(1, round(n * seconds / max(time.perf_counter() - t0, 1e-6)))
    return step


def _init_group() -> None:
    one_rank_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


def measure(mib: int, args: argparse.Namespace) -> dict:
    device = args.device
    n = max(1, args.tensor_mib * MiB // 2)
    count = max(1, mib // args.tensor_mib)
    state = {f"layer{i}.weight": torch.randn(n, device=device, dtype=torch.bfloat16) for i in range(count)}
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device == "cuda") for k, v in state.items()}
    pageable = {k: torch.empty(v.shape, dtype=v.dtype).share_memory_() for k, v in state.items()}
    area = StagingArea(1, "ckptd-stage")
    shared_area = StagingArea(1, "ckptd-stage-shared", shared=True)  # writer="process": shared memory
    leaves = tensors_of(state)

    def copy_into(buffers: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v, non_blocking=True)
        _sync(device)
        return time.perf_counter() - t0

    limit = partial(copy_into, pinned)

    def to_cpu() -> float:
        t0 = time.perf_counter()
        out = [v.to("cpu", non_blocking=True) for v in state.values()]
        _sync(device)
        elapsed = time.perf_counter() - t0
        del out
        return elapsed

    def eager(staging: StagingArea = area) -> float:
        t0 = time.perf_counter()
        snap = staging.snapshot("eager", state, leaves, fenced=False)
        elapsed = time.perf_counter() - t0
        snap.release()
        return elapsed

    copy_s = sorted(limit() for _ in range(3))[1]
    step = _stand_in(device, 2 * copy_s)

    steps: dict[str, list[float]] = {name: [] for name in (
        "alone", "ckptd fenced", "dcp.async_save (pinned async stager, reused)",
        "dcp.async_save (pinned async stager, new each save)")}

    def timed_step(method: str) -> None:
        t0 = time.perf_counter()
        step()
        steps[method].append(time.perf_counter() - t0)

    def step_alone() -> float:
        timed_step("alone")
        return steps["alone"][-1]

    def fenced() -> float:
        t0 = time.perf_counter()
        snap = area.snapshot("fenced", state, leaves, fenced=True)
        blocked = time.perf_counter() - t0
        timed_step("ckptd fenced")
        t0 = time.perf_counter()
        area.fence()
        blocked += time.perf_counter() - t0
        snap.release()
        return blocked

    dcp_root = tempfile.mkdtemp(prefix="bench-gpu-dcp-", dir=args.dcp_dir)
    saves = iter(range(1 << 30))

    def dcp_default() -> float:
        path = os.path.join(dcp_root, str(next(saves)))
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path)
        blocked = time.perf_counter() - t0
        future.result()
        shutil.rmtree(path, ignore_errors=True)
        return blocked

    def pinned_stager():
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # torchtitan's async_with_pinned_mem settings: pinned, shared, asynchronous, non-blocking
        return DefaultStager(StagingOptions(use_pinned_memory=device == "cuda", use_shared_memory=True,
                                            use_async_staging=True, use_non_blocking_copy=device == "cuda"))

    stagers = []
    try:
        stagers.append(pinned_stager())
    except (ImportError, TypeError):  # an older torch: no pinned asynchronous stager to compare with
        pass

    def dcp_pinned_async(reuse: bool) -> float:
        stager = stagers[0] if reuse else pinned_stager()
        path = os.path.join(dcp_root, str(next(saves)))
        try:
            t0 = time.perf_counter()
            response = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
            blocked = time.perf_counter() - t0
            timed_step("dcp.async_save (pinned async stager, reused)" if reuse
                       else "dcp.async_save (pinned async stager, new each save)")
            t0 = time.perf_counter()
            response.staging_completion.result()
            blocked += time.perf_counter() - t0
            response.upload_completion.result()
        finally:
            if not reuse:
                stager.close()
            shutil.rmtree(path, ignore_errors=True)
        return blocked

    methods: dict[str, Callable[[], float]] = {
        "copy limit (copy_ non_blocking into pinned)": limit,
        'tensor.to("cpu", non_blocking=True)': to_cpu,
        "ckptd eager": eager,
        "copy into shared memory, pageable": partial(copy_into, pageable),
        'ckptd eager, shared buffers (writer="process")': partial(eager, shared_area),
        "ckptd fenced": fenced,
        "dcp.async_save (default)": dcp_default,
        "stand-in step alone (not a save)": step_alone,
    }
    if stagers:
        methods["dcp.async_save (pinned async stager, reused)"] = partial(dcp_pinned_async, True)
        methods["dcp.async_save (pinned async stager, new each save)"] = partial(dcp_pinned_async, False)
    errors: dict[str, str] = {}

    def guarded(name: str, run: Callable[[], float], when: str = "") -> Callable[[], float]:
        """``run``, where an alternative that fails (one this torch cannot run) is reported in
        ``errors`` and not run again, instead of ending the bench; ckptd's and the limit's raise."""
        def call() -> float:
            if name in errors:
                return float("nan")
            try:
                return run()
            except Exception as e:  # noqa: BLE001 - reported with the results
                if name.startswith(("ckptd", "copy limit")):
                    raise
                errors[name] = f"{type(e).__name__}: {e}{when}"
                return float("nan")
        return call

    for name, run in methods.items():  # warm-up: buffers, the host allocator's cache, DCP's plans
        guarded(name, run)()
    for name in errors:
        del methods[name]
    try:
        for v in steps.values():
            v.clear()  # the warm-up's
        runs = [guarded(name, run, " (in a measured round)") for name, run in methods.items()]
        samples = dict(zip(methods, interleave_rounds(runs, args.rounds), strict=True))
        for name in errors:
            samples.pop(name, None)
            steps.pop(name, None)
    finally:
        shutil.rmtree(dcp_root, ignore_errors=True)
        for stager in stagers:
            stager.close()
    base = samples["copy limit (copy_ non_blocking into pinned)"]
    alone = samples.pop("stand-in step alone (not a save)")
    slowdown = {}  # the training step's time while a save stages behind it, over the step alone
    for name, s in steps.items():
        if name != "alone" and len(s) == len(alone):
            est = bootstrap_ratio(s, alone)
            slowdown[name] = {"percent": (est.ratio - 1) * 100, "low": (est.low - 1) * 100,
                              "high": (est.high - 1) * 100, "samples": s}
    rows = []
    for name, s in samples.items():
        est = bootstrap_ratio(s, base)
        row = {"method": name, "median_ms": sorted(s)[len(s) // 2] * 1e3, "ratio": est.ratio,
               "ratio_low": est.low, "ratio_high": est.high, "samples": s}
        if name in TARGETS:
            row["target"] = TARGETS[name]
            row["verdict"] = "inconclusive (smoke run on the CPU)" if device == "cpu" else \
                verdict(est, at_most=TARGETS[name]).value
        rows.append(row)
    return {"mib": mib, "tensors": count, "stand_in_ms": sorted(alone)[len(alone) // 2] * 1e3, "rows": rows,
            "errors": errors, "step_slowdown": slowdown, "step_alone": alone}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m bench.gpu needs a CUDA device; --device cpu runs it as a smoke test")
    _init_group()
    env = {"torch": torch.__version__,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "rounds": args.rounds}
    results = []
    try:
        for mib in (int(x) for x in args.sizes_mib.split(",")):
            r = measure(mib, args)
            results.append(r)
            print(f"\nP1 on {env['device']}: {mib} MiB in {r['tensors']} bf16 tensors, {args.rounds} rounds, "
                  f"stand-in step {r['stand_in_ms']:.0f} ms")
            print(f"{'method':<54} {'median ms':>10} {'x copy limit [95 % interval]':>30}  verdict")
            for row in r["rows"]:
                interval = f"{row['ratio']:.3f} [{row['ratio_low']:.3f}, {row['ratio_high']:.3f}]"
                v = f"{row['verdict']} (target <= {row['target']})" if "target" in row else ""
                print(f"{row['method']:<54} {row['median_ms']:>10.2f} {interval:>30}  {v}")
            for name, d in r["step_slowdown"].items():
                print(f"stand-in step with {name} staging behind it: {d['percent']:+.1f} % "
                      f"[{d['low']:+.1f}, {d['high']:+.1f}] against the step alone")
            for name, err in r["errors"].items():
                print(f"{name}: not measured, {err}")
    finally:
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
