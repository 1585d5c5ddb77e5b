"""What verify and the loaders say when the step or root asked for is not there (found by a
user's-eyes audit, session 36: "not committed" alone could mean any of these)."""

from __future__ import annotations

import os
import zlib

import pytest

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS, step_dir
from ckptd.manifest import FileEntry, build_manifest
from ckptd.storage import Storage
from ckptd.verify import open_step


def _commit(root: str, step: int, kind: Kind = Kind.CHECKPOINT) -> None:
    d = step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/m.bin", "wb") as f:
        f.write(b"m")
    entry = FileEntry(path="m.bin", size=1, crc32=f"{zlib.crc32(b'm'):08x}")
    with open(f"{d}/{MANIFESTS[kind]}", "wb") as f:
        f.write(build_manifest(step, kind, ["w/m"], [entry]).to_bytes())


def test_a_missing_root_is_named_as_missing(tmp_path):
    root = str(tmp_path / "no-such-root")
    with pytest.raises(ckptd.CheckpointError, match="no committed checkpoint under .*: the root does not exist"):
        ckptd.verify(root)
    with pytest.raises(ckptd.CheckpointError, match="step 3 is not committed .*: the root does not exist"):
        ckptd.verify(root, 3)


def test_a_step_never_saved_or_deleted_names_the_newest_committed(tmp_path):
    root = str(tmp_path / "ckpt")
    _commit(root, 8)
    _commit(root, 9, Kind.STATE_DICT)
    with pytest.raises(ckptd.CheckpointError, match=r"step 5 is not committed .*: no directory of it exists: it was "
                                                    r"never saved, or retention, gc or a retirement deleted it \(the "
                                                    r"newest committed: checkpoint 8, state_dict 9\)"):
        ckptd.verify(root, 5)


def test_a_step_without_a_manifest_or_of_the_other_kind_says_so(tmp_path):
    root = str(tmp_path / "ckpt")
    os.makedirs(step_dir(root, 4))
    with pytest.raises(ckptd.CheckpointError, match="step 4 is not committed .*: its directory has no manifest"):
        ckptd.verify(root, 4)
    _commit(root, 6, Kind.STATE_DICT)
    with pytest.raises(ckptd.CheckpointError, match="step 6 is not committed as a checkpoint .*: it is committed "
                                                    "as a state_dict only"):
        open_step(Storage(root), 6, Kind.CHECKPOINT)
