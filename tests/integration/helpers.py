"""Real Ray actors used by the integration tests (no mocks)."""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch

import ckptd
from ckptd.layout import MANIFESTS, TRACKERS, parse_tracker
from ckptd.manifest import Manifest, changed_files
from ckptd.storage import Storage

from .sync import Signal  # noqa: F401 (the tests import it from here)


@ray.remote(num_cpus=0)
class SaveWorker:
    """A training-worker stand-in that saves through its own CheckpointCoordinator."""

    def __init__(self, run: str, rank: int) -> None:
        self.rank = rank
        self.root = ray.get(ckptd.get_monitor(run).worker_config.remote())["root"]
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run))
        self.model = torch.nn.Linear(4, 4)

    def pid(self) -> int:
        return os.getpid()

    def save(self, step: int, name: str = "model", is_state_dict: bool = False,
             gate=None, fail: bool = False) -> float:
        """save_async a torch.save of this worker's weights, as pipelines do; return blocked time."""
        sd = {k: v.clone() for k, v in self.model.state_dict().items()}
        path = f"{ckptd.step_dir(self.root, step)}/{name}_rank{self.rank}.pt"

        def save_fn():
            if gate is not None:
                ray.get(gate.wait.remote())
            if fail:
                raise OSError(f"disk full on rank {self.rank}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(sd, path)

        t0 = time.perf_counter()
        self.coord.save_async(name, save_fn, step, is_state_dict=is_state_dict)
        return time.perf_counter() - t0

    def wait_all(self) -> str | None:
        return wait_all(self.coord)

    def running_threads(self) -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptd-save-"))


def wait_all(coord: ckptd.CheckpointCoordinator) -> str | None:
    """coord.wait_all(), with a failed save's message returned instead of raised (across Ray),
    followed by its notes (the other saves that failed, each with its cause), one per line."""
    try:
        coord.wait_all()
        return None
    except ckptd.CheckpointSaveError as e:
        return "\n".join([str(e), *getattr(e, "__notes__", [])])


def failpoint_env(spec: str, once_dir=None) -> dict:
    """A runtime_env that arms failpoints in the monitor (each firing once if once_dir is set)."""
    env = {"CKPTD_FAILPOINTS": spec}
    if once_dir is not None:
        env["CKPTD_FAILPOINTS_ONCE"] = str(once_dir)
    return {"env_vars": env}


def restart_monitor(monitor, how: str = "ray.kill") -> None:
    """Kill the monitor's process and wait until Ray has restarted it."""
    before = ray.get(monitor.ping.remote())
    if how == "ray.kill":
        ray.kill(monitor, no_restart=False)
    else:
        os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: ray.get(monitor.ping.remote())["started_at"] != before["started_at"],
             what="the monitor to restart")


def arm_in_monitor(monitor, name: str, action: str | None) -> None:
    """Arm (or with None disarm) a named failpoint in the running monitor's process only."""
    def set_it(_self):
        from ckptd import failpoints
        if action is None:
            failpoints.disarm(name)
        else:
            failpoints.arm(name, action)
    ray.get(monitor.__ray_call__.remote(set_it))


def write_step_file(root: str, step: int, name: str, data: bytes | None = None) -> list[str]:
    """Write one file (64 random bytes by default) into the step's directory; return its path."""
    d = ckptd.step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/{name}", "wb") as f:
        f.write(data if data is not None else os.urandom(64))
    return [f"{d}/{name}"]


def disk_full() -> None:
    """A save function that fails."""
    raise OSError("disk full")


def fail_checkpoint_unit(coord, root: str, step: int) -> None:
    """A checkpoint unit of ``step`` that writes part of a file (creating the step directory),
    then fails with "disk full"."""
    def half_written() -> None:
        write_step_file(root, step, "optim.partial")
        disk_full()

    try:
        coord.save_sync(half_written, step)
    except ckptd.CheckpointSaveError:
        return
    raise AssertionError(f"the failing checkpoint unit of step {step} did not fail")


