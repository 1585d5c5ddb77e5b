"""Validation of steps, names, counts, options and roots; failpoints; storage atomicity."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from ckptd import failpoints
from ckptd.config import Kind, MonitorOptions, SaveStrategy
from ckptd.errors import CheckpointConfigError, FailpointError
from ckptd.layout import latest_step, step_dir
from ckptd.shared_root import check_writable
from ckptd.storage import Storage
from ckptd.units import check_count, check_name, check_step, check_timeout


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True, 2.0])
def test_bad_steps(bad):
    with pytest.raises(CheckpointConfigError, match="global_step"):
        check_step(bad)


@pytest.mark.parametrize("bad", ["no", "yes", None, 2, -1, 0.5, [True]])
def test_a_kind_flag_that_is_not_a_bool_is_refused(bad):
    with pytest.raises(CheckpointConfigError, match="is_state_dict must be True .* or False"):
        Kind.from_flag(bad)


def test_kind_flags():
    import numpy as np

    assert Kind.from_flag(True) is Kind.STATE_DICT and Kind.from_flag(False) is Kind.CHECKPOINT
    assert Kind.from_flag(1) is Kind.STATE_DICT and Kind.from_flag(np.int64(0)) is Kind.CHECKPOINT


@pytest.mark.parametrize("bad", [-1, -0.5, "3", True, float("nan"), [1]])
def test_a_bad_timeout_is_refused(bad):
    with pytest.raises(CheckpointConfigError, match="timeout_s must be"):
        check_timeout(bad)


def test_timeouts():
    assert check_timeout(None) is None and check_timeout(0) == 0.0 and check_timeout(2.5) == 2.5
    assert check_timeout(float("inf")) == float("inf")


def test_good_steps():
    import numpy as np

    assert check_step(0) == 0 and check_step(np.int64(7)) == 7


@pytest.mark.parametrize("bad", ["", "a/b", "a\\b", "..", "x..y", ".", "a\x00b", "tab\tname", 3, None, "x" * 201])
def test_bad_names(bad):
    with pytest.raises(CheckpointConfigError):
        check_name(bad)


@pytest.mark.parametrize("good", ["model", "optimizer_rank0", "w-1.bin", "é"])
def test_good_names(good):
    assert check_name(good) == good


@pytest.mark.parametrize("bad", [-1, 1.0, "2", True])
def test_bad_counts(bad):
    with pytest.raises(CheckpointConfigError, match="checkpoint_thread_count"):
        check_count(bad, "checkpoint_thread_count")


def test_unknown_and_invalid_options_say_what_to_do():
    with pytest.raises(CheckpointConfigError, match="save_stratgy.*Known options:.*save_strategy"):
        MonitorOptions.parse({"save_stratgy": "single_thread"})
    with pytest.raises(CheckpointConfigError, match="step_timeout_s must be > 0"):
        MonitorOptions.parse({"step_timeout_s": 0})
    with pytest.raises(CheckpointConfigError, match="save_strategy"):
        MonitorOptions.parse({"save_strategy": "one_at_a_time"})
    assert MonitorOptions.parse({"save_strategy": "single_node"}).save_strategy is SaveStrategy.SINGLE_NODE
    with pytest.raises(CheckpointConfigError, match="direct_io: Input should be 'auto', 'on' or 'off'"):
        MonitorOptions.parse({"direct_io": "sometimes"})
    assert MonitorOptions.parse({}).direct_io == "auto"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_root_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with pytest.raises(CheckpointConfigError, match="cannot be written"):
        check_writable(Storage(str(ro)), "the test")


def test_root_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointConfigError, match="cannot be written"):
        check_writable(Storage(str(f)), "the test")


def test_relative_root_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Storage("ckpts").root == str(tmp_path / "ckpts")


def test_failpoints_reject_unknown_names_and_actions():
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.arm("before_manifst")
    with pytest.raises(ValueError, match="unknown failpoint action"):
        failpoints.arm("before_manifest", "explode")
    for bad in ("until:5", "until:x:/tmp/gate", "until:-1:/tmp/gate"):
        with pytest.raises(ValueError, match="until:SECONDS:PATH"):
            failpoints.arm("before_manifest", bad)
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.hit("nope")


def test_an_until_failpoint_holds_until_its_file_exists_or_its_bound(tmp_path):
    gate = tmp_path / "gate"
    failpoints.arm("before_manifest", f"until:30:{gate}")
    try:
        threading.Timer(0.2, gate.touch).start()
        started = time.monotonic()
        failpoints.hit("before_manifest")  # released by the file, long before its 30 s bound
        assert 0.15 < time.monotonic() - started < 20
        failpoints.arm("before_manifest", f"until:0.2:{tmp_path / 'never'}")
        started = time.monotonic()
        failpoints.hit("before_manifest")  # no file: the bound ends it
        assert time.monotonic() - started >= 0.2
    finally:
        failpoints.disarm()


def test_a_raise_until_failpoint_refuses_every_hit_once_or_not_until_its_file_exists(tmp_path, monkeypatch):
    """Storage that refuses a retried request for as long as a test needs: every hit raises, also
    with CKPTD_FAILPOINTS_ONCE set (which limits the other actions to one hit), until the file."""
    monkeypatch.setenv(failpoints.ONCE_ENV_VAR, str(tmp_path / "once"))
    gate = tmp_path / "gate"
    failpoints.arm("before_revoke", f"raise_until:{gate}")
    try:
        for _ in range(3):
            with pytest.raises(FailpointError, match="until"):
                failpoints.hit("before_revoke")
        gate.touch()
        failpoints.hit("before_revoke")  # let through
    finally:
        failpoints.disarm()
    with pytest.raises(ValueError, match="raise_until:PATH"):
        failpoints.arm("before_revoke", "raise_until:")


def test_failpoints_fire_when_armed_in_process_or_env(monkeypatch):
    failpoints.hit("before_manifest")  # not armed: nothing happens
    failpoints.arm("before_manifest")
    try:
        with pytest.raises(FailpointError):
            failpoints.hit("before_manifest")
    finally:
        failpoints.disarm()
    failpoints.hit("before_manifest")
    monkeypatch.setenv(failpoints.ENV_VAR, "after_unit_write=raise")
    with pytest.raises(FailpointError):
        failpoints.hit("after_unit_write")
    monkeypatch.setenv(failpoints.ENV_VAR, "after_unit_wrte=raise")
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.hit("after_unit_write")


def test_atomic_write_failure_keeps_old_content_and_leaves_no_temp(tmp_path):
    s = Storage(str(tmp_path))
    path = s.join("tracker.txt")
    s.write_atomic(path, b"1\n")
    failpoints.arm("before_tracker_rename")
    try:
        with pytest.raises(FailpointError):
            s.write_atomic(path, b"2\n", before_publish=lambda: failpoints.hit("before_tracker_rename"))
    finally:
        failpoints.disarm()
    assert (tmp_path / "tracker.txt").read_text() == "1\n"
    assert os.listdir(tmp_path) == ["tracker.txt"]


def test_memory_backend_round_trip():
    s = Storage("memory://ckptd-unit-test")
    s.write_atomic(s.join("a", "b.txt"), b"hello")
    assert s.read_bytes(s.join("a", "b.txt")) == b"hello"
    assert s.walk_files(s.join("a"))["b.txt"].size == 5
    s.rm(s.join("a"))
    assert not s.exists(s.join("a", "b.txt"))


def test_latest_step_requires_a_manifest(tmp_path):
    root = str(tmp_path)
    assert latest_step(root) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10\n")
    os.makedirs(step_dir(root, 10))
    assert latest_step(root) is None  # tracker points at a step with no manifest
    os.makedirs(step_dir(root, 9))
    (tmp_path / "global_step_9" / "ckptd_manifest.json").write_text("{}")
    assert latest_step(root) == 9
    assert latest_step(root, "state_dict") == 9  # a full checkpoint counts as a state dict
    with pytest.raises(CheckpointConfigError, match="kind must be"):
        latest_step(root, "weights")


def test_step_dir_sorts_numerically_and_validates(tmp_path):
    assert step_dir("memory://b/run/", 10) == "memory://b/run/global_step_10"
    with pytest.raises(CheckpointConfigError):
        step_dir("/x", -1)
