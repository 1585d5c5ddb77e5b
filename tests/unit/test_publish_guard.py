"""``ckptd.commit.publish_guard``: a check run just before every publish of every commit strategy,
in the context that set it only. A save unit runs its save function under one that raises once a
newer job started on the root (tests/integration/test_fenced_save_units.py)."""

from __future__ import annotations

import os
import threading

import pytest

from ckptd.commit import TMP_PREFIX, publish_guard
from ckptd.fencing import FencedError, check_fence
from ckptd.storage import Storage


class Superseded(Exception):
    pass


def refuse() -> None:
    raise Superseded("a newer job owns the root")


@pytest.mark.parametrize("url", ["posix", "memory://guard", "dir"])
def test_a_guard_that_raises_publishes_nothing_and_keeps_the_file_that_was_there(tmp_path, url):
    root = {"posix": str(tmp_path / "root"), "dir": f"dir::file://{tmp_path}/root"}.get(url, url)
    storage = Storage(root)
    path = storage.join("step_5", "model.bin")
    storage.write_atomic(path, b"committed")
    calls = []
    with publish_guard(lambda: calls.append(path)):
        storage.write_atomic(path, b"allowed")
    assert calls and set(calls) == {path} and storage.read_bytes(path) == b"allowed"
    with publish_guard(refuse), pytest.raises(Superseded), storage.open_write(path) as f:
        f.write(b"x" * (8 << 20))  # past an object store's first block: a multipart upload, aborted
    with publish_guard(refuse), pytest.raises(Superseded):
        storage.write_atomic(storage.join("step_5", "new.bin"), b"never")
    assert storage.read_bytes(path) == b"allowed"
    assert sorted(storage.listdir(storage.join("step_5"))) == ["model.bin"]  # no temp file either
    storage.write_atomic(path, b"after")  # the guard ended with its block
    assert storage.read_bytes(path) == b"after"


@pytest.mark.parametrize("url", ["posix", "dir"])
def test_a_guard_that_raises_creates_no_directory(tmp_path, url):
    """A fenced unit leaves no step directory behind: under an epoch template a second directory
    of one step would stop the next job's commit of that step."""
    root = {"posix": str(tmp_path / "root"), "dir": f"dir::file://{tmp_path}/root"}[url]
    storage = Storage(root)
    storage.makedirs(storage.root)
    with publish_guard(refuse):
        with pytest.raises(Superseded):
            storage.makedirs(storage.join("epoch-1_step-7"))
        with pytest.raises(Superseded):
            storage.write_atomic(storage.join("epoch-1_step-7", "model.bin"), b"never")
    assert storage.listdir(storage.root) == []
    with publish_guard(None):  # no check in the block
        storage.write_atomic(storage.join("epoch-1_step-7", "model.bin"), b"own record")
    assert storage.listdir(storage.join("epoch-1_step-7")) == ["model.bin"]


def test_a_guard_is_the_setting_thread_s_only(tmp_path):
    storage = Storage(str(tmp_path))
    other = []
    with publish_guard(refuse):
        t = threading.Thread(target=lambda: other.append(storage.write_atomic(storage.join("a"), b"1")))
        t.start()
        t.join()
        with pytest.raises(Superseded):
            storage.write_atomic(storage.join("b"), b"2")
    assert other == [None] and os.listdir(tmp_path) == ["a"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(TMP_PREFIX)]


def test_check_fence_says_which_side_was_fenced(tmp_path):
    storage = Storage(str(tmp_path))
    d = tmp_path / ".ckptd" / "attempts"
    d.mkdir(parents=True)
    (d / "1.json").write_text('{"attempt": 1, "run": "old", "namespace": null, "root": "r", "started_at": 0, '
                              '"host": "h"}')
    check_fence(storage, 1, "save")  # the newest: nothing to say
    (d / "2.json").write_text('{"attempt": 2, "run": "next", "namespace": null, "root": "r", "started_at": 1, '
                              '"host": "h"}')
    with pytest.raises(FencedError, match=r"superseded by attempt 2 \(run 'next'\).*save did not publish") as e:
        check_fence(storage, 1, "save")
    import pickle

    again = pickle.loads(pickle.dumps(e.value))  # crosses Ray and the writer process's pipe
    assert (again.mine, again.newer, again.who, str(again)) == (1, 2, "save", str(e.value))
    with pytest.raises(FencedError, match="this monitor no longer publishes"):
        check_fence(storage, 1)