def actor_gone(handle, method: str = "ping") -> bool:
    """Whether the actor no longer answers ``method`` (no arguments): ray.kill returns before the
    actor is gone, and a call made meanwhile may still be served."""
    try:
        ray.get(getattr(handle, method).remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        pass  # still restarting, or going
    return False


def kill_gated_writer(gate: str) -> int:
    """SIGKILL the writer process that wrote its pid to ``{gate}.waiting`` (a write_fn waiting
    for the file ``gate``), once it has; its pid."""
    pid = wait_for(lambda: _written_pid(f"{gate}.waiting"), timeout_s=60, what="the writer to start the write")
    os.kill(pid, signal.SIGKILL)
    return pid


def _written_pid(path: str) -> int | None:
    """The pid in ``path``, or None until the file exists and holds it (it is created empty and
    then written: read in between, it is empty)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def status(monitor):
    return ray.get(monitor.status.remote())


def ledger_records(root: str, step: int) -> list[str]:
    """The monitor's ledger directories for ``step`` (one per attempt) under a local root."""
    base = f"{root}/.ckptd/pending"
    attempts = os.listdir(base) if os.path.isdir(base) else []
    return [f"{a}/{step}" for a in attempts if os.path.isdir(f"{base}/{a}/{step}")]


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    """Poll a condition that no event can signal (the monitor's internal state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@ray.remote(num_cpus=0)
class StateSaver:
    """A training-worker stand-in that saves through ckptd's own writers, on any storage."""

    def __init__(self, run: str, worker_id: str | None = None) -> None:
        monitor = ckptd.get_monitor(run)
        cfg = ray.get(monitor.worker_config.remote())
        self.root, self.options = cfg["root"], cfg["storage_options"]
        try:
            self.coord = ckptd.CheckpointCoordinator(monitor, worker_id=worker_id)
            self.error = None
        except ckptd.CheckpointConfigError as e:
            self.coord, self.error = None, str(e)

    def init_error(self) -> str | None:
        return self.error

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def save(self, step: int, name: str = "model", is_state_dict: bool = False) -> None:
        """Staged save of weights that depend on the step, with the default safetensors writer."""
        self.coord.save_state_async(name, weights(step), step, is_state_dict=is_state_dict)

    def save_untracked(self, step: int, name: str) -> None:
        """A save_fn that writes through fsspec and returns None: the coordinator finds its file."""
        url = f"{self.coord.step_dir(step)}/{name}.pt"

        def save_fn():
            import fsspec

            with fsspec.open(url, "wb", **self.options) as f:
                torch.save(weights(step), f)

        self.coord.save_async(name, save_fn, step)

    def register(self, step: int, count: int) -> None:
        self.coord.register(step, checkpoint_thread_count=count)

    def wait_all(self) -> str | None:
        return wait_all(self.coord)


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


class HalfWriter:
    """A save_fn that writes half of a file, then waits for :meth:`release` before writing the rest:
    a unit caught mid-write. Returns its path (as ckptd's writers do)."""

    CONTENT = b"half-and-the-rest"

    def __init__(self, path: str) -> None:
        self.path = path
        self.gate = Signal.remote()
        self.half_written = threading.Event()

    def __call__(self) -> list[str]:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "wb") as f:
            f.write(self.CONTENT[:4])
            f.flush()
            self.half_written.set()
            ray.get(self.gate.wait.remote())
            f.write(self.CONTENT[4:])
        return [self.path]

    def release(self) -> None:
        ray.get(self.gate.send.remote())


