"""Adversarial tests of weight publication: leases against retention (racing passes, monitor
kills, several readers), versions that never go back or show an uncommitted step, loading that
never yields bytes the manifest does not vouch for, expiry, a monitor killed for good, status.

Real Ray, real files, real monitors; faults come from named failpoints, SIGKILL and
``ray.kill``. Each violation these tests found was fixed; the tests that found them stay as
regression tests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import random
import re
import struct
import threading
import time
from types import SimpleNamespace

import pytest
import ray
import torch

import ckptd
from ckptd.config import Kind
from ckptd.layout import is_committed
from ckptd.storage import Storage
from ckptd.workers import save_hf_model, save_sharded, shard_dim0

from .helpers import failpoint_env, ledger_records, restart_monitor, status, wait_for, weights

pytestmark = pytest.mark.usefixtures("ray_local")

CONFIG = {"model_type": "llama"}


# -- helpers ---------------------------------------------------------------------------------------


def publish(coord: ckptd.CheckpointCoordinator, step: int) -> dict[str, torch.Tensor]:
    """One state-dict unit writing ``model.safetensors`` of ``weights(step)``; waits for the commit."""
    tensors = weights(step)
    coord.save_state_async("model", tensors, step, is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(step, is_state_dict=True, timeout_s=60)
    return tensors


def commit(coord: ckptd.CheckpointCoordinator, step: int, *fns) -> None:
    """Commit ``step``'s state dict with one unit per writer ``fn(step_dir) -> [paths]``."""
    out = coord.step_dir(step)
    for i, fn in enumerate(fns):
        coord.save_async(f"w{i}", lambda fn=fn: fn(out), step, is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=len(fns))
    coord.wait_committed(step, is_state_dict=True, timeout_s=60)


def same(a, b) -> bool:
    return isinstance(a, dict) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def zero_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(64, 64))
    model.b = torch.nn.Parameter(torch.zeros(64))
    return model


def unchanged(model: torch.nn.Module) -> bool:
    return not any(p.any() for p in model.parameters())


def step_exists(root: str, step: int) -> bool:
    return os.path.isdir(ckptd.step_dir(root, step))


@ray.remote(num_cpus=0)
class Reader:
    """A rollout worker in its own process (for the tests that kill it)."""

    def __init__(self, run: str, name: str, **options) -> None:
        self.sub = ckptd.WeightSubscriber(run, name=name, **options)
        self.held: ckptd.Weights | None = None

    def hold(self, version: int) -> bool:
        self.held = self.sub.open(version)
        return self.held.pinned

    def pid(self) -> int:
        return os.getpid()


# -- I3: loading never yields bytes the manifest does not vouch for -------------------------------


@pytest.fixture(scope="module")
def loading_monitor(ray_local, tmp_path_factory):
    """One monitor (keeping every step) for the loading tests, which take steps of their own: a
    monitor start costs seconds."""
    root = str(tmp_path_factory.mktemp("loading") / "ckpt")
    run = f"loading-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run, max_state_dict_to_keep=None)
    yield root, run, itertools.count(1)
    ray.kill(monitor, no_restart=True)


@pytest.fixture
def lab(loading_monitor, run_name):
    """The shared loading monitor, with this test's own coordinator and subscriber."""
    root, run, steps = loading_monitor
    coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id=run_name)
    sub = ckptd.WeightSubscriber(run, name=run_name)
    yield SimpleNamespace(root=root, coord=coord, sub=sub, step=lambda: next(steps))
    sub.close()
    coord.close()


def _hf(d: str, sd: dict) -> list:
    return save_hf_model(d, sd, CONFIG)


def _hf_index(d: str, sd: dict) -> list:
    return save_hf_model(d, sd, CONFIG, max_shard_size="10KB")


def _torch(d: str, sd: dict) -> list:
    os.makedirs(d, exist_ok=True)
    torch.save(sd, f"{d}/model.pt")
    return [f"{d}/model.pt"]


def _sharded(rank: int):
    return lambda d, sd: save_sharded(d, shard_dim0(sd, rank, 2), rank=rank, world_size=2)


FORMATS = {  # format -> (writers, the files to damage, what WeightSet.format says)
    "safetensors": ((_hf,), ("model.safetensors",), "safetensors"),
    "hf-index": ((_hf_index,), ("model.safetensors.index.json", "model-00002-of-00002.safetensors"), "safetensors"),
    "sharded": ((_sharded(0), _sharded(1)), ("sharded_metadata.json", "shard-00001.safetensors"), "sharded"),
    "torch": ((_torch,), ("model.pt",), "torch"),
}


