"""Adversarial tests of the sharded format's loader, without processes: real files, damaged on disk
(the manifest then no longer matches) or forged with a manifest that matches them (what a buggy or
hostile writer leaves behind). Every one must be refused with an error naming what is wrong, and
nothing in the model or optimizer may change."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

from ckptd.errors import CheckpointConfigError, CorruptCheckpointError
from ckptd.manifest import FileEntry
from ckptd.storage import Storage
from ckptd.verify import CommittedStep
from ckptd.workers import save_sharded, shard_dim0, sharded_state
from ckptd.workers.dcp import CkptdStorageWriter
from ckptd.workers.dtensor import GROUPS_FILE
from ckptd.workers.files import write_json
from ckptd.workers.reshard import load_sharded_state
from ckptd.workers.safetensors_io import write_safetensors
from ckptd.workers.sharded import METADATA, Shard, dcp_header, shard_name
from ckptd.workers.weights import read_weights

ERRORS = (CorruptCheckpointError, CheckpointConfigError)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def trained(seed: int = 0, steps: int = 2, optim=torch.optim.AdamW):
    m = model(seed)
    opt = optim(m.parameters(), lr=0.01, **({"momentum": 0.9} if optim is torch.optim.SGD else {}))
    for _ in range(steps):
        m(torch.randn(4, 5)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


class Step:
    """A step directory written as two ranks would (model + AdamW state), and its manifest."""

    def __init__(self, root, optim=torch.optim.AdamW, seed: int = 0) -> None:
        self.root = str(root)
        self.dir = f"{self.root}/model"
        self.source, self.opt = trained(seed=seed, optim=optim)
        state = sharded_state(self.source, self.opt, rank=0, world_size=1)
        self.full, self.groups = dict(state.tensors), state.groups
        self.entries: dict[str, FileEntry] = {}
        for rank in range(2):
            self.add(save_sharded(self.dir, shard_dim0(self.full, rank, 2), rank=rank, world_size=2,
                                  extra_files={GROUPS_FILE: self.groups} if rank == 0 else None))

    def add(self, written) -> None:
        """(Re)list files in the manifest with what they hold now (a forgery the manifest matches)."""
        for w in written:
            rel = os.path.relpath(w.path, self.root)
            self.entries[rel] = FileEntry(path=rel, size=w.size, crc32=w.crc32)

    def committed(self) -> CommittedStep:
        return CommittedStep(4, self.root, {}, dict(self.entries))

    def forge_shard(self, rank: int, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> None:
        """Rewrite rank ``rank``'s shard file with these blocks and DCP offsets, and list it."""
        header = dcp_header({k: {"saved_offsets": o} for k, o in offsets.items()})
        self.add([write_safetensors(Storage(self.dir), f"{self.dir}/{shard_name(rank)}", tensors, header)])

    def forge_json(self, name: str, value) -> None:
        self.add([write_json(Storage(self.dir), f"{self.dir}/{name}", value)])

    def metadata(self) -> dict:
        with open(f"{self.dir}/{METADATA}") as f:
            return json.load(f)

    def load(self, target, optimizer=None):
        return load_sharded_state(Storage(self.root), self.committed(), "model", target, optimizer)

    def rank_pieces(self, rank: int) -> dict[str, Shard]:
        return shard_dim0(self.full, rank, 2)


def fresh():
    """A different model and an AdamW with state, so any change shows."""
    return trained(seed=7, steps=1)


