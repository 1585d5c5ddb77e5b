"""PreemptionGuard: SIGTERM sent to real training worker processes, a real Ray node drain, and
resume from the final step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.workers.fsdp_job import free_port

from .helpers import Signal, status, wait_for, write_step_file
from .preempt_job import build

pytestmark = pytest.mark.usefixtures("ray_local")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVERY = 5


class Job:
    """The ranks of one job (tests/integration/preempt_job.py), each a process of its own."""

    def __init__(self, tmp_path, run: str, world: int, *extra: str) -> None:
        self.trace = tmp_path / "trace"
        self.logs = tmp_path
        self.go_file = tmp_path / "go"
        ctx = ray.get_runtime_context()
        port = free_port()
        self.procs = []
        for rank in range(world):
            cmd = [sys.executable, "-m", "tests.integration.preempt_job", "--rank", str(rank), "--world", str(world),
                   "--port", str(port), "--gcs", ctx.gcs_address, "--namespace", ctx.namespace, "--run", run,
                   "--trace", str(self.trace), "--every", str(EVERY), "--go", str(self.go_file), *extra]
            out = open(tmp_path / f"rank{rank}.log", "wb")
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))

    def go(self) -> None:
        """Start training (the processes wait for this once they are connected)."""
        self.go_file.touch()

    def steps_done(self, rank: int) -> int:
        """The newest step ``rank`` has completed (its trace file exists)."""
        names = os.listdir(self.trace / f"rank{rank}") if (self.trace / f"rank{rank}").is_dir() else []
        return max((int(n.split(".")[0]) for n in names if n.endswith(".pt")), default=0)

    def trace_of(self, rank: int, step: int) -> dict:
        return torch.load(self.trace / f"rank{rank}" / f"{step}.pt", weights_only=True)

    def wait(self, timeout_s: float = 120) -> list[int]:
        try:
            return [p.wait(timeout_s) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not exit; logs: {self.log_text()}") from None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def log_of(self, rank: int) -> str:
        return (self.logs / f"rank{rank}.log").read_text(errors="replace")

    def log_text(self) -> str:
        return "\n".join(self.log_of(r) for r in range(len(self.procs)))


@pytest.fixture(scope="module")
def jobs(ray_local, tmp_path_factory):
    """The two jobs of the SIGTERM tests, their processes started together, before their monitors
    (they wait for them): importing torch and Ray takes each process seconds, and this way those
    seconds overlap. Each job trains once its test says go. name -> (monitor, root, job)."""
    specs = {"agree": (2, ()), "stall": (1, ("--grace", "1.5", "--stall-final"))}
    started = {}
    for name, (world, extra) in specs.items():
        base = tmp_path_factory.mktemp(name)
        run = f"{name}-{os.getpid()}"
        started[name] = (run, base, Job(base, run, world, *extra))
    out = {}
    try:
        for name, (run, base, job) in started.items():
            root = str(base / "ckpt")
            out[name] = (ckptd.start_monitor(root, run=run), root, job)
        yield out
    finally:
        for _, _, job in started.values():
            job.kill()
        for monitor, _, _ in out.values():
            ray.kill(monitor, no_restart=True)


def assert_resumes_exactly(root: str, job: Job, step: int, world: int) -> None:
    for rank in range(world):
        model, optimizer = build(seed=123)  # other weights: resume must restore them
        state = ckptd.resume(root, model=model, optimizer=optimizer, rank=rank, world_size=world, model_dir="model",
                             restore_rng=False)
        assert state.step == step
        expected = job.trace_of(rank, step)
        for k, v in expected["model"].items():
            assert torch.equal(model.state_dict()[k], v), (rank, k)
        momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
        assert [torch.equal(a, s["momentum_buffer"]) for a, s in
                zip(momentum, expected["optimizer"]["state"].values(), strict=True)] == [True, True]


def test_sigterm_to_one_rank_saves_the_current_step_on_every_rank_and_resume_restores_it(jobs):
    monitor, root, job = jobs["agree"]
    job.go()
    # Seen progress: a periodic checkpoint committed and two more steps trained.
    wait_for(lambda: (ckptd.latest_step(root) or 0) >= EVERY and job.steps_done(1) >= EVERY + 2, timeout_s=90,
             what="the job to commit its first periodic checkpoint and train on")
    at_signal = job.steps_done(1)
    job.procs[1].send_signal(signal.SIGTERM)  # only rank 1's node is preempted

    assert job.wait() == [ckptd.PREEMPTED_EXIT_CODE] * 2, job.log_text()
    final = job.steps_done(0)
    assert final == job.steps_done(1) >= at_signal  # the ranks agreed on the step they stopped at
    assert "preemption notice (signal: SIGTERM)" in job.log_of(1)
    assert "preemption notice (peer: " in job.log_of(0)  # rank 0 heard of it from rank 1's vote
    assert ckptd.latest_step(root) == final  # the final step, not the last periodic one
    ckptd.verify(root, final)
    st = status(monitor).step(final)
    assert st.committed and st.expected == 2 and len(st.started) == 2  # one unit per rank, none repeated
    assert_resumes_exactly(root, job, final, 2)


def test_a_final_save_that_misses_the_grace_deadline_exits_with_the_incomplete_code(jobs):
    _, root, job = jobs["stall"]
    job.go()
    wait_for(lambda: (ckptd.latest_step(root) or 0) >= EVERY and job.steps_done(0) >= EVERY + 1, timeout_s=90,
             what="the job to commit its first periodic checkpoint")
    job.procs[0].send_signal(signal.SIGTERM)
    t0 = time.monotonic()

    assert job.wait() == [ckptd.PREEMPTION_INCOMPLETE_EXIT_CODE], job.log_text()
    assert time.monotonic() - t0 < 30  # the stuck save thread did not hold the exit
    assert f"step {job.steps_done(0)} is NOT committed" in job.log_text()
    assert "the deadline passed: this rank's saves were still running" in job.log_text()
    final = job.steps_done(0)
    last_periodic = (final - 1) // EVERY * EVERY  # the newest save started before the notice
    wait_for(lambda: ckptd.latest_step(root) == last_periodic, what="the last periodic commit")
    assert last_periodic < final
    assert_resumes_exactly(root, job, last_periodic, 1)  # resume falls back to the last commit


class Saver:
    """A rank's save function whose unit waits at a gate until the test opens it."""

    def __init__(self, coord: ckptd.CheckpointCoordinator) -> None:
        self.coord = coord
        self.gate = Signal.remote()
        self.calls: list[int] = []

    def __call__(self, step: int) -> None:
        self.calls.append(step)
        path = f"{self.coord.step_dir(step)}/model.pt"
        gate = self.gate

        def write() -> list[str]:
            ray.get(gate.wait.remote())
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"w": torch.full((4,), float(step))}, path)
            return [path]

        self.coord.save_async("model", write, step)
        self.coord.register(step, checkpoint_thread_count=1)

    def open(self) -> None:
        ray.get(self.gate.send.remote())