def _damage(path: str, how: str, other: str) -> str | None:
    """Damage a committed file; the words the refusal must contain (None: the bytes are the same,
    e.g. two steps' identical index files, and the load must succeed)."""
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        return "checksum mismatch"
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
        return "truncated"
    if how == "extend":
        with open(path, "ab") as f:
            f.write(b"\0")
        return "longer than written"
    if how == "other-step":  # the same file of another committed step, renamed over it
        with open(other, "rb") as src, open(path, "rb") as mine:
            identical = src.read() == mine.read()
        tmp = f"{path}.tmp"
        with open(other, "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        os.replace(tmp, path)
        return None if identical else "checksum mismatch"
    if how == "delete":
        os.remove(path)
        return "missing"
    raise ValueError(how)


DAMAGES = ("flip", "truncate", "extend", "other-step", "delete")


def test_every_damaged_file_of_every_format_is_refused_naming_it_and_the_model_is_untouched(lab):
    root, coord, sub = lab.root, lab.coord, lab.sub
    cases = []
    for fmt, (writers, files, _) in FORMATS.items():
        for name in files:
            for how in DAMAGES:
                if fmt == "torch" and how == "delete":
                    continue  # see test_a_deleted_pickle_is_refused_as_corrupt
                step = lab.step()
                cases.append((step, fmt, name, how))
                commit(coord, step, *[lambda d, w=w, s=step: w(d, weights(s)) for w in writers])
    # A reference of each format, kept intact: the source of "other-step" files.
    refs = {}
    for fmt, (writers, _, _) in FORMATS.items():
        step = refs[fmt] = lab.step()
        commit(coord, step, *[lambda d, w=w, s=step: w(d, weights(s)) for w in writers])
    for fmt, ref in refs.items():
        with sub.open(ref) as w:
            model = zero_model()
            w.load_into(model)
            assert w.format == FORMATS[fmt][2] and same(dict(model.state_dict()), weights(ref)), fmt
    for step, fmt, name, how in cases:
        path = f"{ckptd.step_dir(root, step)}/{name}"
        words = _damage(path, how, f"{ckptd.step_dir(root, refs[fmt])}/{name}")
        model = zero_model()
        if words is None:
            with sub.open(step) as w:
                w.load_into(model)
            assert same(dict(model.state_dict()), weights(step)), (fmt, name, how)
            continue
        with pytest.raises(ckptd.CorruptCheckpointError) as raised:
            with sub.open(step) as w:
                w.load_into(model)
        assert name in str(raised.value) and words in str(raised.value), (fmt, name, how, str(raised.value))
        assert unchanged(model), (fmt, name, how)
        with pytest.raises(ckptd.CorruptCheckpointError, match=re.escape(name)):
            with sub.open(step) as w:
                w.state_dict()


def test_an_unlisted_file_beside_the_weights_changes_nothing(lab):
    """Files the manifest does not list (another format's weights, a stray index) are never read:
    what is loaded is what the manifest lists."""
    step = lab.step()
    commit(lab.coord, step, lambda d: _hf(d, weights(1)))
    d = ckptd.step_dir(lab.root, step)
    save_sharded(d, weights(2), rank=0, world_size=1)  # unlisted sharded weights of other values
    _torch(d, weights(3))
    with open(f"{d}/model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"w": "shard-00000.safetensors", "b": "shard-00000.safetensors"}}, f)
    with lab.sub.open(step) as w:
        model = zero_model()
        w.load_into(model)
        assert w.format == "safetensors" and w.files == ["model.safetensors"]
    assert same(dict(model.state_dict()), weights(1))


class Payload:
    """Unpickling this creates ``marker``: evidence that a loader ran code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_needs_objects_is_refused_and_runs_nothing(lab, tmp_path):
    """A .pt file whose pickle needs an object (here: one whose unpickling creates a file), in
    torch's zip and legacy formats and as a bare pickle."""
    marker = str(tmp_path / "pwned")
    steps = {}
    for how in ("zip", "legacy", "raw-pickle"):

        def write(d: str, how=how) -> list[str]:
            os.makedirs(d, exist_ok=True)
            obj = {"w": torch.ones(2), "x": Payload(marker)}
            path = f"{d}/model.pt"
            if how == "raw-pickle":
                with open(path, "wb") as f:
                    pickle.dump(obj, f)
            else:
                torch.save(obj, path, _use_new_zipfile_serialization=how == "zip")
            return [path]

        steps[how] = lab.step()
        commit(lab.coord, steps[how], write)
    assert not os.path.exists(marker)
    for how, step in steps.items():
        model = zero_model()
        with pytest.raises(ckptd.UnsafeCheckpointError, match="model.pt"):
            with lab.sub.open(step) as w:
                w.load_into(model)
        assert not os.path.exists(marker) and unchanged(model), how


def test_a_step_deleted_by_retention_while_an_unpinned_reader_reads_it_is_reported_as_deleted(
        make_monitor, run_name, tmp_path):
    """A reader of the root without a monitor holds no lease: retention may delete the step
    between open() and the read, which must say so (not hand back a half-read step)."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root, max_state_dict_to_keep=2), worker_id="trainer")
    publish(coord, 1)
    sub = ckptd.WeightSubscriber("nobody-runs-this", root=root)
    assert sub.mode == "storage"
    w = sub.open(1)
    assert not w.pinned
    publish(coord, 2)
    publish(coord, 3)
    wait_for(lambda: not step_exists(root, 1), what="retention to delete step 1")
    with pytest.raises(ckptd.CheckpointError, match="not committed|deleted while it was read"):
        w.state_dict()
    sub.close()
    coord.close()


def test_a_deleted_pickle_is_refused_as_corrupt(lab):
    step = lab.step()
    commit(lab.coord, step, lambda d: _torch(d, weights(1)))
    os.remove(f"{ckptd.step_dir(lab.root, step)}/model.pt")
    with pytest.raises(ckptd.CorruptCheckpointError, match="model.pt: missing"):
        with lab.sub.open(step) as w:
            w.state_dict()


def test_sharded_pieces_that_overlap_and_leave_a_gap_are_refused(lab):
    sd = weights(1)
    # A rank-mapping bug: rank 1 writes rank 0's rows again; rows 32..63 of w (and of b) are nowhere.
    step = lab.step()
    commit(lab.coord, step, lambda d: save_sharded(d, shard_dim0(sd, 0, 2), rank=0, world_size=2),
           lambda d: save_sharded(d, shard_dim0(sd, 0, 2), rank=1, world_size=2))
    model = zero_model()
    with pytest.raises(ckptd.CorruptCheckpointError, match="do not cover"):
        with lab.sub.open(step) as w:
            w.load_into(model)
    assert unchanged(model)


def _safetensors(header: dict | list, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


LYING_HEADERS = {
    # Two tensors claim the same bytes (the safetensors library refuses such a file).
    "overlapping-ranges": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    # A float32 tensor starting at byte 1 of the data (the library refuses it).
    "misaligned-range": ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}}, b"\0" * 8),
    # A negative dimension with a reversed range: -4 bytes from 8 to 4.
    "negative-shape": ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [8, 4]}}, b"\0" * 8),
    # Not a JSON object at all.
    "list-header": ([1, 2], b""),
}


def test_a_committed_safetensors_file_whose_header_lies_is_refused_as_corrupt(lab):
    """The writer itself wrote a bad file (so its CRC matches the manifest): the reader must still
    refuse it as corrupt, naming it."""
    steps = {}
    for lie, (header, data) in sorted(LYING_HEADERS.items()):
        raw = _safetensors(header, data)

        def write(d: str, raw=raw) -> list[str]:
            os.makedirs(d, exist_ok=True)
            with open(f"{d}/model.safetensors", "wb") as f:
                f.write(raw)
            return [f"{d}/model.safetensors"]

        steps[lie] = lab.step()
        commit(lab.coord, steps[lie], write)
    accepted = []
    for lie, step in steps.items():
        try:
            with lab.sub.open(step) as w:
                w.state_dict()
            accepted.append(f"{lie}: loaded")
        except ckptd.CorruptCheckpointError as e:
            assert "model.safetensors" in str(e)
        except Exception as e:  # the wrong error is a failure too, not a crash of the test
            accepted.append(f"{lie}: {type(e).__name__}: {e}")
    assert not accepted, accepted


def test_strict_load_refuses_a_checkpoint_missing_a_parameter_that_shares_a_flat_buffer(lab):
    step = lab.step()
    lab.coord.save_state_async("model", {"w": weights(1)["w"]}, step, is_state_dict=True)  # no "b"
    lab.coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    lab.coord.wait_committed(step, is_state_dict=True, timeout_s=60)
    flat = torch.zeros(64 * 64 + 64)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(flat[: 64 * 64].view(64, 64))
    model.b = torch.nn.Parameter(flat[64 * 64:])
    with pytest.raises(ckptd.CheckpointConfigError, match="missing"):
        with lab.sub.open(step) as w:
            w.load_into(model, strict=True)
    assert unchanged(model)


def test_a_refused_lora_load_leaves_the_adapter_as_it_was(lab):
    peft = pytest.importorskip("peft")
    from ckptd.workers import save_lora_adapter, snapshot
    from tests import tiny

    def lora(targets: list[str], seed: int):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                 init_lora_weights=False)
        return peft.get_peft_model(tiny.llama(seed=0), config)

    trainer = lora(["q_proj", "k_proj", "v_proj"], seed=1)
    step = lab.step()
    commit(lab.coord, step,
           lambda d: save_lora_adapter(d, snapshot(trainer.state_dict()), trainer.peft_config["default"]))
    model = lora(["q_proj", "v_proj"], seed=2)  # no place for k_proj's adapter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckptd.CheckpointConfigError, match="k_proj"):
        with lab.sub.open(step) as w:
            w.load_into(model)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, changed[:3]


# -- I1: a step is never deleted while a live lease holds it --------------------------------------


def churn(sub: ckptd.WeightSubscriber, stop_at: int, seed: int) -> dict:
    """Open recent and older versions at random until ``stop_at`` is committed. A pinned handle must
    read whole and equal ``weights(version)``; an unpinned one (opened while the subscriber had lost
    the monitor) may find its step deleted, but must never yield other weights."""
    rng = random.Random(seed)
    opened, unpinned, refused, problems = 0, 0, 0, []
    while True:
        newest = sub.latest()
        version = max(1, newest - rng.randrange(4))
        try:
            w = sub.open(version)
        except ckptd.CheckpointError:
            refused += 1  # deleted before the pin: allowed
            continue
        with w:
            pinned = w.pinned
            unpinned += not pinned
            time.sleep(rng.random() * 0.02)  # not a synchronisation: lets retention passes run meanwhile
            try:
                if not same(w.state_dict(), weights(version)):
                    problems.append(f"{version}: other weights")
            except ckptd.CheckpointError as e:
                if pinned or isinstance(e, ckptd.CorruptCheckpointError):
                    problems.append(f"{version} (pinned={pinned}): {type(e).__name__}: {e}")
        opened += 1
        if newest >= stop_at:
            return {"opened": opened, "unpinned": unpinned, "refused": refused, "problems": problems}


def test_pins_racing_fast_commits_retention_and_a_restart_never_lose_a_pinned_step(make_monitor, run_name,
                                                                                  tmp_path):
    """Three readers open recent and older versions at random while the trainer commits 29 more
    with max_state_dict_to_keep=2, and the monitor is SIGKILLed in the middle: every open is
    refused or reads the whole step."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=1.5)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    publish(coord, 1)
    subs = [ckptd.WeightSubscriber(run_name, name=f"churn{i}") for i in range(3)]
    last, results = 30, {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: churn(subs[i], last, seed=i)}))
               for i in range(3)]
    for t in threads:
        t.start()
    for step in range(2, last + 1):
        publish(coord, step)
        if step == 12:
            restart_monitor(monitor, how="sigkill")
    for t in threads:
        t.join(120)
    assert [results[i]["problems"] for i in range(3)] == [[], [], []], results
    assert sum(results[i]["opened"] - results[i]["unpinned"] for i in range(3)) > 10, results
    wait_for(lambda: not status(monitor).pins, what="every lease to be released")
    # Not wait_retention: it answers "idle" while the post-restart hold still defers a pass.
    wait_for(lambda: [s for s in range(1, last + 1) if step_exists(root, s)] == [last - 1, last],
             what="retention to keep only the newest two")
    for sub in subs:
        sub.close()
    coord.close()


