"""Reading the weights of a step: found from the manifest, checked, memory-mapped, loaded into a model."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from ckptd.errors import CheckpointConfigError, CorruptCheckpointError, UnsafeCheckpointError
from ckptd.manifest import FileEntry
from ckptd.storage import Storage
from ckptd.verify import CommittedStep
from ckptd.workers import save_hf_model, save_sharded, shard_dim0
from ckptd.workers.weights import read_weights
from tests.unit.helpers import committed

CONFIG = {"model_type": "llama"}



def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_safetensors_are_mapped_not_copied(tmp_path):
    sd = {f"w{i}": torch.randn(4 << 20) for i in range(4)}  # 64 MiB
    step = committed(str(tmp_path), save_hf_model(str(tmp_path / "actor"), sd, CONFIG))
    del sd
    before = rss_anon()
    weights = read_weights(Storage(str(tmp_path)), step).state_dict()  # every byte checked
    grown = rss_anon() - before
    assert weights["w3"].shape == (4 << 20,) and grown < 16 << 20, f"{grown >> 20} MiB of anonymous memory"
    # Private mapping: writing to a tensor never changes the file.
    weights["w0"].zero_()
    again = read_weights(Storage(str(tmp_path)), step).state_dict()
    assert again["w0"].abs().sum() > 0


def test_several_weight_directories_need_model_dir(tmp_path):
    sd = {"w": torch.ones(3)}
    written = save_hf_model(str(tmp_path / "actor"), sd, CONFIG) + save_hf_model(str(tmp_path / "critic"), sd, CONFIG)
    step = committed(str(tmp_path), written)
    with pytest.raises(CheckpointConfigError, match=r"several directories \['actor', 'critic'\]; pass model_dir="):
        read_weights(Storage(str(tmp_path)), step)
    assert torch.equal(read_weights(Storage(str(tmp_path)), step, "critic").state_dict()["w"], sd["w"])
    with pytest.raises(CheckpointConfigError, match="no model weights in 'nowhere'"):
        read_weights(Storage(str(tmp_path)), step, "nowhere")


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    written = save_hf_model(str(tmp_path / "actor"), {"w": torch.ones(3)}, CONFIG)
    step = committed(str(tmp_path), [w for w in written if not w.path.endswith(".safetensors")])
    # Without the weights file in the manifest there are no weights to find...
    with pytest.raises(CheckpointConfigError, match="no model weights"):
        read_weights(Storage(str(tmp_path)), step)
    # ... and an index naming a file the manifest does not list is refused.
    written = save_hf_model(str(tmp_path / "big"), {"a": torch.ones(100), "b": torch.ones(100)}, CONFIG,
                            max_shard_size=500)
    listed = [w for w in written if "model-00002" not in w.path]
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00002.safetensors is not listed"):
        read_weights(Storage(str(tmp_path)), committed(str(tmp_path), listed), "big")


def test_shards_that_overlap_instead_of_covering_are_refused(tmp_path):
    full = {"w": torch.arange(8.0)}
    written = []
    for rank in range(2):
        piece = shard_dim0(full, 0, 2)  # both ranks claim the first half
        written += save_sharded(str(tmp_path / "model"), piece, rank=rank, world_size=2)
    with pytest.raises(CorruptCheckpointError, match="do not cover tensors"):
        read_weights(Storage(str(tmp_path)), committed(str(tmp_path), written))


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ckptd-pwned",))


def test_a_pickle_that_needs_objects_is_refused_without_running_it(tmp_path):
    path = tmp_path / "model" / "model.pt"
    path.parent.mkdir()
    torch.save({"w": torch.ones(2), "x": Evil()}, str(path), pickle_protocol=pickle.HIGHEST_PROTOCOL)
    from ckptd.manifest import crc32_file

    size, crc = crc32_file(Storage(str(tmp_path)), str(path))
    step = CommittedStep(1, str(tmp_path), {}, {"model/model.pt": FileEntry(path="model/model.pt", size=size,
                                                                           crc32=crc)})
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        read_weights(Storage(str(tmp_path)), step)
    assert not os.path.exists("/tmp/ckptd-pwned")


def test_load_into_checks_shapes_before_copying_anything(tmp_path):
    step = committed(str(tmp_path), save_hf_model(str(tmp_path / "m"), {"a.weight": torch.ones(4, 4),
                                                                        "b.weight": torch.ones(5, 4)}, CONFIG))
    model = torch.nn.Module()
    model.a = torch.nn.Linear(4, 4, bias=False)
    model.b = torch.nn.Linear(4, 4, bias=False)  # 4x4, the file has 5x4
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointConfigError, match="other shapes"):
        read_weights(Storage(str(tmp_path)), step).load_into(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
