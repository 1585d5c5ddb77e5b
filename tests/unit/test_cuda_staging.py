"""Staging from a GPU: pinned buffers, a copy ordered after the work queued before the save and
not after anything queued later, and tensors published as their own copies land.

These need CUDA, so they run on a GPU machine (``pytest --noconftest -n 0
tests/unit/test_cuda_staging.py``; docs/benchmarks.md#gpu) and are skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ckptd.coordinator import cuda_streams
from ckptd.coordinator.staging import BufferSet, StagingArea, rebuild, tensors_of
from tests.unit.helpers import write_streamed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_LONG_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of GPU clock cycles


def _state(mib: int = 64) -> dict[str, torch.Tensor]:
    n = (mib << 20) // 4 // 4
    return {f"w{i}": torch.randn(n, device="cuda") for i in range(4)} | {
        "bf16": torch.randn(1001, device="cuda").to(torch.bfloat16),
        "transposed": torch.randn(300, 500, device="cuda").t(),
        "step": torch.tensor(3),  # a host tensor in a GPU state
    }


def test_an_eager_snapshot_of_gpu_tensors_is_in_pinned_buffers_and_equal():
    state = _state()
    area = StagingArea(1, "stage")
    snap = area.snapshot("m", state, tensors_of(state), fenced=False)
    try:
        for k, v in state.items():
            staged = snap.state[k]
            assert staged.device.type == "cpu"
            assert staged.is_pinned() == (v.device.type == "cuda")
            assert torch.equal(staged, v.cpu())
    finally:
        snap.release()


@pytest.mark.parametrize("own_stream", [False, True], ids=["default-stream", "own-stream"])
@pytest.mark.parametrize("fenced", [False, True])
def test_the_copy_waits_for_work_queued_before_the_save_on_the_callers_stream(fenced, own_stream):
    state = _state()
    stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
    area = StagingArea(1, "stage")
    with torch.cuda.stream(stream):  # the training loop's stream, the default one or its own
        torch.cuda._sleep(_LONG_CYCLES)
        for v in state.values():
            if v.is_cuda:
                v.fill_(7)  # queued behind the sleep: not run yet when the save is called
        snap = area.snapshot("m", state, tensors_of(state), fenced=fenced)
    area.fence()
    try:
        for k, v in state.items():
            if v.is_cuda:
                assert (snap.state[k] == 7).all(), k
    finally:
        snap.release()


def test_a_fenced_copy_does_not_wait_for_work_queued_after_the_save():
    state = _state()
    area = StagingArea(1, "stage")
    expected = {k: v.cpu() for k, v in state.items()}
    snap = area.snapshot("m", state, tensors_of(state), fenced=True)
    torch.cuda._sleep(_LONG_CYCLES)  # forward and backward, queued after the save
    after = torch.cuda.current_stream().record_event()
    area.fence()
    try:
        # The fence returned while the training stream's work still runs: no device-wide sync.
        assert not after.query()
        assert all(torch.equal(snap.state[k], v) for k, v in expected.items())
    finally:
        snap.release()
    after.synchronize()


def test_the_staging_stream_is_private_to_its_thread_and_never_one_of_pytorchs_pool():
    """PyTorch's pool hands the same few streams out in turn (the training loop's, FSDP's,
    NCCL's): a staging copy on one of them would queue behind the work queued after the save."""
    import threading

    mine = cuda_streams.copy_stream(0, {})
    assert cuda_streams.copy_stream(0, {}) is mine  # one per thread and GPU, reused
    other = []
    t = threading.Thread(target=lambda: other.append(cuda_streams.copy_stream(0, {})))
    t.start()
    t.join()
    pool = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(80)}
    taken = pool | {torch.cuda.current_stream().cuda_stream, torch.cuda.default_stream().cuda_stream}
    assert mine.cuda_stream not in taken and other[0].cuda_stream not in taken
    assert other[0].cuda_stream != mine.cuda_stream


def test_shared_buffers_for_a_writer_process_are_page_locked_in_place_and_released_with_their_set():
    state = _state(16)
    area = StagingArea(1, "stage", shared=True)  # writer="process"
    snap = area.snapshot("m", state, tensors_of(state), fenced=True)
    area.fence()
    for k, v in state.items():
        staged = snap.state[k]
        assert staged.is_shared() and torch.equal(staged, v.cpu()), k
        assert staged.is_pinned() == (v.is_cuda and v.numel() > 0), k
    snap.release()
    buf = BufferSet([state["w0"]], shared=True)
    kept = buf.tensors[0]
    assert kept.is_pinned()
    del buf  # the set goes: its buffer is unregistered (the memory itself lives on in ``kept``)
    assert not kept.is_pinned()


def test_a_write_streams_behind_a_gpu_copy_and_holds_the_state(tmp_path):
    state = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(6)}
    written, path, asked, buf = write_streamed(tmp_path, state)
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
    assert list(dict.fromkeys(k for k, _ in asked)) == list(state)  # each tensor waited for, in file order
    assert all(t.is_pinned() for t in buf.tensors)


def test_a_cuda_dtensor_is_staged_as_its_local_block_and_rebuilt_on_the_host(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(64, 32, device="cuda")
        state = {"w": distribute_tensor(full, mesh, [Shard(0)])}
        area = StagingArea(1, "stage")
        leaves = tensors_of(state)
        assert leaves[0].is_cuda and leaves[0].shape == (64, 32)
        snap = area.snapshot("m", state, leaves, fenced=True)
        area.fence()
        staged = rebuild(state, snap.buffers.tensors)["w"]
        assert isinstance(staged, DTensor) and staged.placements == (Shard(0),)
        assert staged.to_local().device.type == "cpu" and staged.to_local().is_pinned()
        assert torch.equal(staged.to_local(), full.cpu())
        snap.release()
    finally:
        dist.destroy_process_group()
