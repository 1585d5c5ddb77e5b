"""P7: a rollout worker following a run's weights. How soon it hears of a new version, and what
loading that version verified costs.

Version latency: a trainer in this process commits ``versions`` small state dicts at random
intervals (50-300 ms, seeded, so the poller's phase is not aligned with the commits). Two
followers watch the same commits in the same run:

- ckptd's :class:`~ckptd.WeightSubscriber` (monitor mode: long-polls ``wait_version``), in a Ray
  actor of its own, so it does not share a GIL with the trainer thread and its save threads;
- a poller that reads ``latest_state_dict_iteration.txt`` once a second, as Trinity-RFT's
  synchronizer does, in a thread of this process (at a 1 s period the GIL is noise).

The reference for both is the moment the monitor published the version (its tracker moved),
which the monitor returns with every woken wait (:meth:`WeightSubscriber.published_at`). The
latency of version v is the first time a follower saw a version >= v, minus that moment; a version
overtaken by the next one before a follower looked counts from when it saw the newer one. The
monitor notes the moment once the tracker is durable, so the poller, which reads the file as soon
as it is renamed into place, can see a version up to that fsync (about a millisecond) "early".

Verified load: ``size_mib`` of float32 weights written by :func:`ckptd.workers.save_hf_model`
into a committed step, loaded into a model with the same parameters, against the safetensors
library on the same file. The file was just written, so every method reads it from the page cache.
ckptd checks and copies on its own pool (the machine's cores, at most 8); ``load_state_dict``
copies on the one torch thread the benchmark allows, so the ratio depends on free cores.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import ray
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.config import Kind
from ckptd.errors import CheckpointError
from ckptd.layout import TRACKERS
from ckptd.storage import Storage
from ckptd.verify import open_step
from ckptd.workers import save_hf_model
from ckptd.workers.mapped import threads
from ckptd.workers.weights import read_weights

from .common import MiB, Row, connect_ray

POLL_S = 1.0  # Trinity-RFT's synchronizer checks the tracker once a second
_WAIT_S = 60.0  # for a follower to see the last version; far above what either needs


@ray.remote(num_cpus=0)
class Follower:
    """A rollout worker in its own process: follows the run through a WeightSubscriber and notes
    when each wait woke up."""

    def __init__(self, run: str) -> None:
        self.sub = ckptd.WeightSubscriber(run, name="bench-p7")
        if self.sub.mode != "monitor":  # storage mode would poll the root: not what is measured
            raise RuntimeError(f"the subscriber found no monitor of run {run!r} (mode {self.sub.mode})")
        self.woken: list[tuple[int, float, float | None]] = []  # version, woken at, published at
        self._thread = threading.Thread(target=self._follow, name="bench-p7-follow", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        after = None
        while True:
            try:
                version = self.sub.wait_for_version(after)
            except CheckpointError:  # closed
                return
            self.woken.append((version, time.time(), self.sub.published_at(version)))
            after = version

    def newest(self) -> int | None:
        return self.woken[-1][0] if self.woken else None

    def stop(self) -> list[tuple[int, float, float | None]]:
        self.sub.close()
        return list(self.woken)


class TrackerPoller(threading.Thread):
    """Reads the state-dict tracker every ``interval_s`` and notes each new value when first read."""

    def __init__(self, root: str, interval_s: float = POLL_S) -> None:
        super().__init__(name="bench-p7-poller", daemon=True)
        self.path = os.path.join(root, TRACKERS[Kind.STATE_DICT])
        self.interval_s = interval_s
        self.seen: list[tuple[int, float]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while True:
            version = self._read()
            if version is not None and (not self.seen or version > self.seen[-1][0]):
                self.seen.append((version, time.time()))
            if self._done.wait(self.interval_s):
                return

    def _read(self) -> int | None:
        try:
            with open(self.path) as f:
                return int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return None

    def newest(self) -> int | None:
        return self.seen[-1][0] if self.seen else None

    def stop(self) -> None:
        self._done.set()
        self.join()


def _first_seen(seen: list[tuple[int, float]], version: int) -> float | None:
    return next((at for v, at in seen if v >= version), None)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]  # as P4


def _wait_until(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"P7: {what} did not happen within {_WAIT_S} s")
        time.sleep(0.05)


def _write_version(out: str, step: int) -> list[str]:
    """A small state dict: the latency does not depend on its size once it is written."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "weights.bin")
    with open(path, "wb") as f:
        f.write(step.to_bytes(8, "little") * 512)
    return [path]