def waiting_for_saves() -> bool:
    return any(t.name == "ckptd-preemption-wait" for t in threading.enumerate())


@pytest.fixture(scope="module")
def rank0(ray_local, tmp_path_factory):
    """A monitor with a mirror, and a coordinator: shared by the in-process tests (a monitor takes
    seconds to start); each test saves steps of its own."""
    base = tmp_path_factory.mktemp("in_process")
    root, mirror = str(base / "ckpt"), str(base / "mirror")
    monitor = ckptd.start_monitor(root, run=f"preempt-{os.getpid()}", mirror=mirror)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    yield monitor, coord, root, mirror
    coord.close()
    ray.kill(monitor, no_restart=True)


def test_sigterm_while_the_steps_save_is_in_flight_waits_for_it_instead_of_saving_again(rank0):
    monitor, coord, root, mirror = rank0
    save = Saver(coord)
    before = signal.getsignal(signal.SIGTERM)
    with ckptd.PreemptionGuard(coord, save, exit=False, watch_ray_drain=False) as guard:
        assert guard.at_step_boundary(3) is None  # no notice: nothing happens
        save(4)  # the loop's periodic save of step 4, still writing when the notice comes
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: guard.preempted, what="the SIGTERM handler")
        opener = threading.Thread(target=lambda: (wait_for(waiting_for_saves), save.open()))
        opener.start()
        outcome = guard.at_step_boundary(4)
        opener.join()
        assert guard.at_step_boundary(5) == outcome  # asked again: the same outcome, no new save
    assert signal.getsignal(signal.SIGTERM) == before  # close() put the previous handler back

    assert outcome.step == 4 and outcome.source == "signal" and outcome.detail == "SIGTERM"
    assert outcome.saved is False and outcome.committed and outcome.mirrored and outcome.error is None
    assert ckptd.verify(mirror, 4).step == 4  # the guard waited for the upload too
    assert outcome.exit_code == ckptd.PREEMPTED_EXIT_CODE
    assert save.calls == [4]  # save_fn was not called again
    st = status(monitor).step(4)
    assert st.committed and st.expected == 1 and len(st.started) == 1


def test_a_stuck_final_save_returns_the_incomplete_outcome_at_the_deadline(rank0):
    monitor, coord, root, _ = rank0
    save = Saver(coord)
    with ckptd.PreemptionGuard(coord, save, grace_s=1.0, exit=False, watch_ray_drain=False) as guard:
        guard.notify("test")
        t0 = time.monotonic()
        outcome = guard.at_step_boundary(7)
        took = time.monotonic() - t0
    assert save.calls == [7] and outcome.saved and outcome.source == "manual"
    assert not outcome.committed and not outcome.complete and "deadline" in outcome.error
    assert outcome.exit_code == ckptd.PREEMPTION_INCOMPLETE_EXIT_CODE
    assert took < 10
    assert not status(monitor).step(7).committed
    save.open()  # let the save end, so that the coordinator can close
    coord.wait_committed(7, timeout_s=60)


def _disk_full() -> None:
    raise OSError("disk full")


