"""The rollout side: weight subscribers woken by commits, verified loading, read leases against
retention, served versions in status. Real Ray actors as rollout workers, real files, the S3
server for the object-store case."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

import ckptd

from .helpers import HalfWriter, Rollout, failpoint_env, restart_monitor, status, wait_for, weights

pytestmark = pytest.mark.usefixtures("ray_local")

# The tests that need no monitor of their own share one (``env``), which keeps every version: no
# test's steps go while another test reads them.
SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}


@pytest.fixture(scope="module")
def idle_rollouts(ray_local):
    idle: list = []
    yield idle
    for actor in idle:
        ray.kill(actor)


@pytest.fixture
def rollouts(idle_rollouts):
    """Start a rollout worker following a run (reusing an idle actor: a new one costs seconds)."""
    used = []

    def make(run: str, name: str, **options):
        actor = idle_rollouts.pop() if idle_rollouts else Rollout.remote()
        ray.get(actor.subscribe.remote(run, name, **options))
        used.append(actor)
        return actor

    yield make
    for actor in used:
        try:
            ray.get(actor.reset.remote(), timeout=30)
            idle_rollouts.append(actor)
        except ray.exceptions.RayActorError:  # the test killed it
            pass


def publish(coord: ckptd.CheckpointCoordinator, step: int, wait: bool = True) -> dict[str, torch.Tensor]:
    """A trainer's weight publication: one state-dict unit, ``model.safetensors`` in the step."""
    tensors = weights(step)
    coord.save_state_async("model", tensors, step, is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    if wait:
        coord.wait_committed(step, is_state_dict=True, timeout_s=60)
    return tensors


def same(a: dict, b: dict) -> bool:
    return isinstance(a, dict) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rollout_worker_is_woken_by_each_commit_and_loads_it_verified(rollouts, make_monitor, run_name):
    coord = ckptd.CheckpointCoordinator(make_monitor(), worker_id="trainer")
    rollout = rollouts(run_name, "r0")
    assert ray.get(rollout.mode.remote()) == "monitor"
    woken = rollout.wait.remote(None, 60)
    published = publish(coord, 1)
    assert ray.get(woken) == 1
    assert ray.get(rollout.published_at.remote(1)) is not None
    assert same(ray.get(rollout.load.remote(1)), published)
    # The async iterator: the next version, each time.
    for step in (2, 3):
        followed = rollout.follow.remote(step - 1, 1)
        publish(coord, step)
        assert ray.get(followed) == [step]
    coord.close()


def test_a_rollout_never_sees_a_torn_failed_or_uncommitted_step(rollouts, make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rollout = rollouts(run_name, "r0")
    # Torn: step 1's file is half written.
    slow = HalfWriter(f"{ckptd.step_dir(root, 1)}/model.safetensors")
    coord.save_async("model", slow, 1, is_state_dict=True)
    coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    assert slow.half_written.wait(30)
    assert ray.get(rollout.wait.remote(None, 1.0)).startswith("CheckpointTimeoutError")
    assert "not committed" in ray.get(rollout.load.remote(1))
    slow.release()
    assert ray.get(rollout.wait.remote(None, 60)) == 1
    # Failed: step 2's unit raises.
    # Registered first: a registration after the failure reached the monitor would be refused.
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    coord.save_async("model", lambda: (_ for _ in ()).throw(OSError("disk full")), 2, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(2, is_state_dict=True, timeout_s=60)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_all()
    assert ray.get(rollout.wait.remote(1, 1.0)).startswith("CheckpointTimeoutError")
    assert "not committed" in ray.get(rollout.load.remote(2))
    # Out of order: 4 commits before 3; versions never go back.
    publish(coord, 4)
    assert ray.get(rollout.wait.remote(1, 60)) == 4
    publish(coord, 3)
    assert ray.get(rollout.wait.remote(4, 1.0)).startswith("CheckpointTimeoutError")
    assert status(monitor).trackers.state_dict == 4
    assert same(ray.get(rollout.load.remote(None)), weights(4))
    coord.close()


def test_a_pinned_step_survives_retention_while_a_slow_reader_reads_it(rollouts, make_monitor, run_name, tmp_path):
    """And goes once released: the release is sent without waiting, and the monitor deletes the
    lease's record after it dropped the lease (held 2 s here), so a status() without the pin
    followed by wait_retention() must find the retention pass the release made due."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2,
                           runtime_env=failpoint_env("before_lease_record_removed=delay:2"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rollout = rollouts(run_name, "slow-reader")
    publish(coord, 1)
    assert ray.get(rollout.hold.remote(1)) is True
    for step in (2, 3, 4):
        publish(coord, step)
    assert ray.get(monitor.wait_retention.remote(30))
    assert os.path.isdir(ckptd.step_dir(root, 1)) and not os.path.isdir(ckptd.step_dir(root, 2))
    assert [p.step for p in status(monitor).pins] == [1]
    assert status(monitor).subscriber("slow-reader").pins == [1]
    assert same(ray.get(rollout.read_held.remote()), weights(1))
    ray.get(rollout.release_held.remote())
    wait_for(lambda: not status(monitor).pins, what="the lease to be released")
    assert ray.get(monitor.wait_retention.remote(30))
    assert not os.path.isdir(ckptd.step_dir(root, 1))
    coord.close()


def test_the_pin_of_a_killed_reader_expires(rollouts, make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=1.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rollout = rollouts(run_name, "doomed")
    publish(coord, 1)
    assert ray.get(rollout.hold.remote(1))
    for step in (2, 3, 4):
        publish(coord, step)
    assert ray.get(monitor.wait_retention.remote(30))
    assert os.path.isdir(ckptd.step_dir(root, 1))
    ray.kill(rollout)
    wait_for(lambda: not status(monitor).pins, timeout_s=20, what="the dead reader's lease to expire")
    assert ray.get(monitor.wait_retention.remote(30))
    assert not os.path.isdir(ckptd.step_dir(root, 1))
    assert not status(monitor).subscriber("doomed").live
    coord.close()


def test_a_subscriber_waiting_across_a_monitor_kill_gets_the_next_version(rollouts, make_monitor, run_name):
    monitor = make_monitor()
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rollout = rollouts(run_name, "r0")
    publish(coord, 1)
    woken = rollout.wait.remote(1, 120)
    restart_monitor(monitor, how="sigkill")
    publish(coord, 2)
    assert ray.get(woken) == 2
    assert same(ray.get(rollout.load.remote(2)), weights(2))
    coord.close()


def test_a_lease_survives_a_monitor_restart(rollouts, make_monitor, run_name, tmp_path):
    """Leases are recorded under the root: the restarted monitor restores them before its first
    retention pass, and the subscriber's renewals keep them."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=2.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rollout = rollouts(run_name, "r0")
    publish(coord, 1)
    assert ray.get(rollout.hold.remote(1))
    restart_monitor(monitor, how="sigkill")
    assert [p.step for p in status(monitor).pins] == [1]
    for step in (2, 3, 4, 5):
        publish(coord, step)
    assert ray.get(monitor.wait_retention.remote(30))
    assert os.path.isdir(ckptd.step_dir(root, 1)) and not os.path.isdir(ckptd.step_dir(root, 3))
    assert same(ray.get(rollout.read_held.remote()), weights(1))
    ray.get(rollout.release_held.remote())
    wait_for(lambda: not os.listdir(f"{root}/.ckptd/leases"), what="the lease record to go")
    coord.close()


def test_a_damaged_file_is_refused_naming_it_and_the_model_is_left_alone(env, shared_run):
    coord = env.coord()
    step = env.s + 1
    publish(coord, step)
    path = f"{env.step_dir(step)}/model.safetensors"
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    sub = ckptd.WeightSubscriber(shared_run, name="driver")
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(64, 64))
    model.b = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ckptd.CorruptCheckpointError, match="model.safetensors: checksum mismatch"):
        with sub.open(step) as w:
            w.load_into(model)
    assert not model.w.any() and not model.b.any()
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ckptd.CorruptCheckpointError, match="model.safetensors: truncated"):
        with sub.open(step) as w:
            w.state_dict()
    sub.close()
    coord.close()


