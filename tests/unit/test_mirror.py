"""The mirror's upload loop without Ray: a local root mirrored to memory://, on an asyncio loop."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from ckptd.config import Kind, MirrorOptions
from ckptd.layout import MANIFESTS, TRACKERS, committed_steps, read_tracker, scan_steps
from ckptd.manifest import FileEntry, build_manifest
from ckptd.monitor.mirror import Mirror
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate
from ckptd.workers.files import write_bytes

TEMPLATE = StepDirTemplate("global_step_{step}")


def commit(storage: Storage, step: int) -> None:
    w = write_bytes(storage, storage.join(f"global_step_{step}", "weights.bin"), f"step {step}".encode() * 100)
    manifest = build_manifest(step, Kind.CHECKPOINT, ["w/model"], [FileEntry(path="weights.bin", size=w.size,
                                                                             crc32=w.crc32)])
    storage.write_atomic(storage.join(f"global_step_{step}", MANIFESTS[Kind.CHECKPOINT]),
                         manifest.model_dump_json().encode())
    storage.write_atomic(storage.join(TRACKERS[Kind.CHECKPOINT]), f"{step}\n".encode())


def mirror_of(local: Storage, remote: Storage, **opts) -> tuple[Mirror, list[int]]:
    changes: list[int] = []
    committed = {s: e.kinds for s, e in scan_steps(local, TEMPLATE).items() if e.committed}
    m = Mirror(local, remote, MirrorOptions(url=remote.url, **opts), TEMPLATE, committed,
               lambda: changes.append(1))
    return m, changes


async def run_until(mirror: Mirror, coro):
    task = asyncio.get_running_loop().create_task(mirror.run())
    try:
        return await asyncio.wait_for(coro, 30)
    finally:
        task.cancel()


@pytest.mark.parametrize("keep, uploaded, left", [
    (None, [3, 5], [1, 2, 3, 4, 5]),
    (3, [3, 5], [3, 4, 5]),
    (2, [5], [4, 5]),  # step 3 would be deleted from the mirror at once: not uploaded
])
def test_start_up_uploads_what_the_mirror_lacks_and_would_keep_and_protects_until_then(tmp_path, keep, uploaded,
                                                                                      left):
    local = Storage(str(tmp_path / "local"))
    remote = Storage(f"memory://mirror-{uuid.uuid4().hex[:8]}/run")
    for step in (1, 2, 3, 4, 5):
        commit(local, step)
    for step in (1, 2, 4):  # an earlier monitor mirrored these; its upload of step 3 was killed
        commit(remote, step)
    write_bytes(remote, remote.join("global_step_3", "weights.bin"), b"part of it")
    mirror, changes = mirror_of(local, remote, max_ckpt_to_keep=keep)
    assert mirror.protected() == {1, 2, 3, 4, 5}  # until the mirror's state is known

    async def scenario():
        assert (await mirror.wait(5, 30))["mirrored"]
        assert (await mirror.wait(4, 1))["mirrored"]  # already there
        await mirror.retention_idle.wait()
        return mirror.status()

    shown = asyncio.run(run_until(mirror, scenario()))
    assert [s.step for s in shown.steps] == uploaded  # nothing uploaded twice
    assert committed_steps(remote, Kind.CHECKPOINT) == left and read_tracker(remote, Kind.CHECKPOINT) == 5
    assert all(remote.read_bytes(remote.join(f"global_step_{s}", "weights.bin")) == f"step {s}".encode() * 100
               for s in left)
    assert mirror.protected() == set() and changes


def test_a_local_copy_that_does_not_match_its_manifest_is_never_uploaded(tmp_path):
    local = Storage(str(tmp_path / "local"))
    remote = Storage(f"memory://mirror-{uuid.uuid4().hex[:8]}/run")
    commit(local, 1)
    path = local.join("global_step_1", "weights.bin")
    data = bytearray(local.read_bytes(path))
    data[0] ^= 0xFF
    local.write_atomic(path, bytes(data))  # bit rot after the commit
    mirror, _ = mirror_of(local, remote, retries=0)

    result = asyncio.run(run_until(mirror, mirror.wait(1, 30)))
    assert not result["mirrored"] and "checksum mismatch" in result["error"]
    assert mirror.status().step(1).state == "abandoned" and mirror.protected() == set()
    assert remote.walk_files(remote.join("global_step_1")) == {}  # not even the data object
    assert read_tracker(remote, Kind.CHECKPOINT) is None


def test_a_fenced_mirror_uploads_and_deletes_nothing(tmp_path):
    """A monitor of an older job (attempt 1) whose root a newer job took over (attempt 2) still
    runs its mirror: it would upload a local step the mirror lacks, and its retention (keep 2)
    then delete step 1, which the newer job keeps there. Fenced, it uploads nothing, deletes nothing,
    and its waiters hear why."""
    from functools import partial

    from ckptd.fencing import check_fence
    from ckptd.monitor.attempts import open_attempt

    local = Storage(str(tmp_path / "local"))
    remote = Storage(f"memory://mirror-{uuid.uuid4().hex[:8]}/run")
    mine = open_attempt(local, "job-1", None).attempt
    open_attempt(local, "job-2", None)  # the newer job
    for step in (1, 2, 3):
        commit(local, step)
    for step in (1, 2):  # the newer job mirrored these, and keeps them
        commit(remote, step)
    mirror = Mirror(local, remote, MirrorOptions(url=remote.url, max_ckpt_to_keep=2), TEMPLATE, {}, lambda: None,
                    check_fence=partial(check_fence, local, mine))

    async def scenario():
        mirror.enqueue(3)
        return await mirror.wait(3, 30)

    outcome = asyncio.run(run_until(mirror, scenario()))
    assert not outcome["mirrored"] and "attempt" in outcome["error"], outcome
    assert committed_steps(remote, Kind.CHECKPOINT) == [1, 2] and not remote.exists(remote.join("global_step_3"))
    with pytest.raises(Exception, match="attempt"):
        mirror._retention_pass(set())
    assert committed_steps(remote, Kind.CHECKPOINT) == [1, 2]


def test_a_mirror_fenced_by_an_attempt_taken_back_uploads_once_the_fence_is_lifted(tmp_path):
    """A losing ``start_monitor``'s attempt is on the root when step 3's upload checks the fence:
    the upload is refused and its waiters hear why. Once that attempt is taken back, the monitor's
    fence watch lifts the mirror's fence (``lift_fence``): step 3 goes up, and the mirror's retention
    runs again. Before, the upload loop ended at the first fence, for good."""
    from functools import partial

    from ckptd.fencing import attempts_dir, check_fence
    from ckptd.monitor.attempts import open_attempt

    local = Storage(str(tmp_path / "local"))
    remote = Storage(f"memory://mirror-{uuid.uuid4().hex[:8]}/run")
    mine = open_attempt(local, "job-1", None).attempt
    loser = open_attempt(local, "a-racing-job", None).attempt
    for step in (1, 2, 3):
        commit(local, step)
    for step in (1, 2):
        commit(remote, step)
    mirror = Mirror(local, remote, MirrorOptions(url=remote.url, max_ckpt_to_keep=2), TEMPLATE, {}, lambda: None,
                    check_fence=partial(check_fence, local, mine))

    async def scenario():
        mirror.enqueue(3)
        fenced = await mirror.wait(3, 30)
        assert mirror.fenced is not None and 3 in mirror.protected()
        local.rm(f"{attempts_dir(local)}/{loser}.json")
        mirror.lift_fence()
        lifted = await mirror.wait(3, 30)
        await mirror.retention_idle.wait()
        return fenced, lifted

    fenced, lifted = asyncio.run(run_until(mirror, scenario()))
    assert not fenced["mirrored"] and f"attempt {loser}" in fenced["error"], fenced
    assert lifted == {"mirrored": True, "error": None}, lifted
    assert mirror.fenced is None and committed_steps(remote, Kind.CHECKPOINT) == [2, 3]
