"""ckptd.walk under attack: trees where GNU find's answer and the Python walk's could part (times
before 1970, links that lead nowhere, paths deeper than PATH_MAX, files changing during the walk),
and a large step's commit over them."""

from __future__ import annotations

import errno
import os
import threading

import pytest

import ckptd
from ckptd import walk
from ckptd.config import Kind

from .helpers import large_step

needs_find = pytest.mark.skipif(walk._gnu_find() is None, reason="no GNU find here: scan_large is scan")

# Before 1970 (1920: many filesystems clamp before 1901), after 2038, with and without a
# fraction of a second (ns).
_TIMES = [-1_500_000_000, -1, -999_999_999, -1_000_000_000, -1_577_923_200_000_000_123, 0, 1,
          1_000_000_000_000_000_007, 2**62]


def _same_or_none(path: str, skip=None) -> dict:
    """The Python walk's answer, after checking that find's is the same or None."""
    links: list[str] = []
    small = walk.scan(path, skip, links)
    found = walk._find(path, skip)
    assert found is None or found == (small, links)
    got: list[str] = []
    assert walk.scan_large(path, skip, got) == small and got == links
    return small


@needs_find
def test_times_before_1970_are_exact_or_left_to_the_python_walk(tmp_path):
    """GNU find prints -1.5 s as "-2.5000000000" (whole seconds rounded down, then a fraction to
    add): read as -2.5 s, every such file looked rewritten to a commit."""
    for i, t in enumerate(_TIMES):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * i)
        os.utime(path, ns=(t, t))
    small = _same_or_none(str(tmp_path))
    assert {rel: st.mtime_ns for rel, st in small.items()} == {f"f{i}": t for i, t in enumerate(_TIMES)}
    # Whole seconds before 1970 read exactly: find still answers.
    for i, t in enumerate(_TIMES):
        if t < 0 and t % 1_000_000_000:
            os.remove(tmp_path / f"f{i}")
    found = walk._find(str(tmp_path), None)
    assert found is not None and found[0] == walk.scan(str(tmp_path))


def test_find_times_before_1970_with_a_fraction_are_refused():
    assert walk._ns("-1.0000000000") == -1_000_000_000 and walk._ns("-3.0") == -3_000_000_000
    for text in ("-2.5000000000", "-1.9999999990", "-0.25"):
        with pytest.raises(ValueError):
            walk._ns(text)


@needs_find
def test_links_that_lead_nowhere_are_no_files_in_either_walk(tmp_path):
    """A loop of links, a link to itself and a link through a file ("file/x") are dangling: the
    Python walk raised on them (ELOOP, ENOTDIR), the find walk raised on a loop."""
    (tmp_path / "model.bin").write_bytes(b"m")
    os.symlink("loop-b", tmp_path / "loop-a")
    os.symlink("loop-a", tmp_path / "loop-b")
    os.symlink("self", tmp_path / "self")
    os.symlink("model.bin/x", tmp_path / "through-a-file")
    os.symlink("model.bin", tmp_path / "link")
    os.symlink("link", tmp_path / "link-to-link")
    assert sorted(_same_or_none(str(tmp_path))) == ["link", "link-to-link", "model.bin"]
    found = walk._find(str(tmp_path), None)
    assert found is not None and sorted(found[1]) == ["link", "link-to-link"]


@needs_find
def test_a_path_longer_than_path_max_is_left_to_the_python_walk(tmp_path):
    """find walks by relative names to any depth; the Python walk (and a checksum) cannot open a
    path of PATH_MAX bytes: find's listing of it would be a file no commit can read."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(22):  # 22 * 201 bytes: past 4096
            os.mkdir("d" * 200, dir_fd=fd)
            inner = os.open("d" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(os.open("deep.bin", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)
    assert walk._find(str(tmp_path), None) is None
    with pytest.raises(OSError) as raised:
        walk.scan_large(str(tmp_path))
    assert raised.value.errno == errno.ENAMETOOLONG


@needs_find
def test_files_created_and_removed_during_the_walk_give_a_right_answer_or_none(tmp_path):
    base = tmp_path / "step"
    for r in range(20):
        (base / f"rank{r}").mkdir(parents=True)
        for u in range(20):
            (base / f"rank{r}" / f"u{u}.bin").write_bytes(b"x" * u)
    stable = walk.scan(str(base))
    stop = threading.Event()

    failed: list[BaseException] = []

    def churn() -> None:
        try:
            _churn()
        except BaseException as e:  # a churn that stopped would leave the walks nothing to race
            failed.append(e)

    def _churn() -> None:
        k = 1  # odd: make the directory first
        while not stop.is_set():
            tmp = base / f"rank{k % 20}" / f"tmp{k}"
            tmp.write_bytes(b"t")
            tmp.unlink()
            flip = base / "flip"  # a directory, then a file, under the same name
            if k % 2:
                flip.mkdir()
                (flip / "in").write_bytes(b"")
            else:
                (flip / "in").unlink()
                flip.rmdir()
                flip.write_bytes(b"f")
                flip.unlink()
            k += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(40):
            found = walk._find(str(base), None)
            if found is not None:
                out = found[0]
                assert {rel: out.get(rel) for rel in stable} == stable
                assert all(rel.startswith("flip") or "/tmp" in rel for rel in out.keys() - stable.keys())
    finally:
        stop.set()
        thread.join()
    assert not failed, f"the churning thread failed: {failed[0]!r}"


@needs_find
def test_a_large_step_with_old_times_and_dead_links_commits_and_verifies(tmp_path):
    """Through Committer.commit with LARGE_STEP reported files (the find walk): a reported and an
    unclaimed file dated before 1970 and links that lead nowhere do not stop the commit, and what
    it lists is what verify accepts."""
    root = str(tmp_path / "ckpt")
    step_dir = ckptd.step_dir(root, 1)

    def old_time(path: str, rank: int, unit: int) -> None:
        if (rank, unit) == (5, 2):
            os.utime(path, ns=(-1_500_000_000, -1_500_000_000))

    committer, plan = large_step(root, touch=old_time)
    with open(f"{step_dir}/outside.bin", "wb") as f:
        f.write(b"written by the job outside any unit")
    os.utime(f"{step_dir}/outside.bin", ns=(-7, -7))
    os.symlink("loop", f"{step_dir}/loop")
    os.symlink("outside.bin/x", f"{step_dir}/rank0/through-a-file")
    manifest = committer.commit(plan)[Kind.CHECKPOINT]
    listed = {f.path: f for f in manifest.files}
    assert len(listed) == 4 * len(plan.reports) + 1
    assert listed["outside.bin"].mtime_ns == -7 and listed["rank5/u2.bin"].mtime_ns == -1_500_000_000
    ckptd.verify(root, 1, kind="checkpoint")