def test_served_lag_in_status_matches_what_the_rollout_reported(rollouts, make_monitor, run_name):
    monitor = make_monitor()
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rollout = rollouts(run_name, "r0")
    publish(coord, 1)
    before = time.time()
    assert isinstance(ray.get(rollout.load.remote(1)), dict)  # reports serving 1
    after = time.time()
    s = status(monitor).subscriber("r0")
    assert (s.serving, s.lag_steps, s.lag_s) == (1, 0, 0.0) and before <= s.serving_since <= after
    published_2 = time.time()
    publish(coord, 2)
    publish(coord, 3)
    s = status(monitor).subscriber("r0")
    t1 = time.time()
    assert s.serving == 1 and s.lag_steps == 2 and s.live
    # Counted from step 2's publication, which happened after published_2.
    assert 0 <= s.lag_s <= t1 - published_2
    ray.get(rollout.report.remote(3))
    s = status(monitor).subscriber("r0")
    assert (s.serving, s.lag_steps, s.lag_s) == (3, 0, 0.0)
    coord.close()


def test_retention_keeps_the_version_a_live_subscriber_serves(rollouts, make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, keep_served=True)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rollout = rollouts(run_name, "r0")
    publish(coord, 1)
    assert isinstance(ray.get(rollout.load.remote(1)), dict)
    for step in (2, 3, 4):
        publish(coord, step)
    assert ray.get(monitor.wait_retention.remote(30))
    assert os.path.isdir(ckptd.step_dir(root, 1)) and not os.path.isdir(ckptd.step_dir(root, 2))
    ray.get(rollout.report.remote(4))
    publish(coord, 5)
    assert ray.get(monitor.wait_retention.remote(30))
    assert not os.path.isdir(ckptd.step_dir(root, 1))
    coord.close()


