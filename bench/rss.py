"""P5: peak resident memory during one save, each method in a fresh process.

Reported as (peak RSS during the save - RSS before the state existed) / state size, so the
interpreter and Ray's client libraries do not count, and the state itself counts once.
Run as ``python -m bench.rss METHOD MIB DIR``; prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .common import MiB, Row

_ADDRESS_VAR = "CKPTD_BENCH_RAY_ADDRESS"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(method: str, mib: int, directory: str) -> dict:
    import ray
    import torch

    import ckptd

    from .common import fsync_tree, make_state

    torch.set_num_threads(1)
    if method == "ckptd":
        address = os.environ.get(_ADDRESS_VAR)
        if address:  # the bench's own Ray cluster: seconds faster than starting one; RSS is per process
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        else:
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        monitor = ckptd.start_monitor(f"{directory}/ckptd", run=f"rss-{os.getpid()}")
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="rss")
    baseline = _status("VmRSS")
    sd = make_state(mib * MiB)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to now: only the save is measured from here
    except OSError:
        pass
    if method == "ckptd":
        coord.save_state_async("model", sd, 1)
        coord.register(1, checkpoint_thread_count=1)
        coord.wait_committed(1, timeout_s=600)
    elif method == "safetensors.save_file":
        from safetensors.torch import save_file

        save_file(sd, f"{directory}/model.safetensors")
        fsync_tree(directory)
    elif method == "torch.save":
        torch.save(sd, f"{directory}/model.pt")
        fsync_tree(directory)
    else:
        raise ValueError(method)
    return {"baseline": baseline, "peak": _status("VmHWM"), "state": mib * MiB}


def p5_rss(mib: int, base_dir: str | None, reps: int) -> list[Row]:
    import shutil
    import tempfile

    import ray

    ray_address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    rows = []
    for method in ("ckptd", "safetensors.save_file", "torch.save"):
        row = Row("P5 peak RSS", method, "x state", note=f"{mib} MiB state; (peak - RSS before the state) / state")
        for _ in range(reps):
            d = tempfile.mkdtemp(prefix="ckptd-bench-p5-", dir=base_dir)
            env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
            if ray_address:
                env[_ADDRESS_VAR] = ray_address
            out = subprocess.run([sys.executable, "-m", "bench.rss", method, str(mib), d], capture_output=True,
                                 text=True, timeout=900, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            row.samples.append((r["peak"] - r["baseline"]) / r["state"])
            shutil.rmtree(d, ignore_errors=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
