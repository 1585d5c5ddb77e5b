"""P6: the mirror tier. How long a committed step takes to reach S3 through ckptd's mirror
(stream, check, verify, manifest, tracker), against a bare ``s3fs`` upload of the same files.

The S3 side is a moto server on 127.0.0.1 (the one the tests use), so absolute figures are
bounded by that server's CPU on this machine; the ratio within one run is the useful figure.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import fsspec
import ray

import ckptd

from .common import MiB, Row, connect_ray, make_state, timed


def p6_mirror(size_mib: int, reps: int, scratch: str | None, warm_up: bool = True) -> list[Row]:
    try:
        from tests.s3server import S3Server  # the test extra: moto's server and s3fs
    except ImportError as e:
        print(f"P6 skipped: {e} (install the test extra)")
        return []
    server = S3Server().start()
    base = tempfile.mkdtemp(prefix="ckptd-bench-p6-", dir=scratch)
    connect_ray()  # P1-P4 may have started it
    state = make_state(size_mib * MiB, tensors=8)
    note = f"{size_mib} MiB in 8 safetensors files, local disk to moto S3 on 127.0.0.1"
    rows = {
        "checksum": Row("P6 mirror", "ckptd mirror, verify=checksum (read back)", "s", note=note),
        "size": Row("P6 mirror", "ckptd mirror, verify=size", "s", note=note),
        "put": Row("P6 mirror", "s3fs put of the same files, unverified", "s", note=note),
    }
    try:
        first = 0 if warm_up else 1
        for rep in range(first, reps + 1):  # round 0 warms up the server and the clients
            for mode in ("checksum", "size", "put"):
                bucket = server.new_bucket()
                root = f"{base}/{mode}-{rep}"
                mirror = {"url": f"s3://{bucket}/run", "verify": mode} if mode != "put" else None
                monitor = ckptd.start_monitor(root, run=f"p6-{mode}-{rep}", mirror=mirror,
                                              mirror_storage_options=server.options())
                coord = ckptd.CheckpointCoordinator(monitor, worker_id="bench")
                out = coord.step_dir(1)
                for i, (name, t) in enumerate(state.items()):
                    coord.save_state_async(f"part{i}", {name: t}, 1)
                coord.register(1, checkpoint_thread_count=len(state))
                coord.wait_committed(1, timeout_s=600)
                if mode == "put":
                    fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.options())
                    seconds = timed(lambda fs=fs, out=out, bucket=bucket: fs.put(out, f"{bucket}/run/", recursive=True))
                else:
                    t0 = time.perf_counter()
                    coord.wait_mirrored(1, timeout_s=600)
                    seconds = time.perf_counter() - t0
                if rep:
                    rows[mode].samples.append(seconds)
                coord.close()
                ray.kill(monitor, no_restart=True)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return list(rows.values())
