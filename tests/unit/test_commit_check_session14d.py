"""Session 14d: the commit check's single pass over reported files (``Committer._check_reports``),
attacked with real files: shared reports, files rewritten within one tick of the filesystem's
clock, deleted files, and the names save functions return (``describe_returned_files``).

Invariant: a manifest never lists a size or CRC-32 that is not on storage (``ckptd.verify``
accepts every committed step), and the first problem a failed check names does not depend on
the order the units' reports arrived in.
"""

from __future__ import annotations

import os
import zlib

import pytest

import ckptd
from ckptd.config import Kind
from ckptd.coordinator.files import describe_returned_files
from ckptd.errors import CheckpointConfigError
from ckptd.manifest import FileEntry
from ckptd.monitor.commit import CommitCheckError, CommitPlan, Committer
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate

STEP = 3


def _crc(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


def _write(path: str, data: bytes, mtime_ns: int | None = None) -> int:
    """Write ``data``; with ``mtime_ns``, give the file that time (as a rewrite within the same
    tick of the kernel's coarse clock would leave it). Returns the file's mtime."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return os.stat(path).st_mtime_ns


def _commit(root: str, reports: dict[str, list[FileEntry]]):
    committer = Committer(Storage(root), StepDirTemplate("global_step_{step}"), 0)
    plan = CommitPlan(step=STEP, kinds=[Kind.CHECKPOINT], reports=reports,
                      units={Kind.CHECKPOINT: sorted(reports)}, sd_units=set())
    return committer.commit(plan)[Kind.CHECKPOINT]


@pytest.mark.parametrize("stale_last", [True, False])
def test_two_reports_of_one_file_with_the_same_size_and_time_keep_the_bytes_on_storage(tmp_path, stale_last):
    """Two units report one file with the same size and mtime but other CRC-32s (a found-by-time
    unit and the file's writer, the file rewritten within one clock tick): the commit must keep
    the report whose bytes are on storage, whatever order the reports came in. It kept the
    last one, so the manifest listed the CRC of bytes that were gone and verify rejected the
    committed step."""
    root = str(tmp_path / "ckpt")
    path = os.path.join(ckptd.step_dir(root, STEP), "w.bin")
    old, new = b"A" * 64, b"B" * 64
    mtime = _write(path, old)
    _write(path, new, mtime_ns=mtime)
    stale = FileEntry(path="w.bin", size=64, crc32=_crc(old), mtime_ns=mtime)
    current = FileEntry(path="w.bin", size=64, crc32=_crc(new), mtime_ns=mtime)
    reports = {"w0/a#1": [current], "w0/b#2": [stale]} if stale_last else {"w0/b#2": [stale], "w0/a#1": [current]}
    manifest = _commit(root, reports)
    assert [(f.path, f.crc32) for f in manifest.files] == [("w.bin", _crc(new))]
    ckptd.verify(root, STEP)


def test_two_reports_of_one_file_neither_holding_its_bytes_fail_the_commit(tmp_path):
    root = str(tmp_path / "ckpt")
    path = os.path.join(ckptd.step_dir(root, STEP), "w.bin")
    mtime = _write(path, b"C" * 64)
    reports = {"w0/a#1": [FileEntry(path="w.bin", size=64, crc32=_crc(b"A" * 64), mtime_ns=mtime)],
               "w0/b#2": [FileEntry(path="w.bin", size=64, crc32=_crc(b"B" * 64), mtime_ns=mtime)]}
    with pytest.raises(CommitCheckError, match="w.bin is 64 bytes on storage"):
        _commit(root, reports)
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, STEP), "ckptd_manifest.json"))


def test_the_first_problem_and_the_unit_named_do_not_depend_on_report_order(tmp_path):
    """Problems: a.bin reported by two units with sizes storage does not hold, b.bin reported
    but deleted, c.bin fine. Every order of the reports must give the same message (it named
    the last unit to report a.bin)."""
    root = str(tmp_path / "ckpt")
    d = ckptd.step_dir(root, STEP)
    _write(f"{d}/a.bin", b"a" * 10)
    _write(f"{d}/c.bin", b"c" * 10)
    a_st, c_st = os.stat(f"{d}/a.bin"), os.stat(f"{d}/c.bin")
    u1 = [FileEntry(path="a.bin", size=11, crc32="00000000", mtime_ns=a_st.st_mtime_ns),
          FileEntry(path="b.bin", size=3, crc32="00000000", mtime_ns=1)]
    u2 = [FileEntry(path="a.bin", size=12, crc32="00000001", mtime_ns=a_st.st_mtime_ns)]
    u3 = [FileEntry(path="c.bin", size=10, crc32=_crc(b"c" * 10), mtime_ns=c_st.st_mtime_ns)]
    messages = set()
    for order in ([("w/u1#1", u1), ("w/u2#2", u2), ("w/u3#3", u3)], [("w/u3#3", u3), ("w/u2#2", u2), ("w/u1#1", u1)],
                  [("w/u2#2", u2), ("w/u1#1", u1), ("w/u3#3", u3)]):
        with pytest.raises(CommitCheckError) as e:
            _commit(root, dict(order))
        messages.add(str(e.value))
    (message,) = messages
    assert "a.bin is 10 bytes on storage" in message and "missing" not in message


def test_a_reported_file_deleted_before_the_commit_fails_it_naming_every_reporter(tmp_path):
    root = str(tmp_path / "ckpt")
    d = ckptd.step_dir(root, STEP)
    _write(f"{d}/keep.bin", b"k")
    gone = FileEntry(path="sub/gone.bin", size=1, crc32=_crc(b"g"), mtime_ns=1)
    with pytest.raises(CommitCheckError, match=r"sub/gone.bin, reported by w/a#1, w/b#2, is missing"):
        _commit(root, {"w/b#2": [gone], "w/a#1": [gone]})


@pytest.mark.xfail(strict=True, reason=(
    "design limit, in the code before session 14 too: a file reported by one unit whose size and "
    "mtime still match storage is accepted without reading it, so a rewrite with the same size "
    "within one tick of the kernel's coarse clock (a few ms) leaves a manifest whose CRC-32 is "
    "not on storage; closing it means reading every reported file at commit"))
def test_a_single_report_rewritten_within_one_clock_tick_is_caught(tmp_path):
    root = str(tmp_path / "ckpt")
    path = os.path.join(ckptd.step_dir(root, STEP), "w.bin")
    old = b"A" * 64
    mtime = _write(path, old)
    report = FileEntry(path="w.bin", size=64, crc32=_crc(old), mtime_ns=mtime)
    _write(path, b"B" * 64, mtime_ns=mtime)
    try:
        _commit(root, {"w0/a#1": [report]})
    except CommitCheckError:
        return  # refusing the commit would be right too
    ckptd.verify(root, STEP)


def test_returned_paths_are_matched_to_storage_by_their_normal_form(tmp_path):
    """save_fn may return "./a.bin", "sub//b.bin" or an absolute path with "/./" or "//": they
    name files the commit finds listed as "a.bin" and "sub/b.bin". Reported as returned, the
    commit found them "missing from storage" and failed the step."""
    root = str(tmp_path / "ckpt")
    d = ckptd.step_dir(root, STEP)
    _write(f"{d}/a.bin", b"a" * 5)
    _write(f"{d}/sub/b.bin", b"b" * 7)
    storage = Storage(root)
    returned = ["./a.bin", "sub//b.bin", f"{d}/./a.bin", f"{d}//sub/b.bin", "sub/./b.bin"]
    entries = describe_returned_files(storage, d, returned)
    assert [e.path for e in entries] == ["a.bin", "sub/b.bin", "a.bin", "sub/b.bin", "sub/b.bin"]
    manifest = _commit(root, {"w/a#1": entries[:2], "w/b#2": entries[2:]})
    assert [(f.path, f.size) for f in manifest.files] == [("a.bin", 5), ("sub/b.bin", 7)]
    ckptd.verify(root, STEP)
    for bad in ("sub/../../x.bin", f"{d}/../global_step_4/x.bin"):
        with pytest.raises(CheckpointConfigError, match="step directory"):
            describe_returned_files(storage, d, [bad])
    # A tuple from a one-line lambda (makedirs, then write): its items are None and a byte count.
    with pytest.raises(CheckpointConfigError, match=r"item 0 of what save_fn returned is None \(NoneType\), not a "
                                                    r"file path; return None, or a list of the file paths"):
        describe_returned_files(storage, d, [None, 64])


@pytest.mark.parametrize("sd, ck", [("w0/a_sd#1", "w0/z_ck#2"), ("w0/z_sd#1", "w0/a_ck#2")])
@pytest.mark.parametrize("sd_first", [True, False])
def test_a_state_dict_file_a_checkpoint_unit_found_by_time_stays_in_the_state_dict_manifest(
        tmp_path, sd, ck, sd_first):
    """A checkpoint unit whose save_fn returned None ran while the state-dict unit wrote its
    weights, and reports them too (same bytes). The state dict's manifest must list its file: it
    went to whichever report came last, and the state dict committed with no file at all."""
    root = str(tmp_path / "ckpt")
    path = os.path.join(ckptd.step_dir(root, STEP), "model.bin")
    data = b"W" * 64
    entry = FileEntry(path="model.bin", size=64, crc32=_crc(data), mtime_ns=_write(path, data))
    order = (sd, ck) if sd_first else (ck, sd)
    plan = CommitPlan(step=STEP, kinds=[Kind.STATE_DICT], reports={u: [entry] for u in order},
                      units={Kind.STATE_DICT: [sd], Kind.CHECKPOINT: sorted(order)}, sd_units={sd}, found={ck})
    manifest = Committer(Storage(root), StepDirTemplate("global_step_{step}"), 0).commit(plan)[Kind.STATE_DICT]
    assert [f.path for f in manifest.files] == ["model.bin"]
