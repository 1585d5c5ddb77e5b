"""Session 14's changes below the commit path, without Ray: the POSIX directory walk every commit,
verify and gc relies on (now a scandir recursion), and UnitId's cached key (now a dataclass field)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ckptd.config import Kind
from ckptd.protocol import UnitId
from ckptd.storage import FileStat, Storage


def _os_walk_view(path: str) -> dict[str, FileStat]:
    """What walk_files returned before the scandir rewrite (os.walk, stat per file)."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except FileNotFoundError:
                continue
            out[os.path.relpath(full, path).replace(os.sep, "/")] = FileStat(st.st_size, st.st_mtime_ns)
    return out


def test_walk_files_keeps_the_os_walk_view_of_links_and_nested_dirs(tmp_path):
    """Nested directories are walked; a symlinked file counts as its target; a symlinked
    directory is not entered (its files belong elsewhere); a dangling link is no file."""
    step = tmp_path / "global_step_1"
    (step / "a" / "b" / "c").mkdir(parents=True)
    (step / "a" / "b" / "c" / "deep.bin").write_bytes(b"x" * 3)
    (step / "model.bin").write_bytes(b"y" * 5)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tokenizer.json").write_bytes(b"z" * 7)
    os.symlink(shared / "tokenizer.json", step / "tok.json")
    os.symlink(shared, step / "shared_dir")
    os.symlink(tmp_path / "gone", step / "dangling")
    (step / "empty").mkdir()

    found = Storage(str(tmp_path)).walk_files(str(step))
    assert {rel: st.size for rel, st in found.items()} == {"a/b/c/deep.bin": 3, "model.bin": 5, "tok.json": 7}
    assert found == _os_walk_view(str(step))
    # A file, or nothing, where a directory is expected: no files.
    assert Storage(str(tmp_path)).walk_files(str(step / "model.bin")) == {}
    assert Storage(str(tmp_path)).walk_files(str(tmp_path / "missing")) == {}


def test_walk_files_raises_for_an_unreadable_subdirectory():
    """os.walk skipped a directory it could not list; the scandir walk raises. Raising is the
    right thing for every caller: a commit that skipped it would write a manifest without the
    files in it (and verify would agree), gc would size and delete what it cannot see. Run as an
    unprivileged user in a child process (root reads any directory)."""
    # Not under pytest's tmp_path: an unprivileged user must be able to reach the directory.
    tmp_path = Path(tempfile.mkdtemp())
    os.chmod(tmp_path, 0o755)
    step = tmp_path / "global_step_1"
    (step / "locked").mkdir(parents=True)
    (step / "locked" / "shard.bin").write_bytes(b"x")
    (step / "model.bin").write_bytes(b"y")
    os.chmod(step / "locked", 0)
    script = textwrap.dedent(f"""
        import os, sys
        from ckptd.storage import Storage
        storage = Storage({str(tmp_path)!r})  # imports done before dropping privileges
        if os.getuid() == 0:
            os.setgid(65534); os.setuid(65534)
        try:
            storage.walk_files({str(step)!r})
        except PermissionError as e:
            print("PermissionError", e.filename)
            sys.exit(0)
        print("no error")
    """)
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        os.chmod(step / "locked", 0o755)
        shutil.rmtree(tmp_path)
    if result.returncode != 0 and "Operation not permitted" in result.stderr:
        pytest.skip("cannot drop privileges here")
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "no error" and os.access(step / "locked", os.R_OK) and os.getuid() != 0:
        pytest.skip("this user can read a mode-0 directory")
    assert result.stdout.split() == ["PermissionError", str(step / "locked")]


def test_unit_id_key_survives_pickling_and_replace():
    """UnitId.key is computed once in __post_init__: pickling (how Ray ships it) keeps it,
    dataclasses.replace recomputes it, and equality and hashing ignore it."""
    from ray import cloudpickle

    u = UnitId(worker="w0", name="model", step=3, kind=Kind.STATE_DICT, call="c1")
    assert u.key == "w0/model#c1"
    for copy in (pickle.loads(pickle.dumps(u)), cloudpickle.loads(cloudpickle.dumps(u)), UnitId.from_dict(u.to_dict())):
        assert copy.key == u.key and copy == u and hash(copy) == hash(u)
    moved = dataclasses.replace(u, call="c2", name="optim")
    assert moved.key == "w0/optim#c2"
    assert "key" not in u.to_dict()