def test_a_step_claimed_by_retention_refuses_a_pin_and_a_pinned_neighbour_survives(make_monitor, run_name,
                                                                                   tmp_path):
    """Retention has claimed step 1 (slow storage holds it before the rename): a pin on it is
    refused, not granted on a step about to vanish; a pin on step 2 taken meanwhile keeps step 2."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2,
                           runtime_env=failpoint_env("before_step_delete=delay:1"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    publish(coord, 1)
    publish(coord, 2)
    assert ledger_records(root, 1)
    sub = ckptd.WeightSubscriber(run_name, name="late")
    publish(coord, 3)
    # Step 1's ledger records go right after the claim, before the (delayed) deletion.
    wait_for(lambda: not ledger_records(root, 1), what="retention to claim step 1")
    assert step_exists(root, 1)
    with pytest.raises(ckptd.CheckpointError, match="being deleted"):
        sub.open(1)
    held = sub.open(2)
    assert held.pinned
    publish(coord, 4)  # step 2 is now past the policy: only the lease keeps it
    assert ray.get(monitor.wait_retention.remote(60))
    assert not step_exists(root, 1) and step_exists(root, 2)
    assert [p.step for p in status(monitor).pins] == [2]
    assert same(held.state_dict(), weights(2))
    held.release()
    wait_for(lambda: not step_exists(root, 2), what="step 2 to go once released")
    sub.close()
    coord.close()


def test_a_monitor_killed_mid_deletion_restarts_and_honours_a_pin_taken_right_after(make_monitor, run_name,
                                                                                    tmp_path):
    """Retention claims step 1 and the monitor dies before the rename. The restarted monitor
    finishes that deletion (nothing pinned step 1), honours a pin taken right after it on step 2,
    and its later passes delete the other old steps but never step 2 while the pin lasts."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=1.0, runtime_env=failpoint_env(
        "before_step_delete=crash", once_dir=tmp_path / "once"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    sub = ckptd.WeightSubscriber(run_name, name="r0")
    publish(coord, 1)
    publish(coord, 2)
    before = ray.get(monitor.ping.remote())["started_at"]
    publish(coord, 3)  # its retention pass crashes the monitor on step 1
    wait_for(lambda: ray.get(monitor.ping.remote())["started_at"] != before, what="the monitor to restart")
    held = sub.open(2)
    assert held.pinned
    assert ray.get(monitor.wait_retention.remote(30))
    assert not step_exists(root, 1)  # the interrupted deletion was finished
    publish(coord, 4)
    publish(coord, 5)
    wait_for(lambda: not step_exists(root, 3), timeout_s=30, what="retention of step 3")
    assert step_exists(root, 2) and [p.step for p in status(monitor).pins] == [2]
    assert same(held.state_dict(), weights(2))
    held.release()
    wait_for(lambda: not step_exists(root, 2), what="step 2 to go once released")
    sub.close()
    coord.close()


