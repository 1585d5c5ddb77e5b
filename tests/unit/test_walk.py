"""ckptd.walk: the walk with GNU find (large steps, off the GIL) sees exactly what the Python walk
sees, on trees with what users' save functions and filesystems leave in a step directory."""

from __future__ import annotations

import os

import pytest

import ckptd
from ckptd import walk
from ckptd.config import Kind
from ckptd.manifest import is_internal
from ckptd.monitor.commit import CommitCheckError
from ckptd.storage import Storage

from .helpers import large_step

needs_find = pytest.mark.skipif(walk._gnu_find() is None, reason="no GNU find here: scan_large is scan")


def _tree(base) -> dict[str, bytes]:
    """A step directory with the odd things a step can hold; returns the files a walk must list."""
    files = {
        "model.safetensors": b"w" * 10,
        "rank0/optim.pt": b"o" * 3,
        "rank0/deep/er/x.bin": b"",
        ".hidden/dot.bin": b"h",
        "with space/a b.bin": b"s" * 7,
        "new\nline.bin": b"n",
        "-leading-dash.bin": b"d",
        "percent %s %T@.bin": b"p",
        os.fsdecode(b"bad-\xff-utf8.bin"): b"u",
        "ckptd_user_notes.json": b"not a manifest",
        "ref/ckptd_manifest.json": b"a copied step's manifest: the job's file",
    }
    for rel, data in list(files.items()):
        path = os.path.join(base, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(base, "empty/dir"))
    for internal in (".ckptd-tmp-123-model.safetensors", "ckptd_manifest.json", "rank0/.ckptd-tmp-9"):
        with open(os.path.join(base, internal), "wb") as f:
            f.write(b"internal")
    outside = os.path.join(os.path.dirname(base), "outside")
    os.makedirs(outside, exist_ok=True)
    with open(os.path.join(outside, "target.bin"), "wb") as f:
        f.write(b"t" * 5)
    os.symlink(os.path.join(outside, "target.bin"), os.path.join(base, "link-to-file.bin"))
    os.symlink(outside, os.path.join(base, "link-to-dir"))  # not entered, not a file
    os.symlink(os.path.join(outside, "gone.bin"), os.path.join(base, "dangling.bin"))  # not a file
    os.mkfifo(os.path.join(base, "a-fifo"))  # no file of a step
    os.symlink(os.path.join(base, "a-fifo"), os.path.join(base, "link-to-fifo"))  # nor this
    files["link-to-file.bin"] = b"t" * 5
    return files


def _find(path: str, skip=None):
    found = walk._find(path, skip)
    assert found is not None, "GNU find did not answer: scan_large would fall back to scan"
    return found


@needs_find
def test_find_and_python_walks_list_the_same_files_with_exact_sizes_and_times(tmp_path):
    base = str(tmp_path / "global_step_1")
    os.makedirs(base)
    files = _tree(base)
    links: list[str] = []
    small = walk.scan(base, is_internal, links)
    large, large_links = _find(base, is_internal)
    assert large == small and large_links == links == ["link-to-file.bin"]
    assert set(large) == set(files)
    for rel, data in files.items():
        st = os.stat(os.path.join(base, rel))
        assert large[rel] == (len(data), st.st_mtime_ns), rel  # nanoseconds exact, not via a float
    got: list[str] = []
    assert walk.scan_large(base, is_internal, got) == small and got == links


@needs_find
def test_find_walk_keeps_ckptd_files_without_skip_and_follows_a_linked_start(tmp_path):
    base = str(tmp_path / "real")
    os.makedirs(base)
    _tree(base)
    assert _find(base)[0] == walk.scan(base)
    assert "ckptd_manifest.json" in _find(base)[0]
    os.symlink(base, str(tmp_path / "linked"))
    assert _find(str(tmp_path / "linked") + "/", is_internal)[0] == walk.scan(base, is_internal)


