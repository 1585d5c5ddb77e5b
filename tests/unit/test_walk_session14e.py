"""The stat walk's view after session 14d (skip by relative path, regular files only), without Ray."""

from __future__ import annotations

import os

from ckptd.manifest import is_internal
from ckptd.storage import TMP_PREFIX, Storage


def test_the_walk_lists_regular_files_and_links_to_them_only(tmp_path):
    """A named pipe, a link to it and a dangling link are no files of a step (checksumming a pipe
    blocks for ever); a link to a regular file counts as that file."""
    step = tmp_path / "global_step_1"
    step.mkdir()
    (step / "model.bin").write_bytes(b"m" * 3)
    os.mkfifo(step / "progress.pipe")
    os.symlink(step / "progress.pipe", step / "pipe.link")
    os.symlink(step / "model.bin", step / "model.link")
    os.symlink(tmp_path / "gone", step / "dangling")
    found = Storage(str(tmp_path)).walk_files(str(step))
    assert {rel: st.size for rel, st in found.items()} == {"model.bin": 3, "model.link": 3}


def test_ckptd_names_are_internal_only_where_ckptd_writes_them(tmp_path):
    """Manifests at the top of a step only; temp files of atomic writes anywhere."""
    assert is_internal("ckptd_manifest.json") and is_internal("ckptd_state_dict_manifest.json")
    assert is_internal(f"{TMP_PREFIX}model.bin-1") and is_internal(f"sub/{TMP_PREFIX}x")
    assert not is_internal("ref/ckptd_manifest.json") and not is_internal("model.bin")
    step = tmp_path / "global_step_1"
    (step / "ref").mkdir(parents=True)
    for rel in ("ckptd_manifest.json", "ref/ckptd_manifest.json", f"ref/{TMP_PREFIX}x", "ref/w.bin"):
        (step / rel).write_bytes(b"{}")
    found = Storage(str(tmp_path)).walk_files(str(step), skip=is_internal)
    assert sorted(found) == ["ref/ckptd_manifest.json", "ref/w.bin"]