def test_without_a_monitor_a_subscriber_reads_the_committed_state_of_an_s3_root(make_monitor, s3_root):
    url, options = s3_root
    coord = ckptd.CheckpointCoordinator(make_monitor(url, storage_options=options), worker_id="trainer")
    sub = ckptd.WeightSubscriber("no-such-run", root=url, storage_options=options, poll_interval_s=0.05)
    assert sub.mode == "storage"
    with pytest.raises(ckptd.CheckpointTimeoutError):
        sub.wait_for_version(None, timeout_s=0.2)
    publish(coord, 1)
    assert sub.wait_for_version(None, timeout_s=30) == 1
    with sub.open(1) as w:
        assert not w.pinned and same(w.state_dict(), weights(1))
    sub.close()
    coord.close()


def test_a_subscriber_of_the_mirror_reads_it_directly(make_monitor, run_name, s3_root, tmp_path):
    url, options = s3_root
    monitor = ckptd.start_monitor(str(tmp_path / "ckpt"), run=run_name, mirror={"url": url, "state_dicts": True},
                                  mirror_storage_options=options)
    try:
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
        sub = ckptd.WeightSubscriber(run_name, root=url, storage_options=options, poll_interval_s=0.05)
        assert sub.mode == "storage"  # the monitor serves the local root, not this one
        publish(coord, 1)
        coord.wait_mirrored(1, timeout_s=60)
        assert sub.wait_for_version(None, timeout_s=30) == 1
        with sub.open() as w:
            assert w.version == 1 and same(w.state_dict(), weights(1))
        sub.close()
        coord.close()
    finally:
        ray.kill(monitor, no_restart=True)