def snapshot(m, opt) -> dict:
    out = {f"model.{k}": v.clone() for k, v in m.state_dict().items()}
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            out[f"optim.{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["groups"] = copy.deepcopy(sd["param_groups"])
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def refused(step: Step, match: str, *, optimizer: bool = True, error=ERRORS) -> str:
    """Load into a fresh model (and optimizer); it must raise ``error`` naming ``match``, at load
    time (before the apply function exists), and change nothing."""
    m, opt = fresh()
    before = snapshot(m, opt)
    with pytest.raises(error) as e:
        step.load(m, opt if optimizer else None)()
    assert match in str(e.value), str(e.value)
    assert same(before, snapshot(m, opt)), "the model or optimizer changed"
    return str(e.value)


def test_an_intact_step_loads_exactly(tmp_path):
    step = Step(tmp_path)
    m, opt = fresh()
    step.load(m, opt)()
    assert all(torch.equal(v, step.source.state_dict()[k]) for k, v in m.state_dict().items())
    src = dict(step.source.named_parameters())
    for name, p in m.named_parameters():
        for k, v in step.opt.state[src[name]].items():
            assert torch.equal(opt.state[p][k], v), (name, k)


# -- damage on disk after the commit: the manifest no longer matches ----------------------------


def _flip_data(d):
    p = f"{d}/shard-00001.safetensors"
    data = bytearray(open(p, "rb").read())
    data[-5] ^= 0x40
    open(p, "wb").write(bytes(data))


def _flip_header_offset(d):
    """Same size, an offset in the header changed: rank 1's block of 0.weight moves up a row."""
    p = f"{d}/shard-00001.safetensors"
    data = open(p, "rb").read()
    forged = data.replace(b'\\"0.weight\\":{\\"saved_offsets\\":[4,', b'\\"0.weight\\":{\\"saved_offsets\\":[3,')
    assert forged != data and len(forged) == len(data)
    open(p, "wb").write(forged)


def _truncate(d):
    p = f"{d}/shard-00001.safetensors"
    os.truncate(p, os.path.getsize(p) - 4)


def _append(d):
    with open(f"{d}/shard-00001.safetensors", "ab") as f:
        f.write(b"\0" * 8)


def _remove(d):
    os.remove(f"{d}/shard-00001.safetensors")


def _rename(d):
    os.rename(f"{d}/shard-00001.safetensors", f"{d}/shard-00002.safetensors")


def _swap(d):
    a, b = f"{d}/shard-00000.safetensors", f"{d}/shard-00001.safetensors"
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)


def _replace_with_other_step(d):
    """Rank 1's file replaced by the same rank's file of another (also valid) checkpoint."""
    other = Step(f"{d}/../../other", seed=1)
    shutil.copyfile(f"{other.dir}/shard-00001.safetensors", f"{d}/shard-00001.safetensors")


def _metadata_shapes(d):
    meta = json.load(open(f"{d}/{METADATA}"))
    meta["shapes"]["0.weight"] = [8, 5]
    json.dump(meta, open(f"{d}/{METADATA}", "w"))


def _metadata_files(d):
    meta = json.load(open(f"{d}/{METADATA}"))
    meta["files"] = ["shard-00000.safetensors"]
    json.dump(meta, open(f"{d}/{METADATA}", "w"))


def _groups_lr(d):
    groups = json.load(open(f"{d}/{GROUPS_FILE}"))
    groups["param_groups"][0]["lr"] = 1.0
    json.dump(groups, open(f"{d}/{GROUPS_FILE}", "w"))


@pytest.mark.parametrize("damage, named", [
    (_flip_data, "shard-00001.safetensors"),
    (_flip_header_offset, "shard-00001.safetensors"),
    (_truncate, "shard-00001.safetensors"),
    (_append, "shard-00001.safetensors"),
    (_remove, "shard-00001.safetensors"),
    (_rename, "shard-00001.safetensors"),
    (_swap, "shard-0000"),
    (_replace_with_other_step, "shard-00001.safetensors"),
    (_metadata_shapes, METADATA),
    (_metadata_files, METADATA),
    (_groups_lr, GROUPS_FILE),
])
def test_damage_after_the_commit_is_refused_and_changes_nothing(tmp_path, damage, named):
    step = Step(tmp_path / "a")
    damage(step.dir)
    msg = refused(step, named, error=CorruptCheckpointError)
    assert any(w in msg for w in ("manifest", "checksum", "size", "missing", "not a readable")), msg
    if named != GROUPS_FILE:  # the weights reader (HF export, rollout) refuses it too
        with pytest.raises(CorruptCheckpointError):
            read_weights(Storage(step.root), step.committed(), "model")


# -- forgeries the manifest matches: the files themselves lie -------------------------------------