def version_latency(run: str, root: str, coord: ckptd.CheckpointCoordinator, versions: int,
                    seed: int = 7) -> list[Row]:
    """Commit ``versions`` state dicts (after one uncounted warm-up version) and time how soon
    each follower sees them."""

    def commit(step: int) -> None:
        out = coord.step_dir(step)
        coord.save_async("weights", lambda: _write_version(out, step), step, is_state_dict=True)
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)

    follower = Follower.remote(run)
    poller = TrackerPoller(root)
    poller.start()
    try:
        ray.get(follower.newest.remote())  # attached, and waiting for a first version
        commit(1)  # warm-up: both followers have seen a version before the counted ones
        _wait_until("the warm-up version reaching both followers",
                    lambda: ray.get(follower.newest.remote()) == 1 and poller.newest() == 1)
        rng = random.Random(seed)
        last = versions + 1
        for step in range(2, last + 1):
            time.sleep(rng.uniform(0.05, 0.3))
            commit(step)
        coord.wait_committed(last, is_state_dict=True, timeout_s=_WAIT_S)
        # The poller first: the follower is asked only after that (and is then long done), so
        # these calls do not compete with its wait for the last version.
        _wait_until("the last version reaching both followers",
                    lambda: poller.newest() == last and ray.get(follower.newest.remote()) == last)
        woken = ray.get(follower.stop.remote())
    finally:
        poller.stop()
        ray.kill(follower)
    published = {v: at for v, _, at in woken if at is not None}
    sub_seen = [(v, at) for v, at, _ in woken]
    counted = [v for v in range(2, last + 1) if v in published]
    if not counted:
        raise RuntimeError("P7: the subscriber heard of none of the versions")
    sub = [_first_seen(sub_seen, v) - published[v] for v in counted]
    poll = [_first_seen(poller.seen, v) - published[v] for v in counted]
    # A version the subscriber never heard of (overtaken within its round trip) has no publication
    # time here, so it is left out for both methods; the note says how many.
    missed = versions - len(counted)
    over = f"{len(counted)} versions committed 50-300 ms apart" + (
        f" ({missed} overtaken before the subscriber heard of them, left out)" if missed else "")
    every = "; samples: every version's latency from its publication (tracker moved)"
    return [
        Row("P7 version latency", "ckptd subscriber p50", "s", sub,
            f"{over}; WeightSubscriber long-polling the monitor, in a Ray actor{every}"),
        Row("P7 version latency", "ckptd subscriber p99", "s", [_p99(sub)], over),
        Row("P7 version latency", f"tracker polling {POLL_S:g} s p50", "s", poll,
            f"{over}; a thread reading {TRACKERS[Kind.STATE_DICT]} every {POLL_S:g} s (Trinity-RFT){every}"),
        Row("P7 version latency", f"tracker polling {POLL_S:g} s p99", "s", [_p99(poll)], over),
    ]


class _Layers(torch.nn.Module):
    """Layers holding one weight each, named like the saved tensors (``layer0.weight``, ...)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.zeros(shape))  # zeros: every page touched now
            self.add_module(name.split(".")[0], layer)


def verified_load(coord: ckptd.CheckpointCoordinator, root: str, step: int, size_mib: int, reps: int,
                  layers: int = 16) -> list[Row]:
    """Commit ``size_mib`` of weights as ``step``, then load them with each method, interleaved."""
    cols = 1024
    rows = max(1, size_mib * MiB // 4 // layers // cols)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(layers)}
    out = coord.step_dir(step)
    coord.save_async("hf", lambda: save_hf_model(out, state, {"model_type": "llama"}), step, is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(step, is_state_dict=True, timeout_s=600)
    model = _Layers({k: tuple(t.shape) for k, t in state.items()})
    storage = Storage(root)
    path = os.path.join(out, "model.safetensors")
    mib = sum(t.numel() * t.element_size() for t in state.values()) / MiB

    def weights():
        return read_weights(storage, open_step(storage, step, Kind.STATE_DICT))

    def st_load_state_dict():
        sd = load_file(path)
        model.load_state_dict(sd)
        return sd

    def ckptd_load_into():
        ws = weights()
        ws.load_into(model)
        return ws  # its mapping, like load_file's above, is unmapped after the clock stops

    ckptd_load_into()  # the model holds the saved weights, through ckptd alone
    sd = weights().state_dict()
    for key, param in model.state_dict().items():
        if not (torch.equal(param, state[key]) and torch.equal(sd[key], state[key])):
            raise RuntimeError(f"P7: {key} was not loaded as saved")
    state.clear()  # 1 GiB less in memory while the methods run
    del sd

    methods: dict[str, Callable[[], object]] = {
        "safetensors load_file alone (lazy map)": lambda: load_file(path),
        "safetensors load_file + load_state_dict": st_load_state_dict,
        "safetensors load_file + clone": lambda: {k: t.clone() for k, t in load_file(path).items()},
        "ckptd load_into (verified)": ckptd_load_into,
        "ckptd state_dict (verified, mapped)": lambda: weights().state_dict(),
    }
    common = f"{mib:.0f} MiB float32, 1 file, in the page cache (just written)"
    notes = {
        "safetensors load_file alone (lazy map)":
            f"{common}; tensors map the file: no byte is read or checked, listed for honesty",
        "safetensors load_file + load_state_dict":
            f"{common}; the baseline: every byte reaches the model (torch copy on 1 thread), nothing checked",
        "safetensors load_file + clone": f"{common}; a private copy of every tensor, nothing checked",
        "ckptd load_into (verified)":
            f"{common}; open_step + CRC-32 of the file against the manifest, then copy, on {threads()} threads",
        "ckptd state_dict (verified, mapped)":
            f"{common}; open_step + CRC-32 against the manifest; tensors are views of the mapping (no copy)",
    }
    results = {name: Row("P7 verified load", name, "s", note=notes[name]) for name in methods}
    for rep in range(reps + 1):  # the first round warms up (pools, page tables), not counted
        for name, fn in methods.items():
            gc.collect()
            t0 = time.perf_counter()
            kept = fn()  # freed after the clock stops: unmapping is not part of loading
            seconds = time.perf_counter() - t0
            del kept
            if rep:
                results[name].samples.append(seconds)
    return list(results.values())


def p7_rollout(base_dir: str | None, versions: int, size_mib: int, reps: int) -> list[Row]:
    started_ray = connect_ray()
    root = tempfile.mkdtemp(prefix="ckptd-bench-p7-", dir=base_dir)
    run = f"bench-p7-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    try:
        rows = version_latency(run, root, coord, versions)
        rows += verified_load(coord, root, versions + 2, size_mib, reps)
    finally:
        coord.close()
        ray.kill(monitor, no_restart=True)
        shutil.rmtree(root, ignore_errors=True)
        if started_ray:
            ray.shutdown()
    return rows