def test_several_readers_pin_one_step_and_it_goes_only_after_the_last_release(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    subs = [ckptd.WeightSubscriber(run_name, name=f"r{i}") for i in range(3)]
    publish(coord, 1)
    held = [sub.open(1) for sub in subs]
    assert all(h.pinned for h in held)
    for step in (2, 3, 4):
        publish(coord, step)
    order = list(range(3))
    random.Random(7).shuffle(order)
    for n, i in enumerate(order):
        held[i].release()
        wait_for(lambda left=2 - n: len(status(monitor).pins) == left, what="the release to arrive")
        assert ray.get(monitor.wait_retention.remote(30))
        if n < 2:
            assert step_exists(root, 1), f"step 1 deleted with {2 - n} leases left"
            assert same(held[order[n + 1]].state_dict(), weights(1))
    wait_for(lambda: not step_exists(root, 1), what="step 1 to go after the last release")
    for sub in subs:
        sub.close()
    coord.close()


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
def test_leases_and_served_versions_survive_a_monitor_restart_and_the_retention_right_after_it(
        make_monitor, run_name, tmp_path, how):
    """Also I6: status shows the same pins and served versions again once the readers renewed."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=1.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    a, b = ckptd.WeightSubscriber(run_name, name="a"), ckptd.WeightSubscriber(run_name, name="b")
    publish(coord, 1)
    publish(coord, 2)
    held = [a.open(1), a.open(2), b.open(1)]
    a.report_serving(2)
    b.report_serving(1)
    pins = sorted((p.subscriber, p.step) for p in status(monitor).pins)
    assert pins == [("a", 1), ("a", 2), ("b", 1)]
    restart_monitor(monitor, how=how)
    for step in (3, 4, 5):  # retention runs at once after each commit
        publish(coord, step)
    # Step 3 goes only once the hold is over: from then on only the leases keep steps 1 and 2.
    wait_for(lambda: not step_exists(root, 3), timeout_s=30, what="retention after the post-restart hold")
    assert ray.get(monitor.wait_retention.remote(30))
    assert step_exists(root, 1) and step_exists(root, 2)
    s = status(monitor)
    assert sorted((p.subscriber, p.step) for p in s.pins) == pins
    assert (s.subscriber("a").serving, s.subscriber("a").lag_steps, s.subscriber("a").pins) == (2, 3, [1, 2])
    assert (s.subscriber("b").serving, s.subscriber("b").lag_steps, s.subscriber("b").pins) == (1, 4, [1])
    assert all(same(h.state_dict(), weights(h.version)) for h in held)
    for h in held:
        h.release()
    wait_for(lambda: not status(monitor).pins, what="the releases")
    wait_for(lambda: not step_exists(root, 1) and not step_exists(root, 2), what="steps 1 and 2 to go")
    a.close()
    b.close()
    coord.close()


def test_a_new_monitor_on_the_root_keeps_a_step_a_live_reader_pinned_under_the_old_one(make_monitor, run_name,
                                                                                      tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=2.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    sub = ckptd.WeightSubscriber(run_name, name="r0", poll_interval_s=0.1)
    publish(coord, 1)
    held = sub.open(1)
    assert held.pinned
    for step in (2, 3, 4):
        publish(coord, step)
    assert ray.get(monitor.wait_retention.remote(30)) and step_exists(root, 1)
    coord.close()
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: sub.mode == "storage", what="the reader to notice")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=2.0)
    wait_for(lambda: sub.mode == "monitor", what="the reader to reattach")
    assert ray.get(monitor.wait_retention.remote(30))
    try:
        assert held.pinned
        assert step_exists(root, 1), "step 1 was deleted while the reader's handle says pinned"
    finally:
        sub.close()


def test_a_lease_survives_a_restart_whatever_the_storage_poll_interval(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=1.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    sub = ckptd.WeightSubscriber(run_name, name="r0", poll_interval_s=5.0)
    publish(coord, 1)
    held = sub.open(1)
    restart_monitor(monitor, how="sigkill")
    for step in (2, 3, 4):
        publish(coord, step)
    wait_for(lambda: sub.mode == "monitor", timeout_s=30, what="the subscriber to follow the monitor again")
    publish(coord, 5)
    assert ray.get(monitor.wait_retention.remote(30))
    try:
        assert held.pinned
        assert step_exists(root, 1), "step 1 was deleted while the reader's handle says pinned"
    finally:
        sub.close()
        coord.close()


# -- I2: versions are committed, newer than asked, and never go back ------------------------------


def follow(sub: ckptd.WeightSubscriber, until: int, timeout_s: float = 60) -> list:
    """Versions woken with, up to ``until``; each must be committed on storage the moment it is
    returned and newer than the one before. A violation ends the list as a string."""
    seen: list = []
    after = None
    while after is None or after < until:
        try:
            version = sub.wait_for_version(after, timeout_s)
        except ckptd.CheckpointTimeoutError:
            return seen + [f"timeout after {after}"]
        if not is_committed(sub._storage, version, sub.kind):
            return seen + [f"{version} is not committed as a {sub.kind.value}"]
        if after is not None and version <= after:
            return seen + [f"{version} after {after}"]
        seen.append(version)
        after = version
    return seen


def test_followers_see_only_committed_newer_versions_through_out_of_order_failed_and_torn_steps(
        make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    rng = random.Random(2024)
    order = list(range(1, 13))
    rng.shuffle(order)
    plan = {s: rng.choice(["state_dict", "state_dict", "checkpoint", "fail"]) for s in order}
    plan[12], plan[order[0]] = "checkpoint", "state_dict"
    # Step 13, the newest, is half written the whole time: nobody may see it until it commits.
    # Another worker writes it (a coordinator's units of one kind run one after another).
    slow = ckptd.CheckpointCoordinator(monitor, worker_id="slow")
    torn_gate, torn_half = threading.Event(), threading.Event()

    def torn() -> list[str]:
        path = f"{coord.step_dir(13)}/model.safetensors"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"half")
            f.flush()
            torn_half.set()
            torn_gate.wait(60)
        return _hf(coord.step_dir(13), weights(13))

    slow.save_async("model", torn, 13, is_state_dict=True)
    slow.register(13, is_state_dict=True, state_dict_thread_count=1)
    assert torn_half.wait(30)
    checkpoints = sorted(s for s, how in plan.items() if how == "checkpoint")
    subs = {"sd": ckptd.WeightSubscriber(run_name, name="sd"),
            "ckpt": ckptd.WeightSubscriber(run_name, name="ckpt", kind="checkpoint")}
    seen: dict[str, list] = {}
    threads = [threading.Thread(target=lambda: seen.update(sd=follow(subs["sd"], 13))),
               threading.Thread(target=lambda: seen.update(ckpt=follow(subs["ckpt"], checkpoints[-1])))]
    for t in threads:
        t.start()
    for step in order:
        how = plan[step]
        if how == "fail":
            coord.register(step, is_state_dict=True, state_dict_thread_count=1)  # before the failure can land
            coord.save_async("model", lambda: (_ for _ in ()).throw(OSError("disk full")), step, is_state_dict=True)
            with pytest.raises(ckptd.CheckpointSaveError):
                coord.wait_committed(step, is_state_dict=True, timeout_s=60)
            with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
                coord.wait_all()
        elif how == "checkpoint":
            coord.save_state_async("model", weights(step), step)
            coord.register(step, checkpoint_thread_count=1)
            coord.wait_committed(step, timeout_s=60)
        else:
            publish(coord, step)
    assert subs["sd"].latest() == 12 and not is_committed(Storage(root), 13, Kind.STATE_DICT)
    torn_gate.set()
    slow.wait_committed(13, is_state_dict=True, timeout_s=60)
    for t in threads:
        t.join(90)
    committed = {s for s, how in plan.items() if how != "fail"} | {13}
    for name, versions in seen.items():
        assert all(isinstance(v, int) for v in versions), (name, versions, plan)
        assert versions == sorted(set(versions)), (name, versions)
        assert set(versions) <= (committed if name == "sd" else set(checkpoints)), (name, versions, plan)
    assert seen["sd"][-1] == 13 and seen["ckpt"][-1] == checkpoints[-1] and len(seen["sd"]) >= 2
    for sub in subs.values():
        sub.close()
    slow.close()
    coord.close()


def test_a_withdrawn_state_dict_is_never_handed_out_again(make_monitor, run_name, tmp_path):
    """A state dict whose listed file a later unit rewrote is withdrawn (its manifest goes, the
    tracker goes back): a waiter after the previous version is not woken with it, and it cannot be
    opened; a reader that had it open is told, never handed the new bytes."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    publish(coord, 1)
    out = coord.step_dir(2)
    commit(coord, 2, lambda d: _hf(d, weights(2)))
    sub = ckptd.WeightSubscriber(run_name, name="r0")
    assert sub.wait_for_version(1, 30) == 2
    held = sub.open(2)
    assert held.pinned
    # A checkpoint unit of step 2 rewrites the state dict's weights file with other bytes.
    coord.save_async("ckpt", lambda: _hf(out, weights(99)), 2)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.register(2, checkpoint_thread_count=1)
        coord.wait_committed(2, timeout_s=30)
    wait_for(lambda: status(monitor).trackers.state_dict == 1, what="the state dict of step 2 to be withdrawn")
    with pytest.raises(ckptd.CheckpointTimeoutError):
        sub.wait_for_version(1, timeout_s=1.0)
    assert sub.latest() == 1
    with pytest.raises(ckptd.CheckpointError, match="not committed"):
        sub.open(2)
    with pytest.raises(ckptd.CheckpointError, match="not committed|deleted while it was read"):
        held.state_dict()
    held.release()
    sub.close()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.close()


# -- I4: a dead reader's lease expires; a released one never comes back -----------------------------


def _reader_info(name: str) -> dict:
    return {"id": f"{name}-id", "name": name, "kind": "state_dict", "where": "test"}


def test_a_sigkilled_readers_lease_expires_and_a_released_lease_never_comes_back(make_monitor, run_name,
                                                                                tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=1.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    reader = Reader.remote(run_name, "doomed")
    publish(coord, 1)
    publish(coord, 2)
    assert ray.get(reader.hold.remote(1))
    # A renewal that the subscriber's renewer thread prepared before the handle was released,
    # arriving after the release, must not bring the lease back.
    info = _reader_info("late")
    assert ray.get(monitor.pin.remote(info, "lease-2", 2)) == {"error": None}
    ray.get(monitor.release.remote("lease-2"))
    answer = ray.get(monitor.reader_heartbeat.remote(info, [["lease-2", 2]], None))
    assert answer["lost"] == ["lease-2"]
    for step in (3, 4):
        publish(coord, step)
    assert ray.get(monitor.wait_retention.remote(30)) and step_exists(root, 1) and not step_exists(root, 2)
    s = status(monitor)
    assert [(p.subscriber, p.step) for p in s.pins] == [("doomed", 1)]
    assert s.subscriber("doomed").live and s.subscriber("doomed").pins == [1]
    # A lease on a step that is gone cannot be taken, by a renewal or a pin.
    assert ray.get(monitor.reader_heartbeat.remote(info, [["lease-3", 2]], None))["lost"] == ["lease-3"]
    assert "not committed" in ray.get(monitor.pin.remote(info, "lease-4", 2))["error"]
    os.kill(ray.get(reader.pid.remote()), 9)
    wait_for(lambda: 1 in status(monitor).retention.deleted_steps, timeout_s=20,
             what="the dead reader's step to be deleted")
    s = status(monitor)
    assert not step_exists(root, 1)
    assert not s.pins and not s.subscriber("doomed").live and s.subscriber("doomed").pins == []
    coord.close()


def test_a_released_lease_is_not_revived_by_a_renewal_the_restarted_monitor_receives(make_monitor, run_name,
                                                                                      tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, read_lease_s=5.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    publish(coord, 1)
    info = _reader_info("late")
    assert ray.get(monitor.pin.remote(info, "lease-1", 1)) == {"error": None}
    ray.get(monitor.release.remote("lease-1"))
    restart_monitor(monitor)
    answer = ray.get(monitor.reader_heartbeat.remote(info, [["lease-1", 1]], None))
    pins = status(monitor).pins
    coord.close()
    assert answer["lost"] == ["lease-1"] and not pins, (answer, pins)


# -- I5: a waiter across a monitor killed for good, and a monitor started again ------------------------


def test_a_waiter_outlives_a_monitor_killed_for_good_and_follows_the_next_one(make_monitor, run_name, tmp_path):
    """Killed for good: the wait ends within its timeout (+ a few seconds), with a timeout error or
    with a version another job committed on the root; a monitor of the run started later is
    followed again, with leases."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    sub = ckptd.WeightSubscriber(run_name, name="r0", poll_interval_s=0.1)
    publish(coord, 1)
    coord.close()
    outcome: dict = {}

    def wait(after: int, timeout_s: float) -> None:
        t0 = time.monotonic()
        try:
            outcome["version"] = sub.wait_for_version(after, timeout_s)
        except ckptd.CheckpointError as e:
            outcome["version"] = type(e).__name__
        outcome["elapsed"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait, args=(1, 2.0))
    waiter.start()
    async_outcome: dict = {}

    def wait_async() -> None:  # the async twin, on its own event loop
        t0 = time.monotonic()
        try:
            async_outcome["version"] = asyncio.run(sub.wait_for_version_async(1, 2.0))
        except ckptd.CheckpointError as e:
            async_outcome["version"] = type(e).__name__
        async_outcome["elapsed"] = time.monotonic() - t0

    async_waiter = threading.Thread(target=wait_async)
    async_waiter.start()
    ray.kill(monitor, no_restart=True)
    waiter.join(30)
    async_waiter.join(30)
    assert outcome["version"] == "CheckpointTimeoutError" and outcome["elapsed"] < 2.0 + 3, outcome
    assert async_outcome["version"] == "CheckpointTimeoutError" and async_outcome["elapsed"] < 2.0 + 3, async_outcome
    assert sub.mode == "storage"
    # Read from the root alone, a tracker naming a step that never committed and a newer torn step
    # directory are ignored.
    with open(f"{root}/latest_state_dict_iteration.txt", "w") as f:
        f.write("50")
    os.makedirs(ckptd.step_dir(root, 50))
    with open(f"{ckptd.step_dir(root, 50)}/model.safetensors", "wb") as f:
        f.write(b"torn")
    assert sub.latest() == 1
    with pytest.raises(ckptd.CheckpointTimeoutError):
        sub.wait_for_version(1, timeout_s=0.3)
    # Another run's monitor commits step 2 on this root: found there, without a monitor of this run.
    other = make_monitor(root, run=f"{run_name}-other")
    coord = ckptd.CheckpointCoordinator(other, worker_id="trainer")
    waiter = threading.Thread(target=wait, args=(1, 20.0))
    waiter.start()
    publish(coord, 2)
    waiter.join(30)
    assert outcome["version"] == 2 and outcome["elapsed"] < 20, outcome
    coord.close()
    ray.kill(other, no_restart=True)
    # This run's monitor again: the subscriber follows it, and pins.
    again = make_monitor(root)
    wait_for(lambda: sub.mode == "monitor", what="the subscriber to attach to the new monitor")
    coord = ckptd.CheckpointCoordinator(again, worker_id="trainer")
    waiter = threading.Thread(target=wait, args=(2, 30.0))
    waiter.start()
    publish(coord, 3)
    waiter.join(40)
    assert outcome["version"] == 3, outcome
    with sub.open(3) as w:
        assert w.pinned and same(w.state_dict(), weights(3))
    sub.close()
    coord.close()


def test_a_waiter_across_a_sigkill_is_woken_by_the_commit_the_restarted_monitor_makes(make_monitor, run_name,
                                                                                      tmp_path):
    """Step 2's unit finishes while the monitor is dead; the restarted monitor commits it from the
    receipts and the long-poll Ray retried on it returns 2."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    sub = ckptd.WeightSubscriber(run_name, name="r0")
    publish(coord, 1)
    gate = threading.Event()

    def slow() -> list[str]:
        gate.wait(60)
        return _hf(coord.step_dir(2), weights(2))

    coord.save_async("model", slow, 2, is_state_dict=True)
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    woken: dict = {}
    waiter = threading.Thread(target=lambda: woken.update(v=sub.wait_for_version(1, 60)))
    waiter.start()
    pid = ray.get(monitor.ping.remote())["pid"]
    os.kill(pid, 9)
    gate.set()
    waiter.join(90)
    assert woken["v"] == 2 and is_committed(Storage(root), 2, Kind.STATE_DICT)
    with sub.open(2) as w:
        assert same(w.state_dict(), weights(2))
    sub.close()
    coord.close()


# -- I6: status ---------------------------------------------------------------------------------------


def test_served_lag_after_a_restart_never_understates_the_lag(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    sub = ckptd.WeightSubscriber(run_name, name="r0")
    publish(coord, 1)
    sub.report_serving(1)
    publish(coord, 2)
    published_2 = time.time()  # step 2 was published before this
    time.sleep(0.5)  # not a synchronisation: the two publications must be measurably apart
    publish(coord, 3)
    restart_monitor(monitor)
    sub.report_serving(1)  # as a rollout worker does; the renewal would restate it too
    wait_for(lambda: (status(monitor).subscriber("r0") or status(monitor)).serving == 1, what="serving again")
    asked = time.time()
    s = status(monitor).subscriber("r0")
    sub.close()
    coord.close()
    assert s.lag_steps == 2
    assert s.lag_s is None or s.lag_s >= asked - published_2, (s.lag_s, asked - published_2)