@ray.remote(num_cpus=0)
class Rollout:
    """A rollout worker: follows a run's weight versions through its own WeightSubscriber."""

    def __init__(self, run: str | None = None, name: str | None = None, **options) -> None:
        self.sub: ckptd.WeightSubscriber | None = None
        self.held: ckptd.Weights | None = None
        if run is not None:
            self.subscribe(run, name, **options)

    def subscribe(self, run: str, name: str, **options) -> None:
        """Follow ``run`` (an actor is reused across tests: starting one costs seconds)."""
        self.reset()
        self.sub = ckptd.WeightSubscriber(run, name=name, **options)

    def reset(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None
        if self.sub is not None:
            self.sub.close()
            self.sub = None

    def pid(self) -> int:
        return os.getpid()

    def mode(self) -> str:
        return self.sub.mode

    def wait(self, after: int | None = None, timeout_s: float | None = None) -> int | str:
        """The next version, or the error's type and message."""
        try:
            return self.sub.wait_for_version(after, timeout_s)
        except ckptd.CheckpointError as e:
            return f"{type(e).__name__}: {e}"

    async def follow(self, after: int | None, count: int) -> list[int]:
        """The next ``count`` versions, through the async iterator."""
        seen = []
        async for version in self.sub.versions(after):
            seen.append(version)
            if len(seen) == count:
                return seen
        return seen

    def published_at(self, version: int) -> float | None:
        return self.sub.published_at(version)

    def load(self, version: int | None = None, serve: bool = True) -> dict[str, torch.Tensor] | str:
        """Open, read verified, report serving; the tensors (copied), or the error."""
        try:
            with self.sub.open(version) as w:
                sd = {k: v.clone() for k, v in w.state_dict().items()}
            if serve:
                self.sub.report_serving(w.version)
            return sd
        except ckptd.CheckpointError as e:
            return f"{type(e).__name__}: {e}"

    def hold(self, version: int) -> bool:
        """Open a version and keep it open (pinned) without reading it yet."""
        self.held = self.sub.open(version)
        return self.held.pinned

    def read_held(self) -> dict[str, torch.Tensor] | str:
        try:
            return {k: v.clone() for k, v in self.held.state_dict().items()}
        except ckptd.CheckpointError as e:
            return f"{type(e).__name__}: {e}"

    def release_held(self) -> None:
        self.held.release()

    def report(self, version: int) -> None:
        self.sub.report_serving(version)


def commit_fsdp_step(job, monitor, units_per_rank: int = 2, timeout_s: float = 60) -> int:
    """Register an FSDPJob's current step (rank 0), wait for every rank's units, then for the commit."""
    step = ray.get(job.actors[0].register.remote(units_per_rank))
    job.call("wait_saves")
    ckptd.CheckpointCoordinator(monitor, worker_id="driver").wait_committed(step, timeout_s=timeout_s)
    return step


def differing(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ between two full states (or that only one has)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def read_manifest(root: str, step: int, kind: ckptd.Kind) -> Manifest | None:
    """The manifest of ``kind`` in ``step`` under a local root, or None if it has none."""
    path = os.path.join(ckptd.step_dir(root, step), MANIFESTS[kind])
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return Manifest.model_validate_json(f.read())


def assert_trackers_verified(root: str) -> dict[ckptd.Kind, int | None]:
    """Invariant 1: each tracker names a step whose manifest of that kind exists and verifies."""
    named = {}
    for kind, name in TRACKERS.items():
        path = os.path.join(root, name)
        step = parse_tracker(open(path).read()) if os.path.exists(path) else None
        named[kind] = step
        if step is not None:
            ckptd.verify(root, step)  # raises for a missing or damaged file
            # A full checkpoint holds the weights too: it moves the state-dict tracker as well.
            kinds = [kind] if kind is ckptd.Kind.CHECKPOINT else list(ckptd.Kind)
            assert any(os.path.exists(os.path.join(ckptd.step_dir(root, step), MANIFESTS[k])) for k in kinds)
    return named


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench_smoke(tmp_path, only: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m bench --smoke --only ONLY`` on the suite's Ray instance (its RAY_AUTH_MODE
    included: the bench joins it instead of starting one); its output and JSON results."""
    out = tmp_path / "results.json"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--only", only, "--json", str(out),
                           "--dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(r["samples"] and r["min"] <= r["median"] <= r["max"] for r in result["rows"])
    return proc, result


def in_thread(fn, timeout_s: float = 20.0):
    """Run ``fn`` in a daemon thread; ('ok', value), ('raised', exc) or ('hung', None) after timeout_s."""
    box: list = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box.append(("raised", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0] if box else ("hung", None)


class Gate:
    """A save_fn that is admitted, then waits for :meth:`open` before it writes its file."""

    def __init__(self, root: str, step: int, name: str) -> None:
        self.root, self.step, self.name = root, step, name
        self.entered = threading.Event()
        self._open = threading.Event()

    def __call__(self) -> list[str]:
        self.entered.set()
        assert self._open.wait(60)
        return write_step_file(self.root, self.step, self.name)

    def open(self) -> None:
        self._open.set()


#: The step whose commit the registrar attacks hold in flight (``hold_commit``).
HOLD_STEP = 1


def registrar_held(monitor, step: int = HOLD_STEP) -> bool:
    """Whether the commit of the holding ``step`` is still in flight, so a wait=False registration
    of that step queued by :func:`hold_registrar` has not been answered yet."""
    s = status(monitor).step(step)
    return s is not None and s.state.value == "committing"


def hold_commit(coord, monitor, root: str, seconds: float, step: int = HOLD_STEP) -> Callable[[], None]:
    """Start the commit of the holding ``step`` (one unit of ``coord``) and hold it in
    ``before_manifest`` until the returned function is called, or for ``seconds`` at most; return
    once it is in flight. On a monitor that tests share, each holds a step of its own block (a step
    commits once)."""
    gate = os.path.join(os.path.dirname(root.rstrip("/")), f"hold-{next(_holds)}")  # beside the root
    arm_in_monitor(monitor, "before_manifest", f"until:{seconds:g}:{gate}")
    try:
        coord.save_async("hold", lambda: write_step_file(root, step, "hold.bin"), step)
        coord.register(step, checkpoint_thread_count=1)
        wait_for(lambda: registrar_held(monitor, step), what="the commit of the holding step to start")
    finally:
        arm_in_monitor(monitor, "before_manifest", None)
    return lambda: open(gate, "w").close()


_holds = itertools.count()


def hold_registrar(coord, monitor, root: str, seconds: float = 8, step: int = HOLD_STEP) -> Callable[[], None]:
    """Hold ``coord``'s registrar until the returned function is called, or for ``seconds`` at
    most: every wait=False registration made after this is applied only once the commit of the
    holding ``step`` ends. The bound leaves room for the work a test checks while it is held on a
    loaded CI machine (3 s once did not); a test that is done looking releases it."""
    release = hold_commit(coord, monitor, root, seconds, step)
    coord.register(step, wait=False)  # adds nothing: answered once the commit has ended
    return release


def start_new_job(make_monitor, root: str, old_monitor, **opts):
    """Job 1's monitor is gone for good; job 2 starts one under the same run name on ``root``."""
    ray.kill(old_monitor, no_restart=True)
    wait_for(lambda: actor_gone(old_monitor), what="job 1's monitor to be gone")
    return make_monitor(root, **opts)


def assert_not_committed(coord, step: int, is_state_dict: bool = False) -> None:
    """``step`` is neither committed nor failed: wait_committed times out."""
    result = in_thread(lambda: coord.wait_committed(step, is_state_dict=is_state_dict, timeout_s=3), 30)
    assert result[0] == "raised" and isinstance(result[1], TimeoutError), result


def node_relay(run: str, coord: ckptd.CheckpointCoordinator, where: str | None = None):
    """The relay ``coord``'s reports go through: its node's, or the one named ``where``
    (``zone{N}``)."""
    from ckptd.protocol import relay_name

    return ray.get_actor(relay_name(run, coord._attempt_id, where or ray.get_runtime_context().get_node_id()))


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_state(want, got, path: str = "state") -> None:
    """``got`` is ``want`` exactly: container and value types, key types and order, tensor
    dtypes, shapes and bits, NaN and the sign of zero."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__}, not a tensor"
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), path
        assert _bits(got) == _bits(want), f"{path}: other bytes"
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__}, saved as {type(want).__name__}"
    if isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], f"{path}: keys"
        for k in want:
            assert_same_state(want[k], got[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length"
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert_same_state(a, b, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    elif isinstance(want, float):
        assert got == want and math.copysign(1, got) == math.copysign(1, want), path
    else:
        assert got == want, path


def unit_receipt(root: str, attempt: int, step: int, worker: str) -> dict | None:
    """The receipt that ``worker``'s unit of ``step`` wrote in ``attempt`` (its status), if any."""
    for p in glob.glob(f"{root}/.ckptd/pending/{attempt}/{step}/unit-*.json"):
        try:
            with open(p) as f:
                body = json.load(f)
        except (OSError, ValueError):
            continue
        if body["unit"]["worker"] == worker:
            return body
    return None


def end_unheard(monitor, root: str, step: int, worker: str, gate: str, actor, status: str,
                method: str = "ping", timeout_s: float = 60.0) -> None:
    """Let ``worker``'s unit of ``step``, held in ``actor``'s process until the file ``gate``
    exists (it creates ``{gate}.waiting`` first), end while the monitor is frozen (SIGSTOP): once
    its receipt says ``status``, its process is killed (its notification dies with it), then the
    monitor is SIGKILLed, and Ray's restart of it awaited. The restarted monitor knows of the
    unit's end only from its receipt. ``method``: one of ``actor``'s, to tell it is gone."""
    wait_for(lambda: os.path.exists(f"{gate}.waiting"), timeout_s=timeout_s, what="the unit to reach its gate")
    info = ray.get(monitor.ping.remote())
    assert (unit_receipt(root, info["attempt"], step, worker) or {}).get("status") == "started"
    os.kill(info["pid"], signal.SIGSTOP)
    try:
        open(gate, "w").close()
        wait_for(lambda: (unit_receipt(root, info["attempt"], step, worker) or {}).get("status") == status,
                 timeout_s=timeout_s, what=f"the unit's {status} receipt")
        ray.kill(actor)
        wait_for(lambda: actor_gone(actor, method), what="the unit's process to end")
    finally:
        os.kill(info["pid"], signal.SIGKILL)
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != info["pid"], timeout_s=timeout_s,
             what="the monitor to restart")


_env_blocks = itertools.count(1)


@dataclass
class Env:
    """A test's share of a monitor that a module's tests share: its steps are s + 1, s + 2, ...
    (blocks of 100 per test, so no two tests of the module save into the same step)."""

    root: str
    monitor: Any
    s: int

    @classmethod
    def next_block(cls, root: str, monitor: Any) -> Env:
        return cls(root, monitor, 100 * next(_env_blocks))

    def coord(self, **kwargs) -> ckptd.CheckpointCoordinator:
        return ckptd.CheckpointCoordinator(self.monitor, worker_id=f"w{self.s}", **kwargs)

    def step_dir(self, step: int) -> str:
        return ckptd.step_dir(self.root, step)


# -- state dicts whose files change (the session-23 attacks) ----------------------------------------


def write_file(path: str, data: bytes) -> list[str]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return [path]


def replace_same_size(path: str) -> None:
    """Other bytes of the same size: only a checksum tells."""
    write_file(path, os.urandom(os.path.getsize(path)))


def save_one(coord, step: int, rel: str, is_state_dict: bool) -> None:
    """Register ``step`` for one unit of the kind, and start that unit, writing ``rel``."""
    if is_state_dict:
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    else:
        coord.register(step, checkpoint_thread_count=1)
    path = f"{coord.step_dir(step)}/{rel}"
    coord.save_async(f"u{step}-{rel}", lambda: write_file(path, os.urandom(4096)), step, is_state_dict=is_state_dict)


def commit_one(coord, step: int, rel: str, is_state_dict: bool, timeout_s: float = 60.0) -> None:
    """One unit of ``step`` writing ``rel``; waits until the kind commits."""
    save_one(coord, step, rel, is_state_dict)
    coord.wait_committed(step, is_state_dict=is_state_dict, timeout_s=timeout_s)


def tracker_of(root: str, kind: ckptd.Kind) -> int | None:
    path = os.path.join(root, TRACKERS[kind])
    return parse_tracker(open(path).read()) if os.path.exists(path) else None


def stale_files(root: str, step: int, kind: ckptd.Kind) -> list[str] | None:
    """The files the manifest of ``kind`` alone lists with other bytes than storage holds; None
    when the step has no such manifest."""
    manifest = read_manifest(root, step, kind)
    if manifest is None:
        return None
    return changed_files(Storage(root), os.path.basename(ckptd.step_dir(root, step)), manifest.files)


def ledger_states(monitor, step: int) -> dict[str, str] | None:
    """The monitor's ledger state of each kind of ``step``."""

    def probe(self, step=step):
        rec = self._ledger.get(step)
        return None if rec is None else {k.value: rec[k].state.value for k in rec.kinds}

    return ray.get(monitor.__ray_call__.remote(probe))


def fail_full_checkpoint(coord, step: int) -> None:
    """Register the full checkpoint of ``step`` with one checkpoint unit, which fails."""
    coord.register(step, checkpoint_thread_count=1)
    coord.save_async("optim", disk_full, step)


def revoke_loops(monitor, step: int) -> list[int]:
    """The withdrawals of ``step``'s state dict in flight in the monitor: how often each has failed."""
    def loops(self):
        import gc
        import inspect as _inspect
        out = []
        for o in gc.get_objects():
            if (_inspect.iscoroutine(o) and o.cr_frame is not None and o.cr_code.co_name == "_withdraw_manifest"
                    and o.cr_frame.f_locals.get("rec") is not None and o.cr_frame.f_locals["rec"].step == step):
                out.append(o.cr_frame.f_locals.get("tries", 0))
        return sorted(out)
    return ray.get(monitor.__ray_call__.remote(loops))


MONITOR_WORK = ("_resume", "_resume_step", "withdraw_if_changed", "_changed_state_dict", "_revoke_state_dict",
                "_withdraw", "_withdraw_manifest", "_commit", "_record_failure")


def busy_coroutines(monitor) -> list[str]:
    """The start-up, withdrawal, commit and failure-record coroutines alive in the monitor."""
    def busy(self, names=MONITOR_WORK):
        import gc
        import inspect as _inspect
        return sorted(o.cr_code.co_name for o in gc.get_objects()
                      if _inspect.iscoroutine(o) and o.cr_frame is not None and o.cr_code.co_name in names)
    return ray.get(monitor.__ray_call__.remote(busy))


def what_the_trainer_finds(root: str) -> dict:
    """The state-dict tracker, and the files its step's manifest lists with other bytes than storage holds."""
    step = tracker_of(root, ckptd.Kind.STATE_DICT)
    return {"tracker": step, "stale": stale_files(root, step, ckptd.Kind.STATE_DICT) if step is not None else None}


class WindowMissed(RuntimeError):
    """An attack's race could not be set up this time (not the bug it guards against): a
    RuntimeError, not an AssertionError."""


def file_size_limit(monitor, limit: int | None) -> None:
    """Set (None: lift) the monitor process's RLIMIT_FSIZE: a write past it fails with EFBIG, as
    on a disk that is full for larger files (Python ignores SIGXFSZ)."""
    def set_it(_self, limit=limit):
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY if limit is None else limit,
                                                   resource.RLIM_INFINITY))
    ray.get(monitor.__ray_call__.remote(set_it))


