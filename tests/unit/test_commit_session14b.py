"""Session 14b: PosixRename.open_write after the switch to `{prefix}{pid}-{counter}` temp names and
makedirs only on FileNotFoundError."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from ckptd.commit import TMP_PREFIX, PosixRename, temp_name


def test_temp_names_are_unique_across_threads_and_a_forked_child(tmp_path):
    path = str(tmp_path / "f.bin")
    names: list[str] = []
    lock = threading.Lock()

    def many() -> None:
        mine = [temp_name(path) for _ in range(2000)]
        with lock:
            names.extend(mine)

    threads = [threading.Thread(target=many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r, w = os.pipe()
    pid = os.fork()  # inherits the prefix and the counter's position
    if pid == 0:
        os.close(r)
        os.write(w, "\n".join(temp_name(path) for _ in range(2000)).encode())
        os._exit(0)
    os.close(w)
    parent_next = [temp_name(path) for _ in range(2000)]
    with os.fdopen(r) as f:
        child = f.read().split("\n")
    os.waitpid(pid, 0)
    everything = names + parent_next + child
    assert len(everything) == len(set(everything)) == 8 * 2000 + 4000
    assert all(os.path.basename(n).startswith(TMP_PREFIX) and os.path.dirname(n) == str(tmp_path)
               for n in everything)


def test_open_write_recreates_a_removed_directory_and_a_failed_write_leaves_no_temp(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    strategy = PosixRename(LocalFileSystem())
    d = tmp_path / "pending" / "7"
    strategy.publish(str(d / "a.json"), b"1", durable=True)  # directory made on demand
    shutil.rmtree(tmp_path / "pending")
    strategy.publish(str(d / "b.json"), b"2", durable=True)  # removed meanwhile: made again
    assert (d / "b.json").read_bytes() == b"2" and not (d / "a.json").exists()

    # The directory disappears while the file is being written: nothing is published, no temp left.
    with pytest.raises(FileNotFoundError):
        with strategy.open_write(str(d / "c.json"), durable=True) as f:
            f.write(b"3")
            shutil.rmtree(d)
    assert not d.exists() or not any(d.iterdir())