@needs_find
def test_missing_directories_and_files_give_what_the_python_walk_gives(tmp_path):
    # find fails on a missing start: scan_large then answers as scan does
    assert walk._find(str(tmp_path / "nope"), None) is None
    assert walk.scan_large(str(tmp_path / "nope")) == {} == walk.scan(str(tmp_path / "nope"))
    (tmp_path / "file").write_bytes(b"x")
    assert walk.scan_large(str(tmp_path / "file")) == {} == walk.scan(str(tmp_path / "file"))


@needs_find
def test_an_unreadable_directory_raises_as_the_python_walk_does(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any directory")
    base = tmp_path / "step"
    (base / "locked").mkdir(parents=True)
    (base / "locked" / "a.bin").write_bytes(b"a")
    os.chmod(base / "locked", 0)
    try:
        assert walk._find(str(base), None) is None  # find could not read it all
        with pytest.raises(PermissionError):
            walk.scan_large(str(base))
    finally:
        os.chmod(base / "locked", 0o755)


def test_find_times_parse_exactly():
    assert walk._ns("1795440488.0073903350") == 1795440488007390335
    assert walk._ns("5.5") == 5_500_000_000
    assert walk._ns("-1.0000000000") == -1_000_000_000  # with a fraction: see test_walk_attack.py
    assert walk._ns("12") == 12_000_000_000


def test_storage_walks_large_steps_with_the_same_result(tmp_path):
    base = tmp_path / "step"
    for r in range(50):
        (base / f"rank{r}").mkdir(parents=True)
        for u in range(3):
            (base / f"rank{r}" / f"u{u}.bin").write_bytes(b"x" * u)
    storage = Storage(str(tmp_path))
    listed = storage.walk_files(str(base), skip=is_internal, large=True)
    assert listed == storage.walk_files(str(base), skip=is_internal)
    assert len(listed) == 150 and listed["rank7/u2.bin"].size == 2


@needs_find
@pytest.mark.parametrize("damage", ["none", "missing", "resized", "unclaimed", "fifo", "link_into_other_step"])
def test_a_large_step_walked_by_find_commits_and_fails_as_a_small_one_does(tmp_path, damage):
    """A commit of LARGE_STEP or more reported files walks the step with find: what it commits,
    and every way it must refuse, are those of the Python walk."""
    root = str(tmp_path / "ckpt")
    step_dir = ckptd.step_dir(root, 1)
    committer, plan = large_step(root)
    if damage == "missing":
        os.remove(f"{step_dir}/rank7/u1.bin")
    elif damage == "resized":
        with open(f"{step_dir}/rank7/u1.bin", "ab") as f:
            f.write(b"more")
    elif damage == "unclaimed":
        with open(f"{step_dir}/outside.bin", "wb") as f:
            f.write(b"written by the job outside any unit")
    elif damage == "fifo":
        os.mkfifo(f"{step_dir}/rank3/pipe")  # no file: neither listed nor opened (it would block)
    elif damage == "link_into_other_step":
        other = ckptd.step_dir(root, 0)
        os.makedirs(other)
        with open(f"{other}/shared.bin", "wb") as f:
            f.write(b"s")
        os.symlink(f"{other}/shared.bin", f"{step_dir}/shared.bin")
    if damage in ("missing", "resized"):
        with pytest.raises(CommitCheckError, match="rank7/u1.bin"):
            committer.commit(plan)
        return
    if damage == "link_into_other_step":
        with pytest.raises(CommitCheckError, match="shared.bin"):
            committer.commit(plan)
        return
    manifest = committer.commit(plan)[Kind.CHECKPOINT]
    listed = {f.path for f in manifest.files}
    assert len(listed) == 4 * len(plan.reports) + (damage == "unclaimed")
    assert ("outside.bin" in listed) == (damage == "unclaimed")
    ckptd.verify(root, 1, kind="checkpoint")
