"""Exact resume in one call, verification against the manifest, and safe loading."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import ckptd
from ckptd.cli import main
from ckptd.workers import capture_training_state, save_hf_model, save_sharded, save_training_state, snapshot

from .. import tiny

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.filterwarnings("ignore::UserWarning:torchdata.*")]

BATCH, SAMPLES = 4, 24  # 6 steps per epoch


class Job:
    """A small training job with every kind of state: weights, AdamW, a cosine schedule, dropout
    (torch RNG), noise from python's and numpy's RNGs, and a shuffling stateful dataloader."""

    def __init__(self, init_seed: int) -> None:
        torch.manual_seed(init_seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                         torch.nn.Linear(16, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=50)
        g = torch.Generator().manual_seed(42)
        x = torch.randn(SAMPLES, 6, generator=g)
        dataset = TensorDataset(torch.arange(SAMPLES), x, x.sum(1, keepdim=True))
        self.sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
        # Its own generator: a new iterator draws a seed from it, and a resumed mid-epoch run
        # creates one where the uninterrupted run did not, which would shift the global RNG.
        self.loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=self.sampler,
                                         generator=torch.Generator().manual_seed(1))

    def train(self, epoch: int, step: int, in_epoch: int, until: int, on_step=None):
        losses, order = [], []
        while True:
            self.sampler.set_epoch(epoch)
            for idx, xb, yb in self.loader:
                noise = float(np.random.normal()) * 1e-3 + random.random() * 1e-3
                loss = ((self.model(xb) - yb) ** 2).mean() + noise
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                self.scheduler.step()
                step, in_epoch = step + 1, in_epoch + 1
                losses.append(loss.item())
                order.append(idx.tolist())
                if on_step is not None:
                    on_step(epoch, step, in_epoch)
                if step == until:
                    return losses, order
            epoch, in_epoch = epoch + 1, 0


@pytest.mark.parametrize(("at", "template"), [
    (9, "global_step_{step}"),  # mid-epoch: 3 of 6 steps into epoch 1
    (12, "epoch-{epoch}_step-{step}"),  # the last step of epoch 1: the next epoch must start
])
def test_resume_is_exact_bit_for_bit(make_monitor, tmp_path, at, template):
    root, more = str(tmp_path / "ckpt"), 8
    monitor = make_monitor(root, step_dir_template=template)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")

    def checkpoint(epoch, step, in_epoch):
        if step != at:
            return
        state = capture_training_state(epoch=epoch, step=step, step_in_epoch=in_epoch, batch_size=BATCH,
                                       optimizer=job.optimizer, lr_scheduler=job.scheduler, dataloader=job.loader)
        weights = snapshot(job.model.state_dict())
        out = coord.step_dir(step, epoch=epoch)
        coord.save_async("model", lambda: save_sharded(f"{out}/model", weights, rank=0, world_size=1), step)
        coord.save_async("state", lambda: save_training_state(out, state), step)
        coord.register(step, checkpoint_thread_count=2)

    random.seed(0)
    np.random.seed(0)
    job = Job(init_seed=0)
    # One uninterrupted run of at + more steps, training on while the checkpoint is written.
    all_losses, all_order = job.train(0, 0, 0, at + more, on_step=checkpoint)
    expected_losses, expected_order = all_losses[at:], all_order[at:]
    coord.wait_committed(at, timeout_s=60)
    coord.close()

    resumed = Job(init_seed=123)  # other weights, and every RNG elsewhere: resume must restore all
    torch.manual_seed(999), random.seed(999), np.random.seed(999)
    state = ckptd.resume(root, model=resumed.model, optimizer=resumed.optimizer, lr_scheduler=resumed.scheduler,
                         dataloader=resumed.loader, model_dir="model")
    per_epoch = SAMPLES // BATCH
    assert (state.step, state.epoch, state.step_in_epoch) == (at, at // per_epoch, at % per_epoch)
    assert state.sample_start_index == state.step_in_epoch * BATCH and state.consumed_samples == at * BATCH
    if at == 12:
        assert state.running.epoch_finished and state.path.endswith("/epoch-1_step-12")
    losses, order = resumed.train(state.epoch, state.step, state.step_in_epoch, at + more)

    assert order == expected_order  # no replayed, skipped or empty epoch
    assert losses == expected_losses  # exact floats: bit for bit
    for (k, a), b in zip(job.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


class Opaque:
    """Not a tensor or a plain container: weights_only loading must refuse it."""


def _commit(coord, step: int, files: dict[str, object]) -> None:
    out = coord.step_dir(step)

    def save():
        os.makedirs(out, exist_ok=True)
        for name, obj in files.items():
            os.makedirs(os.path.dirname(f"{out}/{name}"), exist_ok=True)
            if isinstance(obj, bytes):
                open(f"{out}/{name}", "wb").write(obj)
            else:
                torch.save(obj, f"{out}/{name}")
    coord.save_async("save", save, step)
    coord.register(step, checkpoint_thread_count=1)
    coord.wait_committed(step, timeout_s=60)


def test_resume_with_nothing_committed_returns_none_and_never_picks_uncommitted(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w")
    assert ckptd.resume(root) is None
    model = torch.nn.Linear(2, 2)
    _commit(coord, 3, {"optimizer/rank-00000.pt": torch.optim.SGD(model.parameters(), lr=0.1).state_dict()})
    os.makedirs(f"{root}/global_step_4/optimizer")  # a newer step that never committed
    open(f"{root}/latest_checkpointed_iteration.txt", "w").write("4\n")  # and a tracker that lies
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    assert ckptd.resume(root, optimizer=opt).step == 3
    assert opt.param_groups[0]["lr"] == 0.1
    # Another optimizer's layout is refused before anything changes, not by load_state_dict after.
    two = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.5)
    with pytest.raises(ckptd.CheckpointConfigError, match=r"rank-00000.pt is not this optimizer's state: it has 1 "
                                                          r"parameter groups, the optimizer 2"):
        ckptd.resume(root, optimizer=two)
    assert [g["lr"] for g in two.param_groups] == [0.5, 0.5]
    coord.close()


def test_a_pickle_that_needs_arbitrary_objects_is_refused(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w")
    model = torch.nn.Linear(2, 2)
    _commit(coord, 1, {"data.pt": {"sampler": Opaque()}, "optimizer/rank-00000.pt": {"state": {}, "param_groups": []}})
    before = snapshot(model.state_dict())
    with pytest.raises(ckptd.UnsafeCheckpointError, match=r"global_step_1/data.pt .*weights_only"):
        ckptd.resume(root, dataloader=StatefulDataLoader([1, 2]))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    coord.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_verify_and_resume_catch_damaged_files(make_monitor, tmp_path, damage):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w")
    model = tiny.llama(seed=5)
    out = coord.step_dir(2)
    weights = snapshot(model.state_dict())
    coord.save_async("hf", lambda: save_hf_model(out, weights, model.config), 2)
    coord.register(2, checkpoint_thread_count=1)
    coord.wait_committed(2, timeout_s=60)
    coord.close()
    assert ckptd.verify(root).step == 2 and main(["verify", root]) == 0

    path = f"{out}/model.safetensors"
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        open(path, "wb").write(bytes(data))
        expected = "checksum mismatch"
    elif damage == "truncate":
        open(path, "wb").write(bytes(data[:-10]))
        expected = "truncated"
    else:
        os.remove(path)
        expected = "missing"
    with pytest.raises(ckptd.CorruptCheckpointError, match=rf"global_step_2/model.safetensors: {expected}"):
        ckptd.verify(root, 2)
    assert main(["verify", root, "--step", "2"]) == 1
    fresh = tiny.llama(seed=6)
    before = snapshot(fresh.state_dict())
    with pytest.raises(ckptd.CorruptCheckpointError, match="model.safetensors"):
        ckptd.resume(root, model=fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # untouched


def test_resume_loads_hf_and_lora_checkpoints(make_monitor, tmp_path):
    peft = pytest.importorskip("peft")
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w")
    model = tiny.llama(seed=8)
    full = snapshot(model.state_dict())
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], lora_dropout=0.0)
    lora_model = peft.get_peft_model(tiny.llama(seed=8), config)
    with torch.no_grad():
        for name, p in lora_model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.25)
    adapter = snapshot(lora_model.state_dict())
    from ckptd.workers import save_lora_adapter

    out = coord.step_dir(1)
    coord.save_async("hf", lambda: save_hf_model(f"{out}/hf", full, model.config, max_shard_size="25KB"), 1)
    coord.save_async("lora", lambda: save_lora_adapter(f"{out}/lora", adapter, config), 1)
    coord.register(1, checkpoint_thread_count=2)
    coord.wait_committed(1, timeout_s=60)
    coord.close()

    fresh = tiny.llama(seed=9)
    ckptd.resume(root, model=fresh, model_dir="hf")
    assert all(torch.equal(full[k], v) for k, v in fresh.state_dict().items())
    fresh_lora = peft.get_peft_model(tiny.llama(seed=8), config)
    ckptd.resume(root, model=fresh_lora, model_dir="lora")
    assert all(torch.equal(adapter[k], v) for k, v in fresh_lora.state_dict().items())
    with pytest.raises(ckptd.CheckpointConfigError, match="do not fit the model"):
        ckptd.resume(root, model=torch.nn.Linear(2, 2), model_dir="hf")
    with pytest.raises(ckptd.CheckpointConfigError, match="no optimizer state"):
        ckptd.resume(root, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    # An adapter name the model does not have (was peft's KeyError), and an HF export of the adapter
    # alone (was an HF folder that loaded with random base weights): refused.
    with pytest.raises(ckptd.CheckpointConfigError, match=r"no adapter named 'nope'.*\['default'\]"):
        ckptd.resume(root, model=fresh_lora, model_dir="lora", adapter_name="nope")
    from ckptd.workers.export import export_hf_step

    with pytest.raises(ckptd.CheckpointConfigError, match="holds a LoRA adapter"):
        export_hf_step(root, 1, str(tmp_path / "hf-of-lora"), model.config, model_dir="lora")
    assert not os.path.exists(tmp_path / "hf-of-lora")


def test_resuming_a_step_whose_saves_wrote_nowhere_in_it_says_it_has_no_files(make_monitor, tmp_path):
    """A save function that wrote outside the step's directory leaves a committed step with no
    files; resuming it says so (the message used to end at "it has ")."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w")
    coord.register(4, checkpoint_thread_count=1)
    coord.save_async("elsewhere", list, 4)  # writes nothing, and says so
    coord.wait_committed(4, timeout_s=30)
    coord.close()
    with pytest.raises(ckptd.CheckpointConfigError, match=r"no model weights .*it has no files at all: its manifest"):
        ckptd.resume(root, model=torch.nn.Linear(2, 2))