def test_a_block_forged_to_overlap_another_ranks_block_is_refused(tmp_path):
    step = Step(tmp_path)
    pieces = step.rank_pieces(1)
    # Rank 1 holds rows 4..6 of 0.weight (7 x 5); its header says they start at row 3.
    tensors = {k: p.tensor for k, p in pieces.items()}
    offsets = {k: list(p.offsets) for k, p in pieces.items()}
    offsets["0.weight"] = [3, 0]
    step.forge_shard(1, tensors, offsets)
    with pytest.raises(CorruptCheckpointError):  # the weights reader sees it
        read_weights(Storage(step.root), step.committed(), "model")
    refused(step, "0.weight")


def test_a_block_whose_header_shape_lies_is_refused(tmp_path):
    step = Step(tmp_path)
    pieces = step.rank_pieces(0)
    tensors = {k: p.tensor for k, p in pieces.items()}
    tensors["0.weight"] = tensors["0.weight"].reshape(5, 4)  # same bytes, another shape; still fits 7x5
    step.forge_shard(0, tensors, {k: list(p.offsets) for k, p in pieces.items()})
    with pytest.raises(CorruptCheckpointError):
        read_weights(Storage(step.root), step.committed(), "model")
    refused(step, "0.weight")


def test_a_block_whose_dtype_lies_is_refused(tmp_path):
    step = Step(tmp_path)
    pieces = step.rank_pieces(1)
    tensors = {k: p.tensor for k, p in pieces.items()}
    tensors["0.weight"] = tensors["0.weight"].contiguous().view(torch.int32)  # same bytes, another dtype
    step.forge_shard(1, tensors, {k: list(p.offsets) for k, p in pieces.items()})
    with pytest.raises(CorruptCheckpointError):
        read_weights(Storage(step.root), step.committed(), "model")
    refused(step, "0.weight")


@pytest.mark.parametrize("offsets", [[5, 0], [-1, 0], [4], [4, 0, 0], [4, 1]])
def test_a_block_forged_outside_its_tensor_is_refused(tmp_path, offsets):
    step = Step(tmp_path)
    pieces = step.rank_pieces(1)
    forged = {k: list(p.offsets) for k, p in pieces.items()}
    forged["0.weight"] = offsets
    step.forge_shard(1, {k: p.tensor for k, p in pieces.items()}, forged)
    refused(step, "0.weight", error=CorruptCheckpointError)


def test_a_block_without_a_placement_is_refused(tmp_path):
    step = Step(tmp_path)
    pieces = step.rank_pieces(1)
    offsets = {k: list(p.offsets) for k, p in pieces.items() if k != "0.weight"}
    step.forge_shard(1, {k: p.tensor for k, p in pieces.items()}, offsets)
    refused(step, "0.weight", error=CorruptCheckpointError)


def test_a_tensor_forged_into_another_ranks_file_is_refused(tmp_path):
    """Rank 1's file also claims rank 0's rows of 0.weight (an extra, duplicated block)."""
    step = Step(tmp_path)
    pieces = step.rank_pieces(1)
    tensors = {k: p.tensor for k, p in pieces.items()}
    offsets = {k: list(p.offsets) for k, p in pieces.items()}
    tensors["0.bias"] = step.full["0.bias"]  # the whole bias, though rank 0 holds rows 0..3
    offsets["0.bias"] = [0]
    step.forge_shard(1, tensors, offsets)
    refused(step, "0.bias", error=CorruptCheckpointError)


