"""Adversarial tests of the FSDP2 path on real Ray actors with real gloo process groups: resume on
other world sizes (3->2, 2->1, a plain model), forged shards and optimizer groups, DCP refusals,
a rank killed while its save thread writes, and HF export of an uncommitted step.

Three actors are shared by the whole module (each start imports torch and transformers); the
tests run in file order and the last one kills an actor."""

from __future__ import annotations

import json
import os
import shutil
import threading
from types import SimpleNamespace

import pytest
import ray
import torch

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS
from ckptd.storage import Storage
from ckptd.workers.dtensor import GROUPS_FILE
from ckptd.workers.export import export_hf_step
from ckptd.workers.files import write_json
from ckptd.workers.fsdp_job import MODEL_DIR, FSDPJob, Trainer, tiny_llama_config
from ckptd.workers.safetensors_io import write_safetensors
from ckptd.workers.sharded import DCP_SHARDING_KEY
from tests.integration.helpers import commit_fsdp_step, differing


@pytest.fixture(scope="module")
def env(ray_local, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp-adv") / "ckpt")
    run = f"fsdp-adv-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run)
    actors = [Trainer.remote() for _ in range(3)]
    jobs: list[FSDPJob] = []

    def job(world_size: int, actors_: list | None = None) -> FSDPJob:
        for j in jobs:
            j.teardown()
        jobs.clear()
        jobs.append(FSDPJob(world_size, actors=actors_ or actors, run=run))
        return jobs[0]

    ns = SimpleNamespace(root=root, run=run, monitor=monitor, actors=actors, job=job, tmp=tmp_path_factory)
    yield ns
    for j in jobs:
        j.teardown()
    for a in actors:
        ray.kill(a)
    ray.kill(monitor, no_restart=True)


@pytest.fixture(scope="module")
def saved_on_3(env):
    """Three ranks train 2 steps and commit step 2; what they held then."""
    job = env.job(3)
    job.call("train", 2)
    job.call("save")
    assert commit_fsdp_step(job, env.monitor) == 2
    return job.call("full_state")[0]


def manifest_path(root: str, step: int) -> str:
    return f"{ckptd.step_dir(root, step)}/{MANIFESTS[Kind.CHECKPOINT]}"


def relist(root: str, step: int, rel: str, written) -> None:
    """Make the manifest match a forged file (what a buggy or hostile writer would leave)."""
    path = manifest_path(root, step)
    with open(path) as f:
        manifest = json.load(f)
    for entry in manifest["files"]:
        if entry["path"] == rel:
            entry.update(size=written.size, crc32=written.crc32, mtime_ns=None)
            break
    else:
        raise AssertionError(f"{rel} not in the manifest")
    with open(path, "w") as f:
        json.dump(manifest, f)


def forge_offset(root: str, step: int, shard: str, key: str, delta: int) -> None:
    """Move ``key``'s block in ``shard`` by ``delta`` rows (header only), manifest to match."""
    from safetensors import safe_open

    d = f"{ckptd.step_dir(root, step)}/{MODEL_DIR}"
    with safe_open(f"{d}/{shard}", "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    info = json.loads(meta[DCP_SHARDING_KEY])
    info[key]["saved_offsets"][0] += delta
    meta[DCP_SHARDING_KEY] = json.dumps(info, separators=(",", ":"))
    relist(root, step, f"{MODEL_DIR}/{shard}", write_safetensors(Storage(d), f"{d}/{shard}", tensors, meta))


def copy_root(env, name: str) -> str:
    root = str(env.tmp.mktemp(name) / "ckpt")
    shutil.copytree(env.root, root)
    return root


def resume_everywhere(job: FSDPJob, root: str, step: int) -> list[BaseException | dict]:
    out = []
    for ref in [a.resume.remote(root, step) for a in job.actors]:
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - collected per rank
            out.append(e)
    return out


# -- invariant 3: exact full tensors on another world size ----------------------------------------


def test_3_ranks_resume_exactly_on_2_then_1_and_into_a_plain_model(env, saved_on_3):
    job = env.job(2)
    assert job.call("resume", env.root) == [{"step": 2, "consumed": 24, "epoch": 0}] * 2
    assert differing(saved_on_3, job.call("full_state")[0]) == []  # 3 -> 2
    job.call("train", 1)
    job.call("save")
    assert commit_fsdp_step(job, env.monitor) == 3
    full = env.full_at_3 = job.call("full_state")[0]
    assert differing(saved_on_3, full)  # it trained on

    job = env.job(1)  # one rank, a 1-rank gloo group, fully_shard over it
    # DCP's own HuggingFaceStorageReader reads the 2-rank ckptd step into the 1-rank DTensors.
    job.call("load_with_dcp", f"{ckptd.step_dir(env.root, 3)}/{MODEL_DIR}")
    weights = {k: v for k, v in full.items() if not k.startswith(("optim.", "lr"))}
    got = job.call("full_state")[0]
    assert differing(weights, {k: got[k] for k in weights}) == []
    assert job.call("resume", env.root) == [{"step": 3, "consumed": 36, "epoch": 0}]  # 2 -> 1
    assert differing(full, job.call("full_state")[0]) == []

    # A plain (non-FSDP) model and optimizer in this process load the FSDP step.
    from transformers import LlamaForCausalLM

    torch.manual_seed(9)
    plain = LlamaForCausalLM(tiny_llama_config())
    opt = torch.optim.AdamW(plain.parameters(), lr=1.0, weight_decay=0.5)
    state = ckptd.resume(env.root, model=plain, optimizer=opt, rank=0, world_size=1, model_dir=MODEL_DIR,
                         restore_rng=False)
    assert state.step == 3
    mine = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    for name, p in plain.named_parameters():
        for k, v in opt.state[p].items():
            mine[f"optim.{name}.{k}"] = v
    mine["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    assert differing(full, mine) == []
    assert opt.param_groups[0]["weight_decay"] == 0.01


# -- invariant 1: forged files refused on every rank, nothing changes ----------------------------


def test_a_block_forged_to_overlap_is_refused_on_every_rank_of_2(env):
    root = copy_root(env, "overlap2")
    forge_offset(root, 3, "shard-00001.safetensors", "model.norm.weight", -1)  # rows 15..30, not 16..31
    job = env.job(2)
    before = job.call("full_state")[0]
    results = resume_everywhere(job, root, 3)
    assert all(isinstance(r, ckptd.CorruptCheckpointError) for r in results), results
    assert any("model.norm.weight" in str(r) for r in results), results
    assert differing(before, job.call("full_state")[0]) == []


def test_a_block_forged_to_overlap_is_refused_on_a_single_rank(env):
    root = copy_root(env, "overlap1")
    forge_offset(root, 3, "shard-00001.safetensors", "model.norm.weight", -1)
    job = env.job(1)
    before = job.call("full_state")[0]
    [result] = resume_everywhere(job, root, 3)
    after = job.call("full_state")[0]
    assert isinstance(result, ckptd.CorruptCheckpointError), (result, differing(env.full_at_3, after))
    assert differing(before, after) == []


def test_forged_optimizer_groups_are_refused_before_any_rank_changes(env):
    root = copy_root(env, "groups")
    d = f"{ckptd.step_dir(root, 3)}/{MODEL_DIR}"
    with open(f"{d}/{GROUPS_FILE}") as f:
        groups = json.load(f)
    groups["scalars"] = []
    relist(root, 3, f"{MODEL_DIR}/{GROUPS_FILE}", write_json(Storage(d), f"{d}/{GROUPS_FILE}", groups))
    job = env.job(2)
    before = job.call("full_state")[0]
    results = resume_everywhere(job, root, 3)
    after = job.call("full_state")[0]
    assert all(isinstance(r, ckptd.CorruptCheckpointError) for r in results), results
    assert differing(before, after) == []


# -- invariant 4: a refused dcp.save -------------------------------------------------------------


def _dcp_save_with_a_non_tensor(self, background: bool) -> dict:
    """On a rank (through __ray_call__): dcp.save of the model plus an int, as one ckptd unit."""
    from ckptd.workers.dcp import CkptdStorageWriter

    step = self.step
    out = f"{self.coord.step_dir(step)}/{MODEL_DIR}"
    writer = CkptdStorageWriter(out)
    state = {**self.model.state_dict(), "epoch": 3}
    raised = None
    try:
        if background:
            group = torch.distributed.new_group(backend="gloo")
            self.coord.save_state_async("dcp", state, step, lambda staged: writer.save(staged, process_group=group))
        else:
            self.coord.save_sync(lambda: writer.save(state), step)
        self.coord.wait_all()
    except BaseException as e:  # noqa: BLE001 - DCP raises a BaseException
        raised = e
    return {"type": type(raised).__name__ if raised else None, "ckptd": isinstance(raised, ckptd.CheckpointError),
            "message": str(raised), "files": sorted(os.listdir(out)) if os.path.isdir(out) else [],
            "save_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptd-save-"))}


@pytest.mark.parametrize("background", [False, True], ids=["save_sync", "background"])
def test_a_dcp_save_with_non_tensor_entries_is_refused_before_anything_is_written(env, background):
    job = env.job(2)
    job.call("train", 1)
    results = ray.get([a.__ray_call__.remote(_dcp_save_with_a_non_tensor, background) for a in job.actors])
    for r in results:
        assert r["files"] == [], r  # refused before anything was written: holds today
        assert "epoch" in r["message"] and "non-tensor" in r["message"], r
        assert r["type"] == "CheckpointSaveError" and r["ckptd"], r  # a failed ckptd unit
        assert not background or r["save_threads"] == ["ckptd-save-dcp"], r  # its save thread lives on


# -- invariants 2 and 5: a rank killed while its save thread writes ------------------------------


def _save_and_hang_in_write(self) -> None:
    """Rank's save of the current step whose shard write stops half-way (file written, then waits)."""
    from ckptd.workers.dtensor import sharded_state
    from ckptd.workers.training_state import capture_training_state, save_training_state

    step, out = self.step, self.coord.step_dir(self.step)
    self.in_write, never = threading.Event(), threading.Event()
    state = sharded_state(self.model, self.optimizer, rank=self.rank, world_size=self.world_size)

    def write(snapshot):
        written = state.write(f"{out}/{MODEL_DIR}", snapshot)
        self.in_write.set()
        never.wait(120)  # killed here
        return written

    self.coord.save_state_async("shards", state.tensors, step, write)
    training = capture_training_state(epoch=0, step=step, step_in_epoch=step, steps_per_epoch=8, batch_size=6,
                                      consumed_samples=self.consumed, rank=self.rank, world_size=self.world_size,
                                      lr_scheduler=self.scheduler)
    self.coord.save_async("train_state", lambda: save_training_state(out, training), step)


def _wait_in_write(self) -> bool:
    return self.in_write.wait(60)


def test_a_rank_killed_while_writing_never_commits_and_the_job_commits_later(env, tmp_path):
    job = env.job(2)
    assert job.call("resume", env.root)[0]["step"] == 3
    committed = {s: open(manifest_path(env.root, s), "rb").read() for s in (2, 3)}
    job.call("train", 1)  # step 4
    survivor, victim = job.actors
    ray.get(survivor.register.remote(2))
    survivor.save.remote()
    ray.get(victim.__ray_call__.remote(_save_and_hang_in_write))
    assert ray.get(victim.__ray_call__.remote(_wait_in_write))  # its save thread is inside the write
    ray.kill(victim, no_restart=True)
    ray.get(survivor.wait_saves.remote())
    assert os.path.exists(f"{ckptd.step_dir(env.root, 4)}/{MODEL_DIR}/shard-00001.safetensors")

    # Invariant 5: the step's files are there, but it has no manifest; no export reads it.
    with pytest.raises(ckptd.CheckpointError, match="not committed"):
        export_hf_step(env.root, 4, str(tmp_path / "hf"), tiny_llama_config().to_dict(), wait_s=0)
    assert not (tmp_path / "hf").exists()
    status = ray.get(env.monitor.status.remote()).step(4, Kind.CHECKPOINT)
    assert ckptd.latest_step(env.root) == 3 and not (status and status.committed)

    # The job restarts on the survivor alone, resumes step 3, and commits step 5.
    env.actors.remove(victim)
    job = env.job(1, actors_=[survivor])
    assert job.call("resume", env.root) == [{"step": 3, "consumed": 36, "epoch": 0}]
    job.call("train", 2)
    job.call("save")
    assert commit_fsdp_step(job, env.monitor) == 5
    ckptd.verify(env.root, 5)
    with pytest.raises(ckptd.CheckpointError):
        ckptd.verify(env.root, 4)
    for s, data in committed.items():  # no committed step changed
        assert open(manifest_path(env.root, s), "rb").read() == data
        ckptd.verify(env.root, s)