def test_a_resume_that_cannot_load_everything_changes_nothing(make_monitor, tmp_path):
    """What the saved states do not fit is refused before anything is loaded: a scheduler or an
    optimizer of another class, objects of the wrong kind, a model on the meta device. Before,
    a scheduler whose load failed left the model and the optimizer already loaded, and AdamW's
    state loaded into an SGD (which then failed at its next step). Found by a helper's audit
    (session 37)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    job = Job(init_seed=1)
    job.train(0, 0, 0, until=3)
    state = capture_training_state(epoch=0, step=3, step_in_epoch=3, batch_size=BATCH, optimizer=job.optimizer,
                                   lr_scheduler=job.scheduler, dataloader=job.loader)
    weights = snapshot(job.model.state_dict())

    out = coord.step_dir(3)
    coord.save_async("model", lambda: save_sharded(f"{out}/model", weights, rank=0, world_size=1), 3)
    coord.save_async("state", lambda: save_training_state(out, state), 3)
    coord.register(3, checkpoint_thread_count=2)
    coord.wait_committed(3, timeout_s=30)
    coord.close()

    fresh = Job(init_seed=2)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    opt_before = repr(fresh.optimizer.state_dict())
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(fresh.optimizer, lambda e: 1.0)
    sgd = torch.optim.SGD(fresh.model.parameters(), lr=0.1, momentum=0.9)
    cases = [
        (dict(model=fresh.model, optimizer=fresh.optimizer, lr_scheduler=lambda_lr), "not the state of a LambdaLR"),
        (dict(model=fresh.model, optimizer=sgd), "another optimizer class"),
        (dict(model=fresh.model, dataloader=[1, 2]), "dataloader= must have state_dict"),
        (dict(model=fresh.model.state_dict()), "model= must be the model"),
        (dict(model=fresh.model, optimizer=fresh.model), "optimizer= must be the optimizer"),
        (dict(model=fresh.model, rank=3, world_size=2), "rank must be in"),
        (dict(model=fresh.model, restore_rng="no"), "restore_rng must be True or False"),
    ]
    for kwargs, said in cases:
        with pytest.raises(ckptd.CheckpointConfigError, match=said):
            ckptd.resume(root, **kwargs)
        assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items()), kwargs
        assert repr(fresh.optimizer.state_dict()) == opt_before and sgd.state == {}, kwargs
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                   torch.nn.Linear(16, 1))
    with pytest.raises(ckptd.CheckpointConfigError, match="to_empty"):
        ckptd.resume(root, model=meta)
    resumed = ckptd.resume(root, model=fresh.model, optimizer=fresh.optimizer, lr_scheduler=fresh.scheduler,
                           model_dir="model")
    assert resumed.step == 3 and all(torch.equal(v, weights[k]) for k, v in fresh.model.state_dict().items())