def test_the_outcome_names_every_earlier_failure_not_only_the_one_wait_all_raised(rank0):
    """A background registration refused (its step had failed) and a save that failed too: wait_all
    raises the first and names the other in a note; the outcome carries both."""
    monitor, coord, root, _ = rank0

    def save(step: int) -> None:  # registers in the background too: the failures reach wait_all
        coord.save_async("model", lambda: write_step_file(root, step, "model.bin"), step)
        coord.register(step, checkpoint_thread_count=1, wait=False)

    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(_disk_full, 20)
    coord.register(20, checkpoint_thread_count=1, wait=False)  # refused: step 20 failed
    coord.save_async("optim", _disk_full, 21)
    with ckptd.PreemptionGuard(coord, save, exit=False, watch_ray_drain=False, wait_for_mirror=False) as guard:
        guard.notify("test")
        outcome = guard.at_step_boundary(22)
    assert outcome.committed and outcome.complete
    assert "step 20" in outcome.error and "step 21" in outcome.error and "disk full" in outcome.error, outcome.error
    with pytest.raises(ckptd.CheckpointSaveError, match="step 21"):  # kept, as wait_all keeps it
        coord.wait_all()


def test_bad_arguments_and_signal_handlers_off_the_main_thread_are_refused(rank0):
    coord = rank0[1]
    before = signal.getsignal(signal.SIGTERM)
    for bad, match in [({"grace_s": 0}, "grace_s"), ({"signals": (12345,)}, "signals"),
                       ({"check_every": 0}, "check_every"), ({"drain_poll_s": -1}, "drain_poll_s")]:
        with pytest.raises(ckptd.CheckpointConfigError, match=match):
            ckptd.PreemptionGuard(coord, lambda step: None, watch_ray_drain=False, **bad)
    assert signal.getsignal(signal.SIGTERM) == before
    errors, guards = [], []

    def build_guards() -> None:
        try:
            ckptd.PreemptionGuard(coord, lambda step: None, watch_ray_drain=False)
        except ckptd.CheckpointConfigError as e:
            errors.append(str(e))
        guards.append(ckptd.PreemptionGuard(coord, lambda step: None, signals=(), watch_ray_drain=False))

    t = threading.Thread(target=build_guards)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in errors[0] and "signals=()" in errors[0]
    assert len(guards) == 1 and not guards[0].preempted


# -- a Ray node drain ---------------------------------------------------------------------------


@ray.remote(num_cpus=0, resources={"drained_node": 1})
class DrainedTrainer:
    """A training worker on the node that will be drained (a Ray actor: its methods run on the
    process's main thread)."""

    def __init__(self, run: str, progress) -> None:
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id="rank0")
        self.progress = progress
        self.weights = torch.zeros(4)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def train(self, grace_s: float) -> dict:
        def save(step: int) -> None:
            sd = {"w": self.weights.clone()}
            self.coord.save_state_async("model", sd, step)
            self.coord.register(step, checkpoint_thread_count=1)

        with ckptd.PreemptionGuard(self.coord, save, grace_s=grace_s, drain_poll_s=0.1, exit=False) as guard:
            for step in range(1, 100_000):
                self.weights += 1
                time.sleep(0.02)
                if step == 3:
                    ray.get(self.progress.send.remote())
                outcome = guard.at_step_boundary(step)
                if outcome is not None:
                    self.coord.close()
                    return outcome.model_dump(mode="json")
        raise AssertionError("never told to stop")


@pytest.fixture
def extra_node():
    """A second raylet in the test's Ray cluster, with a resource that pins actors to it."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(gcs_address=ray.get_runtime_context().gcs_address, num_cpus=1, num_gpus=0,
                       resources={"drained_node": 1}, object_store_memory=80 * 1024 * 1024, min_worker_port=0,
                       max_worker_port=0, include_log_monitor=False, node_manager_port=0)
    params.dashboard_agent_listen_port = None
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=False)
    yield node
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


def test_a_ray_drain_of_the_workers_node_triggers_the_final_save_before_rays_deadline(
        make_monitor, tmp_path, run_name, extra_node):
    from ray.core.generated import autoscaler_pb2

    root = str(tmp_path / "ckpt")
    make_monitor(root)
    progress = Signal.remote()
    trainer = DrainedTrainer.remote(run_name, progress)
    assert ray.get(trainer.node_id.remote()) == extra_node.node_id
    result = trainer.train.remote(grace_s=300.0)
    ray.get(progress.wait.remote())
    drain_deadline = time.time() + 60
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(extra_node.node_id,
                                   autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "test: spot instance reclaimed", int(drain_deadline * 1000))
    assert accepted, why

    outcome = ckptd.PreemptionOutcome(**ray.get(result, timeout=120))
    assert outcome.source == "ray_drain" and outcome.committed and outcome.saved and outcome.error is None
    assert abs(outcome.deadline - drain_deadline) < 1  # Ray's deadline, sooner than the 300 s grace
    assert ckptd.latest_step(root) == outcome.step >= 3
    ckptd.verify(root, outcome.step)
    saved = load_file(f"{ckptd.step_dir(root, outcome.step)}/model.safetensors")
    assert torch.equal(saved["w"], torch.full((4,), float(outcome.step)))  # that step's state
    ray.kill(trainer)
