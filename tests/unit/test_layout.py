"""Step directory templates, numeric ordering, and the reader-side predicates."""

from __future__ import annotations

import os

import pytest

import ckptd
from ckptd.config import Kind, MonitorOptions
from ckptd.errors import CheckpointConfigError
from ckptd.layout import MANIFESTS, committed_steps, record_template, scan_steps
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate


@pytest.mark.parametrize(("template", "step", "epoch", "name"), [
    ("global_step_{step}", 12, None, "global_step_12"),
    ("epoch-{epoch}_step-{step}", 30, 1, "epoch-1_step-30"),
    ("step_{step}", 0, None, "step_0"),
])
def test_templates_name_and_parse(template, step, epoch, name):
    t = StepDirTemplate(template)
    assert t.name(step, epoch) == name
    assert t.parse(name) == step
    assert t.parse(name + "x") is None and t.parse("latest_checkpointed_iteration.txt") is None


def test_parse_accepts_canonical_numbers_only():
    t = StepDirTemplate("global_step_{step}")
    assert t.parse("global_step_010") is None and t.parse("global_step_-1") is None


@pytest.mark.parametrize("bad", ["ckpt", "{step}{epoch}", "a/{step}", "{step}_{foo}", "{step:06d}", ".{step}"])
def test_bad_templates_are_refused_with_examples(bad):
    with pytest.raises(CheckpointConfigError, match="global_step_"):
        MonitorOptions.parse({"step_dir_template": bad})


def test_epoch_template_needs_the_epoch():
    with pytest.raises(CheckpointConfigError, match="needs the epoch"):
        StepDirTemplate("epoch-{epoch}_step-{step}").name(3)


def _commit(root, name: str, kind: Kind = Kind.CHECKPOINT) -> None:
    os.makedirs(f"{root}/{name}", exist_ok=True)
    with open(f"{root}/{name}/{MANIFESTS[kind]}", "w") as f:
        f.write("{}")


@pytest.mark.parametrize(("template", "names"), [
    ("global_step_{step}", ["global_step_9", "global_step_10", "global_step_100"]),
    ("epoch-{epoch}_step-{step}", ["epoch-0_step-9", "epoch-1_step-10", "epoch-9_step-100"]),
    ("step_{step}", ["step_9", "step_10", "step_100"]),
])
def test_steps_sort_numerically_under_every_template(tmp_path, template, names):
    root = str(tmp_path)
    record_template(Storage(root), StepDirTemplate(template))
    for name in names:
        _commit(root, name)
    os.makedirs(f"{root}/{names[0]}x")  # not a step directory
    assert committed_steps(Storage(root), Kind.CHECKPOINT) == [9, 10, 100]
    assert ckptd.latest_step(root) == 100
    assert ckptd.step_dir(root, 10) == f"{root}/{names[1]}"  # an existing step is looked up


def test_a_root_keeps_its_template(tmp_path):
    s = Storage(str(tmp_path))
    record_template(s, StepDirTemplate("step_{step}"))
    record_template(s, StepDirTemplate("step_{step}"))  # the same again is fine
    with pytest.raises(CheckpointConfigError, match="names its step directories 'step_"):
        record_template(s, StepDirTemplate("global_step_{step}"))


def test_scan_prefers_the_committed_directory_of_a_step(tmp_path):
    root = str(tmp_path)
    record_template(Storage(root), StepDirTemplate("epoch-{epoch}_step-{step}"))
    os.makedirs(f"{root}/epoch-1_step-5")  # a crashed attempt
    _commit(root, "epoch-0_step-5", Kind.STATE_DICT)
    entry = scan_steps(Storage(root))[5]
    assert entry.name == "epoch-0_step-5" and entry.kinds == {Kind.STATE_DICT}
    assert ckptd.latest_step(root, "state_dict") == 5 and ckptd.latest_step(root) is None


def test_changed_files_counts_a_listed_path_that_is_no_longer_a_regular_file(tmp_path):
    """What the state-dict checks read back (``manifest.changed_files``): a listed file replaced
    by a directory, a pipe or a symlink loop is changed, not an error that leaves the check
    without an answer; an intact file is not."""
    from ckptd.manifest import FileEntry, changed_files, crc32_file

    storage = Storage(str(tmp_path))
    step = tmp_path / "global_step_1"
    step.mkdir()
    entries = []
    for name in ("intact.bin", "dir.bin", "pipe.bin", "loop.bin", "gone.bin"):
        (step / name).write_bytes(os.urandom(64))
        size, crc = crc32_file(storage, storage.join("global_step_1", name))
        entries.append(FileEntry(path=name, size=size, crc32=crc))
    for name in ("dir.bin", "pipe.bin", "loop.bin", "gone.bin"):
        (step / name).unlink()
    (step / "dir.bin").mkdir()
    os.mkfifo(step / "pipe.bin")
    os.symlink("loop.bin", step / "loop.bin")
    assert changed_files(storage, "global_step_1", entries) == ["dir.bin", "pipe.bin", "loop.bin", "gone.bin"]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_directory_named_like_a_manifest_commits_nothing(tmp_path, where):
    """A save that made a directory called ``ckptd_manifest.json`` at the top of its step (bad
    input) does not make the step committed for readers, retention or a restarted monitor."""
    import uuid

    storage = Storage(str(tmp_path / "root") if where == "local" else f"memory://layout-{uuid.uuid4().hex[:8]}/r")
    storage.write_atomic(storage.join("global_step_1", MANIFESTS[Kind.STATE_DICT]), b"{}")
    storage.write_atomic(storage.join("global_step_1", MANIFESTS[Kind.CHECKPOINT], "x.bin"), b"x")
    storage.write_atomic(storage.join("global_step_2", MANIFESTS[Kind.CHECKPOINT], "x.bin"), b"x")
    entries = scan_steps(storage, StepDirTemplate("global_step_{step}"))
    assert entries[1].kinds == {Kind.STATE_DICT} and entries[2].kinds == frozenset()
    assert committed_steps(storage, Kind.CHECKPOINT) == []