def step_dirs(root: str) -> set[int]:
    """The steps whose directory (``global_step_N``) is under ``root``."""
    return {int(n.rsplit("_", 1)[1]) for n in os.listdir(root) if n.startswith("global_step_")}


def threads_held_here(name: str) -> int:
    """How many threads of this process wait in failpoint ``name``."""
    import sys
    held = 0
    for frame in sys._current_frames().values():
        while frame is not None and not (frame.f_code.co_name == "hit" and frame.f_locals.get("name") == name):
            frame = frame.f_back
        held += frame is not None
    return held


def held_here(name: str) -> bool:
    """Whether a thread of this process waits in failpoint ``name``."""
    return threads_held_here(name) > 0


def threads_held_at(monitor, name: str) -> int:
    """How many threads of the monitor's process wait in failpoint ``name``."""
    return ray.get(monitor.__ray_call__.remote(lambda _self, name=name: threads_held_here(name)))


def held_at(monitor, name: str) -> bool:
    """Whether a thread of the monitor's process waits in failpoint ``name``."""
    return threads_held_at(monitor, name) > 0


def two_state_dicts(make_monitor, root: str):
    """A monitor that keeps 2 state dicts (and every full checkpoint), with state dicts 1 and 2
    committed by worker "w": (monitor, coordinator). Committing 3 then deletes step 1."""
    monitor = make_monitor(root, max_state_dict_to_keep=2, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    return monitor, coord


def checkpoint_step1_while_deleted(make_monitor, root: str, gate: str, failpoint: str, while_held=None):
    """:func:`two_state_dicts`, then state dict 3, whose retention pass deletes step 1, held at
    ``failpoint`` (in the monitor) until the file ``gate`` exists. While it is held, a full
    checkpoint of step 1 is registered in the background and its unit (optim.bin) queued, and
    ``while_held(coord)`` runs; then the gate opens. Returns (monitor, coordinator, what
    ``while_held`` returned)."""
    monitor, coord = two_state_dicts(make_monitor, root)
    arm_in_monitor(monitor, failpoint, f"until:60:{gate}")
    try:
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, failpoint), what=f"the pass to be held at {failpoint}")
        d = coord.step_dir(1)
        coord.register(1, checkpoint_thread_count=1, wait=False)
        coord.save_async("optim", lambda: write_file(f"{d}/optim.bin", os.urandom(512)), 1)
        seen = while_held(coord) if while_held is not None else None
    finally:
        open(gate, "w").close()
    return monitor, coord, seen