def test_a_subscriber_in_a_process_without_ray_reads_the_root_and_starts_no_ray(make_monitor, run_name, tmp_path):
    """A plain process (no ``ray.init``) subscribes by root: it reads the committed state there,
    and constructing the subscriber starts no local Ray (asking Ray where the process runs did)."""
    import subprocess
    import sys

    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="trainer")
    publish(coord, 3)
    coord.close()
    code = ("import ray, ckptd\n"
            f"sub = ckptd.WeightSubscriber(run={run_name!r}, name='plain', root={root!r})\n"
            "print('ray started:', ray.is_initialized())\n"
            "print('version:', sub.wait_for_version(timeout_s=30))\n"
            "print('ray started:', ray.is_initialized())\n"
            "sub.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["ray started: False", "version: 3", "ray started: False"], proc.stdout


def test_a_subscriber_needs_a_monitor_or_a_root(ray_local):
    with pytest.raises(ckptd.CheckpointError, match="pass root="):
        ckptd.WeightSubscriber("nobody-runs-this")
    with pytest.raises(ckptd.CheckpointConfigError, match="kind"):
        ckptd.WeightSubscriber("nobody", root="/tmp", kind="weights")


def test_each_format_loads_into_a_model_whose_outputs_equal_the_trainers(env, shared_run):
    """HF safetensors (one file, and sharded with an index), ckptd shards of 2 ranks, a LoRA adapter,
    HF's pytorch_model.bin and a plain torch.save: each published as a version, loaded by a
    subscriber into a fresh model (other seed), which then computes what the trainer computes."""
    peft = pytest.importorskip("peft")
    from ckptd.workers import save_hf_model, save_lora_adapter, save_sharded, shard_dim0, snapshot
    from tests import tiny

    coords = [ckptd.CheckpointCoordinator(env.monitor, worker_id=f"rank{r}-{env.s}") for r in range(2)]
    trainer = tiny.llama(seed=0)
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                  init_lora_weights=False)
    lora_trainer = peft.get_peft_model(tiny.llama(seed=0), lora_config)
    sd = snapshot(trainer.state_dict())

    def save(step: int, fn, rank: int = 0) -> None:
        coords[rank].save_async("weights", fn, step, is_state_dict=True)

    def pickle_file(name: str):
        def fn(step_dir: str) -> list[str]:
            os.makedirs(f"{step_dir}/actor", exist_ok=True)
            torch.save(sd, f"{step_dir}/actor/{name}")
            return [f"{step_dir}/actor/{name}"]
        return fn

    formats = {  # env.s + k -> (format, writer); k also seeds the fresh model
        1: ("safetensors", lambda d: save_hf_model(f"{d}/actor", sd, trainer.config)),
        2: ("safetensors", lambda d: save_hf_model(f"{d}/actor", sd, trainer.config, max_shard_size="20KB")),
        3: ("sharded", None),
        4: ("lora", lambda d: save_lora_adapter(f"{d}/actor", snapshot(lora_trainer.state_dict()),
                                                lora_trainer.peft_config["default"])),
        5: ("torch", pickle_file("pytorch_model.bin")),
        6: ("torch", pickle_file("model.pt")),
    }
    for k, (_fmt, fn) in formats.items():
        step = env.s + k
        out = env.step_dir(step)
        if fn is None:
            for r in range(2):
                shards = shard_dim0(sd, r, 2)
                save(step, lambda r=r, shards=shards, out=out: save_sharded(f"{out}/actor", shards, rank=r,
                                                                             world_size=2), rank=r)
        else:
            save(step, lambda fn=fn, out=out: fn(out))
        coords[0].register(step, is_state_dict=True, state_dict_thread_count=2 if fn is None else 1)
        coords[0].wait_committed(step, is_state_dict=True, timeout_s=60)

    x = torch.randint(0, 64, (2, 8))
    sub = ckptd.WeightSubscriber(shared_run, name="checker")
    for k, (fmt, _fn) in formats.items():
        step = env.s + k
        if fmt == "lora":  # the trainer's base model, with other adapter weights
            base = tiny.llama(seed=0)
            torch.manual_seed(k + 10)
            fresh = peft.get_peft_model(base, lora_config)
        else:
            fresh = tiny.llama(seed=k + 10)
        expected = lora_trainer if fmt == "lora" else trainer
        with sub.open(step) as w:
            assert w.format == fmt and w.pinned
            before = fresh(x).logits
            w.load_into(fresh)
        with torch.no_grad():
            assert torch.equal(fresh(x).logits, expected(x).logits), (step, fmt)
            assert not torch.equal(before, fresh(x).logits), (step, fmt)
    sub.close()
    for coord in coords:
        coord.close()


def test_ckptd_status_shows_what_each_subscriber_serves(rollouts, make_monitor, run_name):
    import json
    import subprocess
    import sys

    coord = ckptd.CheckpointCoordinator(make_monitor(), worker_id="trainer")
    rollout = rollouts(run_name, "rollout-7")
    publish(coord, 1)
    assert isinstance(ray.get(rollout.load.remote(1)), dict)
    publish(coord, 2)
    address = ray.get_runtime_context().gcs_address

    def cli(*extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "ckptd", "status", "--address", address, "--run", run_name,
                               *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    shown = json.loads(cli("--json"))
    sub = next(s for s in shown["subscribers"] if s["name"] == "rollout-7")
    assert (sub["serving"], sub["lag_steps"], sub["live"]) == (1, 1, True) and sub["lag_s"] >= 0
    text = cli()
    row = next(line for line in text.splitlines() if line.startswith("rollout-7"))
    assert row.split()[1:3] == ["state_dict", "1"] and "latest state dict 2" in text
    coord.close()


def test_close_wakes_a_subscriber_that_is_waiting(make_monitor, run_name):
    import threading

    make_monitor()
    sub = ckptd.WeightSubscriber(run_name, name="closing")
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(_error_of(sub.wait_for_version, None, 120)))
    waiter.start()
    wait_for(lambda: status(ckptd.get_monitor(run_name)).subscriber("closing") is not None, what="the subscriber")
    sub.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "closed while it waited" in outcome[0]


def _error_of(fn, *args) -> str:
    try:
        return repr(fn(*args))
    except ckptd.CheckpointError as e:
        return str(e)
