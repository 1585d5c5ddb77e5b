"""One storage conformance suite, run against every backend (fsspec's tests/abstract pattern).

Each backend is a small subclass that says how to make a fresh root and a second, independent
client of the same root. The tests are the promises the rest of ckptd builds on: atomic
publication, writes that fail leaving nothing behind, listings that show what another process
wrote, and readers that count a step as existing only once its manifest exists.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import ckptd
from ckptd.commit import BufferedPut, MoveIntoPlace, ObjectPut, PosixRename
from ckptd.config import Kind
from ckptd.errors import CheckpointError, CorruptCheckpointError, FailpointError
from ckptd.layout import MANIFESTS, TRACKERS, committed_steps, is_committed, scan_steps
from ckptd.manifest import FileEntry, build_manifest
from ckptd.monitor.retention import delete_step
from ckptd.shared_root import check_writable
from ckptd.storage import Storage
from ckptd.workers.files import read_verified, write_bytes
from ckptd.workers.mapped import read_safetensors
from ckptd.workers.safetensors_io import write_safetensors


class StorageConformance:
    """The tests. Subclasses provide ``root`` (URL, storage_options) and ``strategy``."""

    strategy: type

    @pytest.fixture
    def root(self) -> tuple[str, dict]:
        raise NotImplementedError

    @pytest.fixture
    def storage(self, root) -> Storage:
        return Storage(*root)

    @pytest.fixture
    def other(self, root) -> Storage:
        """A second client of the same root: another process, as far as caches go."""
        return Storage(*root)

    def commit_step(self, storage: Storage, step: int, kind: Kind = Kind.CHECKPOINT) -> None:
        """What the monitor does: data first, then the manifest, then the tracker."""
        w = write_bytes(storage, storage.join(f"global_step_{step}", "model.bin"), f"weights {step}".encode())
        entry = FileEntry(path="model.bin", size=w.size, crc32=w.crc32)
        manifest = build_manifest(step, kind, ["w/model"], [entry])
        storage.write_atomic(storage.join(f"global_step_{step}", MANIFESTS[kind]), manifest.model_dump_json().encode())
        storage.write_atomic(storage.join(TRACKERS[kind]), f"{step}\n".encode())

    # -- publication ---------------------------------------------------------------------------

    def test_the_backend_gets_its_strategy(self, storage):
        assert type(storage.commit) is self.strategy

    def test_write_atomic_round_trip_and_overwrite(self, storage, other):
        path = storage.join("a", "b.txt")
        storage.write_atomic(path, b"first")
        assert other.read_bytes(path) == b"first"
        storage.write_atomic(path, b"second, longer")
        assert other.read_bytes(path) == b"second, longer"
        assert storage.listdir(storage.join("a")) == ["b.txt"]

    def test_a_publication_that_fails_keeps_the_old_file_and_leaves_nothing(self, storage, other):
        path = storage.join("tracker.txt")
        storage.write_atomic(path, b"1\n")

        def crash():
            raise FailpointError("crash before publish")

        with pytest.raises(FailpointError):
            storage.write_atomic(path, b"2\n", before_publish=crash)
        assert other.read_bytes(path) == b"1\n"
        assert set(other.walk_files(storage.root)) == {"tracker.txt"}

    def test_a_streamed_write_appears_only_when_complete(self, storage, other):
        path = storage.join("step", "big.bin")
        storage.write_atomic(path, b"old")
        with pytest.raises(RuntimeError):
            with storage.open_write(path) as f:
                f.write(b"x" * (1 << 20))
                raise RuntimeError("the writer died half-way")
        assert other.read_bytes(path) == b"old"
        assert set(other.walk_files(storage.join("step"))) == {"big.bin"}
        with storage.open_write(path) as f:
            f.write(b"y" * (6 << 20))  # above s3fs's 5 MiB multipart threshold
        assert other.stat(path).size == 6 << 20

    # -- listings ------------------------------------------------------------------------------

    def test_listings_show_what_another_client_wrote_since(self, storage, other):
        d = storage.join("global_step_3")
        storage.write_atomic(f"{d}/one", b"1")
        assert storage.listdir(d) == ["one"]
        assert not storage.exists(f"{d}/two")
        other.write_atomic(f"{d}/two", b"22")
        assert sorted(storage.listdir(d)) == ["one", "two"]
        assert storage.exists(f"{d}/two")
        assert storage.stat(f"{d}/two").size == 2
        assert {rel: st.size for rel, st in storage.walk_files(d).items()} == {"one": 1, "two": 2}
        other.rm(f"{d}/one")
        assert storage.listdir(d) == ["two"]

    def test_walk_files_rm_and_missing_paths(self, storage):
        for rel, data in {"s/a.bin": b"aa", "s/sub/b.bin": b"bbb", "t/c.bin": b"c"}.items():
            storage.write_atomic(storage.join(rel), data)
        assert {r: st.size for r, st in storage.walk_files(storage.join("s")).items()} == {"a.bin": 2, "sub/b.bin": 3}
        assert storage.walk_files(storage.join("nothing-here")) == {}
        assert storage.listdir(storage.join("nothing-here")) == []
        assert storage.read_text_or_none(storage.join("nothing-here", "x")) is None
        storage.rm(storage.join("s"))
        storage.rm(storage.join("s"))  # a missing path is not an error
        assert storage.walk_files(storage.join("s")) == {}
        assert set(storage.walk_files(storage.root)) == {"t/c.bin"}

    def test_check_writable(self, storage):
        check_writable(storage, "the test")
        assert storage.walk_files(storage.root) == {}  # the probe is removed

    # -- what readers count as committed -------------------------------------------------------

    def test_a_step_exists_for_readers_only_once_its_manifest_does(self, storage, other):
        self.commit_step(storage, 5)
        # Step 10: every data object is there and the tracker already points at it, but the
        # manifest is not: no reader may count it.
        write_bytes(storage, storage.join("global_step_10", "model.bin"), b"weights 10")
        storage.write_atomic(storage.join(TRACKERS[Kind.CHECKPOINT]), b"10\n")
        url, opts = storage.url, storage.storage_options
        assert ckptd.latest_step(url, storage_options=opts) == 5
        assert committed_steps(other, Kind.CHECKPOINT) == [5]
        assert not is_committed(other, 10, Kind.CHECKPOINT)
        assert ckptd.verify(url, storage_options=opts).step == 5
        with pytest.raises(CheckpointError, match="not committed"):
            ckptd.verify(url, 10, storage_options=opts)
        self.commit_step(storage, 10)
        assert ckptd.latest_step(url, storage_options=opts) == 10
        assert is_committed(other, 10, Kind.CHECKPOINT)

    def test_a_damaged_tracker_falls_back_to_the_manifests(self, storage):
        self.commit_step(storage, 7)
        storage.write_atomic(storage.join(TRACKERS[Kind.CHECKPOINT]), b"\x00garbage")
        assert ckptd.latest_step(storage.url, storage_options=storage.storage_options) == 7

    def test_retention_removes_a_step_whole(self, storage, other):
        self.commit_step(storage, 1)
        self.commit_step(storage, 2)
        entry = scan_steps(other)[1]
        assert entry.committed
        delete_step(storage, entry)
        assert sorted(scan_steps(other)) == [2]
        assert committed_steps(other, Kind.CHECKPOINT) == [2]

    # -- writers and verified reads ------------------------------------------------------------

    def test_written_files_read_back_verified(self, storage, other):
        tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
        path = storage.join("global_step_1", "model.safetensors")
        written = write_safetensors(storage, path, tensors)
        entry = FileEntry(path="model.safetensors", size=written.size, crc32=written.crc32)
        got, _ = read_safetensors(other, path, entry)
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
        data = bytearray(other.read_bytes(path))
        data[-1] ^= 0xFF
        other.write_atomic(path, bytes(data))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            read_verified(storage, path, entry)


class TestLocalPath(StorageConformance):
    strategy = PosixRename

    @pytest.fixture
    def root(self, tmp_path):
        return str(tmp_path / "root"), {}


class TestFileUrl(StorageConformance):
    strategy = PosixRename

    @pytest.fixture
    def root(self, tmp_path):
        return f"file://{tmp_path}/root", {}


class TestMemory(StorageConformance):
    strategy = BufferedPut

    @pytest.fixture
    def root(self):
        return f"memory://conformance-{uuid.uuid4().hex[:8]}/root", {}


class TestDirOverLocal(StorageConformance):
    """``dir://`` over local disk gets the strategy HDFS gets: temp file, then an atomic move."""

    strategy = MoveIntoPlace

    @pytest.fixture
    def root(self, tmp_path):
        return "dir://root", {"path": str(tmp_path), "target_protocol": "file"}


class TestS3(StorageConformance):
    """A real S3-protocol server on 127.0.0.1 (moto), through s3fs."""

    strategy = ObjectPut

    @pytest.fixture
    def root(self, s3_root):
        return s3_root

    @pytest.fixture
    def other(self, root):
        url, opts = root
        # A separate s3fs instance: nothing shared with `storage` but the server.
        return Storage(url, {**opts, "skip_instance_cache": True})

    def test_no_multipart_upload_is_left_behind_by_a_failed_write(self, root, s3_server):
        url, opts = root
        storage = Storage(url, {**opts, "default_block_size": 5 << 20, "skip_instance_cache": True})
        bucket = storage.root.split("/", 1)[0]
        client = s3_server.client()
        with pytest.raises(RuntimeError):
            with storage.open_write(storage.join("big.bin")) as f:
                f.write(b"z" * (12 << 20))  # 5 MiB parts go out as the buffer fills
                assert client.list_multipart_uploads(Bucket=bucket).get("Uploads")
                raise RuntimeError("killed")
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
        assert not storage.exists(storage.join("big.bin"))