@pytest.mark.parametrize("lie, named, error", [
    (lambda m: m["shapes"].__setitem__("0.weight", [8, 5]), "0.weight", CorruptCheckpointError),
    (lambda m: m["shapes"].__setitem__("0.weight", [6, 5]), "0.weight", CorruptCheckpointError),
    (lambda m: m["shapes"].__setitem__("0.weight", [7, 5, 1]), "0.weight", CorruptCheckpointError),
    (lambda m: m["shapes"].__setitem__("optim.state.0.weight.exp_avg", [8, 5]), "exp_avg", ERRORS),
    (lambda m: m["shapes"].pop("0.weight"), "0.weight", CorruptCheckpointError),
    (lambda m: m.__setitem__("files", ["shard-00000.safetensors"]), "do not tile", CorruptCheckpointError),
    (lambda m: m.__setitem__("files", ["shard-00000.safetensors"] * 2 + ["shard-00001.safetensors"]),
     "do not tile", CorruptCheckpointError),
    (lambda m: m["files"].append("shard-00002.safetensors"), "shard-00002.safetensors", CorruptCheckpointError),
    (lambda m: m["files"].append("../model/shard-00001.safetensors"), "shard", CorruptCheckpointError),
    (lambda m: m.__setitem__("version", 3), "version", CorruptCheckpointError),
])
def test_sharded_metadata_that_lies_is_refused(tmp_path, lie, named, error):
    step = Step(tmp_path)
    meta = step.metadata()
    lie(meta)
    step.forge_json(METADATA, meta)
    refused(step, named, error=error)


def test_an_extra_shard_file_listed_in_metadata_and_manifest_is_refused(tmp_path):
    """A third file, a copy of rank 1's, listed everywhere: every block of it is a duplicate."""
    step = Step(tmp_path)
    shutil.copyfile(f"{step.dir}/shard-00001.safetensors", f"{step.dir}/shard-00002.safetensors")
    rel = "model/shard-00002.safetensors"
    step.entries[rel] = step.entries["model/shard-00001.safetensors"].model_copy(update={"path": rel})
    meta = step.metadata()
    meta["files"].append("shard-00002.safetensors")
    step.forge_json(METADATA, meta)
    refused(step, "do not tile", error=CorruptCheckpointError)


def test_optimizer_groups_whose_parameters_lie_are_refused(tmp_path):
    step = Step(tmp_path)
    groups = copy.deepcopy(step.groups)
    groups["param_groups"][0]["params"][:2] = groups["param_groups"][0]["params"][1::-1]  # swapped names
    step.forge_json(GROUPS_FILE, groups)
    refused(step, "0.weight", error=CheckpointConfigError)


@pytest.mark.parametrize("groups", [
    {"param_groups": "x"},
    {"scalars": {}},
    {"param_groups": [{"lr": 0.1}]},
])
def test_unreadable_optimizer_groups_are_refused(tmp_path, groups):
    step = Step(tmp_path)
    step.forge_json(GROUPS_FILE, groups)
    refused(step, "", error=ERRORS)


@pytest.mark.parametrize("scalars", [[], {"0.weight": 5}])
def test_optimizer_groups_with_forged_scalars_are_refused_before_anything_changes(tmp_path, scalars):
    step = Step(tmp_path)
    step.forge_json(GROUPS_FILE, {**step.groups, "scalars": scalars})
    refused(step, GROUPS_FILE, error=CorruptCheckpointError)


def test_optimizer_groups_whose_scalars_contradict_the_saved_tensors_are_refused(tmp_path):
    step = Step(tmp_path)
    step.forge_json(GROUPS_FILE, {**step.groups, "scalars": {"0.weight": {"step": 99.0}}})
    refused(step, "step", error=CorruptCheckpointError)


def test_state_of_another_optimizer_type_is_refused(tmp_path):
    step = Step(tmp_path, optim=torch.optim.SGD)
    assert step.groups["type"] == "SGD"
    refused(step, "SGD", error=CheckpointConfigError)


def test_dcp_save_with_non_tensor_entries_is_refused_before_anything_is_written(tmp_path):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    writer = CkptdStorageWriter(str(out))
    # DCP wraps the writer's refusal in its CheckpointException (a BaseException); the message names it.
    with pytest.raises(BaseException) as e:  # noqa: B017
        writer.save({"w": torch.ones(3), "epoch": 3, "note": {"a": "b"}})
    assert "epoch" in str(e.value) and "non-tensor" in str(e.value), str(e.value)
    assert not out.exists() or not os.listdir(out)
    assert writer.written == []
    # And one with tensors only works, and reads back through DCP's own reader.
    writer.save({"w": torch.arange(3.0)})
    into = {"w": torch.zeros(3)}
    dcp.load(into, storage_reader=dcp.HuggingFaceStorageReader(str(out)))
    assert torch.equal(into["w"], torch.arange(3.0))
