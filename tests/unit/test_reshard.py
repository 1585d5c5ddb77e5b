"""Sharded state on another world size, without processes: blocks written as N ranks would, read
back by ckptd's block loader and by DCP's own HuggingFaceStorageReader (real files, no Ray)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.errors import CheckpointConfigError, CorruptCheckpointError
from ckptd.storage import Storage
from ckptd.workers import Shard, save_sharded, shard_dim0, sharded_state
from ckptd.workers.dtensor import GROUPS_FILE
from ckptd.workers.reshard import load_sharded_state
from ckptd.workers.weights import read_weights
from tests.unit.helpers import committed


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def trained(seed: int = 0, steps: int = 2):
    m = model(seed)
    opt = torch.optim.AdamW([{"params": [m[0].weight, m[0].bias], "lr": 0.01},
                             {"params": [m[2].weight, m[2].bias], "lr": 0.02, "betas": (0.8, 0.9)}])
    for _ in range(steps):
        m(torch.randn(4, 5)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def save_as_ranks(root, state: dict[str, torch.Tensor], world: int, **kw) -> list:
    written = []
    for rank in range(world):
        written += save_sharded(f"{root}/model", shard_dim0(state, rank, world), rank=rank, world_size=world, **kw)
    return written


def test_blocks_of_three_ranks_load_into_a_whole_model_and_through_dcp(tmp_path):
    source, _ = trained()
    full = {k: v.detach().clone() for k, v in source.state_dict().items()}
    step = committed(str(tmp_path), save_as_ranks(tmp_path, full, 3))

    target = model(1)
    load_sharded_state(Storage(str(tmp_path)), step, "model", target)()
    assert all(torch.equal(target.state_dict()[k], v) for k, v in full.items())

    # DCP reads the same files with its own reader, and nothing it reads is a pickle.
    into = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(into, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "model")))
    assert all(torch.equal(into[k], v) for k, v in full.items())
    assert not [n for n in os.listdir(tmp_path / "model") if n.endswith((".metadata", ".pt", ".pkl"))]


def test_optimizer_state_moves_by_parameter_name_into_a_fresh_optimizer(tmp_path):
    source, opt = trained()
    state = sharded_state(source, opt, rank=0, world_size=1)
    step = committed(str(tmp_path), state.write(str(tmp_path / "model")))
    groups = json.loads((tmp_path / "model" / GROUPS_FILE).read_text())
    assert [g["params"] for g in groups["param_groups"]] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]

    target, fresh = trained(seed=5, steps=0)  # optimizer state not even created yet
    apply = load_sharded_state(Storage(str(tmp_path)), step, "model", target, fresh)
    assert not fresh.state and not torch.equal(target[0].weight, source[0].weight)  # nothing changed yet
    apply()
    by_name = dict(source.named_parameters())
    for name, p in target.named_parameters():
        assert torch.equal(p, by_name[name])
        for k, v in opt.state[by_name[name]].items():
            assert torch.equal(fresh.state[p][k], v), (name, k)
    assert fresh.param_groups[1]["lr"] == 0.02 and fresh.param_groups[1]["betas"] == (0.8, 0.9)
    # Both continue identically.
    x = torch.randn(4, 5)
    for m, o in ((source, opt), (target, fresh)):
        m(x).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters(), strict=True))
    # The weights reader (rollout, HF export) sees the weights, not the moments.
    assert set(read_weights(Storage(str(tmp_path)), step, "model").keys()) == set(source.state_dict())


def test_optimizer_groups_that_differ_are_refused_before_anything_changes(tmp_path):
    source, opt = trained()
    step = committed(str(tmp_path), sharded_state(source, opt, rank=0, world_size=1).write(str(tmp_path / "m")))
    target = model(3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    other = torch.optim.AdamW(target.parameters())  # one group instead of two
    with pytest.raises(CheckpointConfigError, match="parameter groups differ"):
        load_sharded_state(Storage(str(tmp_path)), step, "m", target, other)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_a_block_missing_from_the_shards_is_refused(tmp_path):
    full = {"w": torch.arange(12.0).reshape(6, 2)}
    written = save_as_ranks(tmp_path, full, 3)
    others = [w for w in written if not w.path.endswith("shard-00001.safetensors")]
    # Rank 1's file rewritten without its rows, and listed so: the damage is in what was saved.
    step = committed(str(tmp_path), others + save_sharded(str(tmp_path / "model"), {}, rank=1, world_size=3))
    holder = torch.nn.Module()
    holder.register_buffer("w", torch.zeros(6, 2))
    with pytest.raises(CorruptCheckpointError, match=r"blocks of .w. .* do not tile"):
        load_sharded_state(Storage(str(tmp_path)), step, "model", holder)


def test_a_damaged_shard_is_named(tmp_path):
    full = {"w": torch.arange(12.0).reshape(6, 2)}
    step = committed(str(tmp_path), save_as_ranks(tmp_path, full, 2))
    path = tmp_path / "model" / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    holder = torch.nn.Module()
    holder.register_buffer("w", torch.zeros(6, 2))
    with pytest.raises(CorruptCheckpointError, match="shard-00001.safetensors"):
        load_sharded_state(Storage(str(tmp_path)), step, "model", holder)
    assert torch.equal(holder.w, torch.zeros(6, 2))


def test_a_shard_rewritten_between_planning_and_reading_is_refused(tmp_path):
    """The blocks are planned from headers read before the files are checked: a file that changes
    in between (and matches its manifest entry afterwards) must not place a block elsewhere."""
    from ckptd.workers.reshard import ShardedCheckpoint

    full = {"w": torch.arange(12.0).reshape(6, 2)}
    written = save_as_ranks(tmp_path, full, 2)
    step = committed(str(tmp_path), written)
    ckpt = ShardedCheckpoint(Storage(str(tmp_path)), step, "model")  # headers read: rank 1 holds rows 3..5
    # Rank 1's file rewritten with its rows claimed at row 0, and the manifest entry to match.
    rewritten = save_sharded(str(tmp_path / "model"), {"w": Shard(full["w"][3:], (0, 0), (6, 2))},
                             rank=1, world_size=2)
    step.files["model/shard-00001.safetensors"] = committed(str(tmp_path), rewritten[:1]).files[
        "model/shard-00001.safetensors"]
    with pytest.raises(CorruptCheckpointError, match="shard-00001.safetensors: changed while it was read"):
        ckpt.copies("w", (0, 0), (6, 2))
