"""Session 21: the default writer's staged file image (c74fdcc) and nested states (477a3de) under attack.

``save_state_async(name, state, step)`` with no ``write_fn`` now stages CPU tensors straight into
one page-aligned block laid out as the safetensors file (header first, tensors as views at their
offsets), writes the file from that block with O_DIRECT (``DirectWriter.write_stable``: whole
pages from the caller's memory, two writes in flight), reuses the block for the name's next save,
and takes any nested state (an optimizer's), whose structure goes to ``{name}.state.json``;
``ckptd.load_state`` reads either back. Attacked here with a real local Ray, one real monitor
(``direct_io="on"``, so files of 32 MiB and more go past the page cache on the ext4 tmp dir),
real files, real writer processes, the failpoints of ``ckptd.failpoints`` and a real file-size
limit (RLIMIT_FSIZE: EFBIG part-way through a file, as a full disk):

1. The committed files hold the state as it was at the call (eager) or at ``before_update()``
   (fenced) while the O_DIRECT writes are held in flight and the loop changes every tensor and
   plain value; every tensor kind (zero-size, 0-dim, non-contiguous, views sharing storage, the
   same tensor twice, bool, bf16), laid out as the image and not (an offset its dtype cannot be
   viewed at); the image is used (staged bytes == the file's size, nothing but the last partial
   block copied; a file of exactly 32 MiB, nothing at all) and the manifest's size and CRC-32
   are the file's (``ckptd.verify``).
2. Layout changes of one name (shapes, key order, renamed keys, dtypes of the same size, keys
   added and removed, misaligned offsets, zero-size and 0-dim tensors, shared storage, nested
   structures over the same tensor names), with ``max_staged`` 1 and 2 and the saves in flight
   together: no file has a stale header or another save's bytes (``safetensors`` and
   ``load_state`` read each back exactly).
3. ``max_staged=2`` with two names, several large saves of each in flight, O_DIRECT writes held
   by a delay: no bytes mixed between saves.
4. Failing part-way: a write past the file-size limit with another O_DIRECT write in flight, a
   staging copy that fails mid-stream (``staging_chunk``), O_DIRECT refused (``direct_io_write``),
   a writer process SIGKILLed in the middle of its write: nothing committed for the failed step,
   the buffers are reused (not leaked, not handed over early) and the next save is exact.
5. Nested states round-trip exactly (key and value types, int vs str keys that print alike,
   tuples vs lists, NaN/inf/-0.0, tag-like strings); what cannot be kept is refused with
   ``CheckpointConfigError`` before anything is staged or written.
6. Forged files (with a manifest forged to match) never unpickle and never load as a wrong state.
7. Saves with a ``write_fn`` get one buffer per tensor, as before, and alternate cleanly with the
   default writer on the same name.

Found broken by this attack and fixed (each test failed before the fix): a float subclass NaN
(``np.float64``) committed a structure load_state could not read (numpy scalars, IntEnum values
and namedtuples are now refused: they would come back as their base type); an int of more than
4300 digits and a state nested about 200 deep were accepted and failed in the writer after the
tensors file was written (refused at the call now); a tensor key ``__metadata__`` committed a
file load_state could not read (refused, and never a name ``flatten`` gives); a nested save
followed by a flat one of the same name and step committed a stale ``.state.json`` that
load_state combined with the new tensors (the tensors file now says whether it has a structure);
a forged ``.state.json`` that is not UTF-8, holds a huge int or nests deeply raised
UnicodeDecodeError / ValueError / RecursionError instead of CorruptCheckpointError; a forged
dict node with duplicate keys loaded with an entry dropped.
"""

from __future__ import annotations

import collections
import copy
import enum
import io
import json
import logging
import math
import multiprocessing
import os
import pickle
import re
import resource
import signal
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd import failpoints
from ckptd.workers.safetensors_io import plan_safetensors
from ckptd.workers.state_file import split

from .helpers import Env, assert_same_state, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

MiB = 1 << 20
META = {"format": "pt"}
DEADLINE_S = 60.0  # far beyond what any wait here needs: reaching it means a hang
BIG = (34 * MiB) // 4  # float32 elements of a tensor whose file is written with O_DIRECT (>= 32 MiB)


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    failpoints.disarm()


SHARED_MONITOR_OPTIONS = {"max_ckpt_to_keep": None, "direct_io": "on"}  # large files with O_DIRECT


# -- helpers ---------------------------------------------------------------------------------------


def _tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out += _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _tensors(v)
    return out


def _train_step(state: Any) -> None:
    """The optimizer step: every tensor changed in place (each object once; a view of another
    changes twice, never back), and the plain values and containers of a dict state changed."""
    seen: set[int] = set()
    with torch.no_grad():
        for t in _tensors(state):
            if id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)
    if isinstance(state, dict):
        for group in state.get("param_groups", []):
            group["lr"] = -1.0
            group["params"].append(99)
        state["added after the call"] = 1


def _image_size(state: Any) -> int:
    flat, metadata, _ = split(state, META)
    return plan_safetensors(flat, metadata).size


def _tensor_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _o_direct_copied(caplog, name: str, step_dir: str) -> tuple[int, int]:
    """(bytes written, bytes copied through bounce buffers) of ``{step_dir}/{name}.safetensors``,
    from the O_DIRECT writer's debug line."""
    m = re.search(rf"{re.escape(step_dir)}/[^ ]*{re.escape(name)}\.safetensors[^:]*: (\d+) bytes written with "
                  r"O_DIRECT, (\d+) of them through bounce", caplog.text)
    assert m, f"{name}.safetensors was not written with O_DIRECT"
    return int(m[1]), int(m[2])


def _assert_committed(env: Env, step: int, name: str, want: Any) -> None:
    """The step commits, verifies against its manifest, and ``name`` loads back as ``want``."""
    ckptd.verify(env.root, step)
    assert_same_state(want, ckptd.load_state(env.root, name, step))
    if all(isinstance(v, torch.Tensor) for v in want.values()):  # a flat state: any safetensors reader
        got = load_file(f"{env.step_dir(step)}/{name}.safetensors")
        assert sorted(got) == sorted(want)
        for key in want:
            assert_same_state(want[key], got[key], key)


def _visible(step_dir: str) -> list[str]:
    """The files of a step directory a reader would see (not ckptd's temp files)."""
    if not os.path.isdir(step_dir):
        return []
    return sorted(n for n in os.listdir(step_dir) if not n.startswith(".ckptd-tmp-"))


def _optimizer_like(seed: int, aligned: bool = True) -> dict:
    """A nested state of about 34 MiB with every awkward tensor: a 0-dim float64 step, a view of
    the large moment, a transposed (non-contiguous) tensor, a tensor and its base, the same tensor
    twice, a zero-size tensor, bf16, int8 and bool. With ``aligned`` every tensor starts where its
    dtype can be viewed (the file's image); without, 7 int8 bytes put the bf16 after them off."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(BIG, generator=g)
    shared = torch.randn(6, 4, generator=g)
    return {
        "state": {
            0: {"step": torch.tensor(float(seed), dtype=torch.float64), "exp_avg": big,
                "exp_avg_sq": big[64:128].view(8, 8)},
            1: {"step": torch.tensor(3.0, dtype=torch.float64), "m": shared.t(), "base": shared},
        },
        "param_groups": [{"lr": 0.01 * seed, "betas": (0.9, 0.999), "params": [0, 1], "maximize": False,
                          "foreach": None, "weight_decay": 0.0}],
        "same": [shared, shared],
        "empty": torch.empty(0, 3),
        "ids": torch.arange(8 if aligned else 7, dtype=torch.int8),
        "half": torch.randn(8, generator=g).to(torch.bfloat16),
        "mask": torch.rand(13, generator=g) > 0.5,
    }


# -- 1: the committed file is the state at the call or at the fence ------------------------------


@pytest.mark.parametrize("fenced", [False, True])
@pytest.mark.parametrize("aligned", [True, False])
def test_a_large_nested_state_is_written_from_its_image_as_it_was_at_the_call(env, caplog, fenced, aligned):
    coord = env.coord()
    s = env.s
    state = _optimizer_like(s, aligned)
    want = copy.deepcopy(state)
    image = _image_size(state)
    coord.register(s + 1, checkpoint_thread_count=1)
    failpoints.arm("direct_io_write", "delay:0.15")  # every O_DIRECT write is in flight meanwhile
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        coord.save_state_async("optim", state, s + 1, fenced=fenced)
        if fenced:
            coord.before_update()
        _train_step(state)  # while the file's writes wait in flight
        coord.wait_all()
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    failpoints.disarm()
    assert _visible(env.step_dir(s + 1)) == ["ckptd_manifest.json", "optim.safetensors", "optim.state.json"]
    _assert_committed(env, s + 1, "optim", want)
    size, copied = _o_direct_copied(caplog, "optim", env.step_dir(s + 1))
    assert size == image == os.path.getsize(f"{env.step_dir(s + 1)}/optim.safetensors")
    if aligned:  # staged as the file's image, written from it: only the last partial block copied
        assert coord.staged_bytes() == image and copied == size % 4096
    else:  # one buffer per tensor, written through the bounce buffers
        assert coord.staged_bytes() == _tensor_bytes(state) and copied == size

    # The next save of the name reuses the same buffers and holds its own values.
    state2 = _optimizer_like(s + 7, aligned)
    want2 = copy.deepcopy(state2)
    staged = coord.staged_bytes()
    coord.register(s + 2, checkpoint_thread_count=1)
    coord.save_state_async("optim", state2, s + 2, fenced=fenced)
    if fenced:
        coord.before_update()
    _train_step(state2)
    coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    assert coord.staged_bytes() == staged
    _assert_committed(env, s + 2, "optim", want2)
    coord.close()


# -- 2: layout changes of one name never leave a stale header -------------------------------------


def _layouts(v: int) -> list[Any]:
    """States of one name whose files differ in every way a header can; values depend on ``v``."""
    def f(*shape, dtype=torch.float32):
        n = math.prod(shape)
        return (torch.arange(n, dtype=torch.float64) * 0.5 + v).to(dtype).reshape(shape)

    base = f(4, 6)
    twice = f(5)
    return [
        {"a": f(4, 3), "b": f(5, dtype=torch.int64)},
        {"a": f(3, 4), "b": f(5, dtype=torch.int64)},  # shape permuted: the same bytes
        {"b": f(5, dtype=torch.int64), "a": f(3, 4)},  # key order
        {"c": f(3, 4), "b": f(5, dtype=torch.int64)},  # a key renamed, same length
        {"c": f(3, 4, dtype=torch.int32), "b": f(5, dtype=torch.int64)},  # a dtype of the same size
        {"a": f(3, 4, dtype=torch.float16), "b": f(5, dtype=torch.int64)},  # a dtype of another size
        {"a": f(3, dtype=torch.int8), "b": f(5, dtype=torch.float64)},  # b off its alignment: no image
        {"a": f(0), "s": f(dtype=torch.float64), "b": f(5, dtype=torch.int64)},  # zero-size and 0-dim
        {"a": f(4, 3), "b": f(5, dtype=torch.int64), "x": f(3) > v + 0.7},  # a key added (bool)
        {"a": f(4, 3)},  # keys removed
        {"a": twice, "b": twice},  # the same tensor twice
        {"a": base[1:3], "b": base, "c": base.t()},  # views of one storage, one not contiguous
        {"state": {0: {"m": f(4, 3)}}, "lr": 0.1 * v},  # nested
        {"state": {0: {"m": f(4, 3)}}, "lr": (0.1 * v, [v]), "more": None},  # same tensors, other structure
        {"a": f(4, 3), "b": f(5, dtype=torch.int64)},  # the first layout again
    ]


@pytest.mark.parametrize("max_staged", [1, 2])
def test_layout_changes_of_one_name_never_write_a_stale_header_or_another_saves_bytes(env, max_staged):
    coord = env.coord(max_staged=max_staged)
    s = env.s
    wants = {}
    for i in range(len(_layouts(0))):
        step = s + 1 + i
        state = _layouts(step)[i]
        wants[step] = copy.deepcopy(state)
        coord.register(step, checkpoint_thread_count=1)
        fenced = i % 2 == 1
        coord.save_state_async("m", state, step, fenced=fenced)  # the previous ones may still be writing
        if fenced:
            coord.before_update()
        _train_step(state)
    coord.wait_all()
    for step, want in wants.items():
        coord.wait_committed(step, timeout_s=DEADLINE_S)
        _assert_committed(env, step, "m", want)
    largest = max(max(_image_size(w), _tensor_bytes(w)) for w in wants.values())
    assert 0 < coord.staged_bytes() <= max_staged * largest
    coord.close()


def test_a_large_file_whose_only_change_is_a_key_name_gets_its_own_header(env, caplog):
    """Two 34 MiB files written with O_DIRECT from images whose tensors have the same shape and
    dtype but another name: the second must not reuse the first's header."""
    coord = env.coord(max_staged=1)
    s = env.s
    g = torch.Generator().manual_seed(s)
    wants = []
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        for i, key in enumerate(("w1", "w2")):
            state = {key: torch.randn(BIG, generator=g)}
            wants.append(copy.deepcopy(state))
            coord.register(s + 1 + i, checkpoint_thread_count=1)
            coord.save_state_async("model", state, s + 1 + i)
            _train_step(state)
        coord.wait_all()
    for i, want in enumerate(wants):
        coord.wait_committed(s + 1 + i, timeout_s=DEADLINE_S)
        _assert_committed(env, s + 1 + i, "model", want)
        size, copied = _o_direct_copied(caplog, "model", env.step_dir(s + 1 + i))
        assert copied == size % 4096
    assert coord.staged_bytes() == _image_size(wants[1])  # the old layout's set was dropped
    coord.close()


@pytest.mark.parametrize("fenced", [False, True])
def test_a_file_of_exactly_32_mib_goes_out_of_its_image_with_nothing_copied(env, caplog, fenced):
    """The smallest file O_DIRECT takes, a whole number of pages: two 16 MiB writes straight from
    the image, no tail, not one byte through a bounce buffer; the file is the state at the call."""
    target = 32 * MiB
    n = target - 4 * 8
    for _ in range(3):  # the header's length depends on the digits of n
        n = target - 4 * 8 - len(plan_safetensors({"w": torch.empty(n, dtype=torch.uint8),
                                                   "b": torch.empty(4, dtype=torch.float64)}, META).header)
    g = torch.Generator().manual_seed(env.s)
    state = {"w": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), "b": torch.randn(4, dtype=torch.float64)}
    assert _image_size(state) == target
    want = copy.deepcopy(state)
    coord = env.coord()
    coord.register(env.s + 1, checkpoint_thread_count=1)
    failpoints.arm("direct_io_write", "delay:0.1")
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        coord.save_state_async("model", state, env.s + 1, fenced=fenced)
        if fenced:
            coord.before_update()
        _train_step(state)
        coord.wait_committed(env.s + 1, timeout_s=DEADLINE_S)
    _assert_committed(env, env.s + 1, "model", want)
    assert _o_direct_copied(caplog, "model", env.step_dir(env.s + 1)) == (target, 0)
    coord.close()


# -- 3: several saves of several names in flight ---------------------------------------------------


def _named_state(name: str, step: int) -> dict:
    g = torch.Generator().manual_seed(step * 31 + len(name))
    big = torch.randn(BIG, generator=g)
    if name == "model":
        return {"w": big, "b": torch.full((16,), float(step))}
    return {"state": {0: {"exp_avg": big, "step": torch.tensor(float(step), dtype=torch.float64)}},
            "param_groups": [{"lr": float(step), "params": [0]}]}


def test_max_staged_two_with_two_names_and_several_saves_in_flight_never_mixes_bytes(env, caplog):
    coord = env.coord(max_staged=2)
    s = env.s
    wants = {}
    failpoints.arm("direct_io_write", "delay:0.05")  # the O_DIRECT writes stay in flight a while
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        for i in range(3):
            step = s + 1 + i
            coord.register(step, checkpoint_thread_count=2)
            for name in ("model", "optim"):
                state = _named_state(name, step)
                wants[name, step] = copy.deepcopy(state)
                fenced = (i + len(name)) % 2 == 0
                coord.save_state_async(name, state, step, fenced=fenced)
                if fenced:
                    coord.before_update()
                _train_step(state)
        coord.wait_all()
    failpoints.disarm()
    for (name, step), want in wants.items():
        coord.wait_committed(step, timeout_s=DEADLINE_S)
        _assert_committed(env, step, name, want)
        size, copied = _o_direct_copied(caplog, name, env.step_dir(step))
        assert copied == size % 4096
    sizes = {name: _image_size(wants[name, s + 1]) for name in ("model", "optim")}
    assert coord.staged_bytes() <= 2 * sum(sizes.values())
    coord.close()


# -- 4: failing part-way -------------------------------------------------------------------------


@pytest.fixture
def file_size_limit():
    """RLIMIT_FSIZE for this process (a write past it fails with EFBIG, as on a full disk), with
    SIGXFSZ ignored so the write raises instead of the process dying; restored after."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(nbytes: int | None) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit if nbytes is None else (nbytes, old_limit[1]))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("fenced", [False, True])
def test_an_o_direct_write_failing_part_way_never_commits_and_the_images_next_save_is_exact(
        env, file_size_limit, fenced):
    """The disk is full 20 MiB into a 34 MiB file: the second 16 MiB write from the image fails
    while the third is held in flight. The save fails, nothing of it is visible, and the name's
    next save gets the same image (not a new one: it was handed back once every write ended)."""
    coord = env.coord(max_staged=1)
    s = env.s
    state = {"w": torch.randn(BIG), "b": torch.arange(10)}
    coord.register(s + 1, checkpoint_thread_count=1)
    failpoints.arm("direct_io_write", "delay:0.2")
    file_size_limit(20 * MiB)
    try:
        coord.save_state_async("model", state, s + 1, fenced=fenced)
        if fenced:
            coord.before_update()
        with pytest.raises(ckptd.CheckpointSaveError, match="File too large"):
            coord.wait_all()
    finally:
        file_size_limit(None)
        failpoints.disarm()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    assert _visible(env.step_dir(s + 1)) == []
    assert coord.staged_bytes() == _image_size(state)

    state2 = {"w": torch.randn(BIG), "b": torch.arange(10) * 3}
    want2 = copy.deepcopy(state2)
    coord.register(s + 2, checkpoint_thread_count=1)
    coord.save_state_async("model", state2, s + 2, fenced=fenced)
    if fenced:
        coord.before_update()
    _train_step(state2)
    coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    _assert_committed(env, s + 2, "model", want2)
    assert coord.staged_bytes() == _image_size(state)  # the same set: nothing leaked or allocated
    coord.close()


def test_a_staging_copy_failing_mid_stream_and_o_direct_refused_leave_the_next_saves_exact(env):
    """A fenced save streams its file from the image behind the staging copy, which fails on a
    chunk: the save fails, nothing is visible. Then O_DIRECT is refused for every write (the
    failpoint acts as EINVAL): the file goes buffered from the same image and is exact."""
    coord = env.coord(max_staged=1)
    s = env.s
    state = _named_state("optim", s)
    coord.register(s + 1, checkpoint_thread_count=1)
    failpoints.arm("staging_chunk", "raise")
    coord.save_state_async("optim", state, s + 1, fenced=True)
    coord.before_update()
    with pytest.raises(ckptd.CheckpointSaveError, match="staging the state failed"):
        coord.wait_all()
    failpoints.disarm()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    assert _visible(env.step_dir(s + 1)) == []
    staged = coord.staged_bytes()
    assert staged == _image_size(state)

    for step, fenced in ((s + 2, True), (s + 3, False)):
        state = _named_state("optim", step)
        want = copy.deepcopy(state)
        coord.register(step, checkpoint_thread_count=1)
        failpoints.arm("direct_io_write", "raise")
        coord.save_state_async("optim", state, step, fenced=fenced)
        if fenced:
            coord.before_update()
        _train_step(state)
        coord.wait_committed(step, timeout_s=DEADLINE_S)
        failpoints.disarm()
        _assert_committed(env, step, "optim", want)
    assert coord.staged_bytes() == staged
    coord.close()


def _writer_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("ckptd-writer-")]


def test_a_writer_process_killed_in_the_middle_of_its_o_direct_write_from_the_shared_image(env):
    """writer="process": the image is shared memory the writer process writes from. Its O_DIRECT
    writes are held (a delay armed in its environment) and it is SIGKILLed with the file open:
    the save fails, nothing is visible, and the name's next save (a new writer process, the same
    shared image) commits its own bytes."""
    coord = env.coord(writer="process", max_staged=1)
    s = env.s
    state = _named_state("optim", s)
    before = {p.pid for p in _writer_processes()}
    coord.register(s + 1, checkpoint_thread_count=1)
    os.environ[failpoints.ENV_VAR] = "direct_io_write=delay:30"  # what the writer process inherits
    try:
        coord.save_state_async("optim", state, s + 1)
        writer = wait_for(lambda: [p for p in _writer_processes() if p.pid not in before], timeout_s=DEADLINE_S,
                          what="the writer process")[0]
    finally:
        del os.environ[failpoints.ENV_VAR]  # the next writer process starts without it
    step_dir = env.step_dir(s + 1)
    wait_for(lambda: os.path.isdir(step_dir) and os.listdir(step_dir), timeout_s=DEADLINE_S,
             what="the writer process to open the file")
    _train_step(state)
    os.kill(writer.pid, signal.SIGKILL)
    with pytest.raises(ckptd.CheckpointSaveError, match="died while writing"):
        coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    assert _visible(step_dir) == []
    staged = coord.staged_bytes()
    assert staged == _image_size(state)

    state2 = _named_state("optim", s + 2)
    want2 = copy.deepcopy(state2)
    coord.register(s + 2, checkpoint_thread_count=1)
    coord.save_state_async("optim", state2, s + 2, fenced=True)
    coord.before_update()
    _train_step(state2)
    coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    _assert_committed(env, s + 2, "optim", want2)
    assert coord.staged_bytes() == staged
    coord.close()


# -- 5: nested states round-trip, and what cannot is refused before anything starts ---------------


def test_a_nested_state_round_trips_with_every_type_kept(env):
    coord = env.coord()
    s = env.s
    t = torch.arange(6, dtype=torch.float32)
    state = {
        1: torch.ones(2), "1": torch.zeros(3),  # print alike, differ in type
        1.5: [None, True, 2, 2.0, -0.0, float("nan"), float("inf"), float("-inf"), "s", 10 ** 40],
        None: ({"a": torch.arange(3)}, [], (), {}),
        False: {"tensor": "1", "dict": [], "float": "nan"},  # plain dicts that look like tags
        "x/y": t, "x": {"y": t},  # names that collide, and the same tensor twice
        "uni\u00e9\U0001f600": "\ud800 lone surrogate",
        "nest": [[(1, [2, (torch.tensor(True),)])]],
        -7: {0: (), 0.25: [[]]},
    }
    bare = torch.randn(4, 4)
    listed = [torch.ones(1), (torch.zeros(2), 3)]
    wants = {"weird": copy.deepcopy(state), "bare": bare.clone(), "listed": copy.deepcopy(listed)}
    coord.register(s + 1, checkpoint_thread_count=3)
    coord.save_state_async("weird", state, s + 1)
    coord.save_state_async("bare", bare, s + 1, fenced=True)
    coord.save_state_async("listed", listed, s + 1)
    coord.before_update()
    _train_step(state)
    _train_step(bare)
    _train_step(listed)
    state["nest"][0].append("late")
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    ckptd.verify(env.root, s + 1)
    for name, want in wants.items():
        assert_same_state(want, ckptd.load_state(env.root, name, s + 1), name)
    coord.close()


class _Colour(enum.Enum):
    RED = "red"


_BAD = [
    {"w": torch.ones(2), "o": object()},
    {"w": torch.ones(2), "s": {1, 2}},
    {"w": torch.ones(2), "b": b"bytes"},
    {"w": torch.ones(2), "c": [torch.ones(2, dtype=torch.complex64)]},
    {"w": torch.ones(2), "sp": torch.eye(3).to_sparse()},
    {"w": torch.ones(2), (1, 2): torch.ones(1)},
    {"w": torch.ones(2), float("nan"): 1},
    {"w": torch.ones(2), float("inf"): 1},
    {"w": torch.ones(2), "n": np.int64(3)},
    {"w": torch.ones(2), "e": _Colour.RED},
    {"w": torch.ones(2), "d": torch.float32},
    {"w": torch.ones(2), "f": frozenset()},
    {"w": torch.ones(2, dtype=torch.complex64)},  # flat
]


def test_what_the_default_writer_cannot_keep_is_refused_before_anything_is_staged(env):
    coord = env.coord()
    s = env.s
    coord.register(s + 1, checkpoint_thread_count=1)
    coord.save_state_async("state", {"w": torch.ones(4)}, s + 1)
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    staged = coord.staged_bytes()
    large_first = [torch.ones(BIG), torch.ones(2), {"late": object()}]  # a large tensor before what cannot be kept
    for bad in [*_BAD, large_first]:
        for name, fenced in (("state", False), ("other", True)):
            with pytest.raises(ckptd.CheckpointConfigError):
                coord.save_state_async(name, bad, s + 2, fenced=fenced)
            assert coord.staged_bytes() == staged, bad
    coord.before_update()
    coord.wait_all()
    assert coord.staged_bytes() == staged
    assert not os.path.exists(env.step_dir(s + 2))
    coord.close()


def _save_and_load(env: Env, name: str, state: Any) -> Any:
    """Save ``state`` with the default writer as its own step, expecting either a refusal up front
    (returns the exception) or a commit; then what load_state gives back."""
    coord = env.coord()
    s = env.s
    try:
        coord.register(s + 1, checkpoint_thread_count=1)
        staged = coord.staged_bytes()
        try:
            coord.save_state_async(name, state, s + 1)
        except ckptd.CheckpointConfigError as e:  # refused: then before anything was staged or written
            assert coord.staged_bytes() == staged and not os.path.exists(env.step_dir(s + 1))
            return e
        coord.wait_all()  # the save must not fail after it was accepted
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
        ckptd.verify(env.root, s + 1)
        return ckptd.load_state(env.root, name, s + 1)
    finally:
        coord.close()


def test_a_numpy_float_nan_in_a_nested_state_round_trips_or_is_refused(env):
    got = _save_and_load(env, "sched", {"w": torch.ones(2), "best": np.float64("nan"), "last": np.float64(1.5)})
    if not isinstance(got, Exception):
        assert math.isnan(got["best"]) and got["last"] == 1.5


def test_an_int_json_cannot_hold_is_refused_before_anything_is_staged(env):
    got = _save_and_load(env, "big_int", {"w": torch.ones(2), "n": 10 ** 5000})
    assert isinstance(got, ckptd.CheckpointConfigError) or got["n"] == 10 ** 5000


def test_a_state_nested_deeper_than_json_can_hold_is_refused_before_anything_is_staged(env):
    state: dict = {"w": torch.ones(2)}
    cur = state
    for _ in range(205):  # 5 JSON levels each: past the recursion limit, in any thread
        cur["n"] = [{}]
        cur = cur["n"][0]
    cur["t"] = torch.zeros(1)
    got = _save_and_load(env, "deep", state)
    assert isinstance(got, ckptd.CheckpointConfigError) or torch.equal(got["w"], torch.ones(2))


@pytest.mark.parametrize("state", [
    {"__metadata__": torch.ones(3), "w": torch.zeros(2)},
    {"__metadata__": torch.ones(3), "lr": 0.1},
], ids=["flat", "nested"])
def test_a_tensor_named_metadata_round_trips_or_is_refused(env, state):
    want = copy.deepcopy(state)
    got = _save_and_load(env, "meta", state)
    if not isinstance(got, Exception):
        assert_same_state(want, got)


def test_a_flat_save_after_a_nested_one_of_the_same_name_and_step_loads_as_itself(env):
    coord = env.coord()
    s = env.s
    coord.register(s + 1, checkpoint_thread_count=2)
    coord.save_state_async("optim", {"w": torch.ones(3), "lr": 0.5}, s + 1)
    coord.save_state_async("optim", {"w": torch.zeros(3)}, s + 1)
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    ckptd.verify(env.root, s + 1)
    got = ckptd.load_state(env.root, "optim", s + 1)
    coord.close()
    assert_same_state({"w": torch.zeros(3)}, got)


class _Level(enum.IntEnum):
    HIGH = 2


_Pair = collections.namedtuple("_Pair", "a b")


@pytest.mark.parametrize("value", [_Level.HIGH, _Pair(1, 2)], ids=["IntEnum", "namedtuple"])
def test_a_subclass_of_a_plain_type_round_trips_or_is_refused(env, value):
    got = _save_and_load(env, "sub", {"w": torch.ones(2), "v": value})
    if not isinstance(got, Exception):
        assert type(got["v"]) is type(value) and got["v"] == value


# -- 6: forged files -------------------------------------------------------------------------------


def _forge(env: Env, step: int, rel: str, data: bytes) -> None:
    """Replace a committed file and make its manifest entry match (a hand-crafted checkpoint)."""
    path = f"{env.step_dir(step)}/{rel}"
    with open(path, "wb") as f:
        f.write(data)
    mpath = f"{env.step_dir(step)}/ckptd_manifest.json"
    with open(mpath) as f:
        manifest = json.load(f)
    for entry in manifest["files"]:
        if entry["path"] == rel:
            entry["size"], entry["crc32"] = len(data), f"{zlib.crc32(data):08x}"
            entry["mtime_ns"] = os.stat(path).st_mtime_ns
    with open(mpath, "w") as f:
        json.dump(manifest, f)
    ckptd.verify(env.root, step)  # the forgery is consistent with its manifest


class _Trap:
    """Unpickling it creates a directory: proof that something unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


@pytest.fixture
def committed_optim(env) -> Env:
    coord = env.coord()
    coord.register(env.s + 1, checkpoint_thread_count=1)
    coord.save_state_async("optim", {"state": {0: {"m": torch.ones(3)}}, "lr": 0.5}, env.s + 1)
    coord.wait_committed(env.s + 1, timeout_s=DEADLINE_S)
    coord.close()
    return env


_F = "ckptd.state/1"


def _pickle_trap(path: str) -> bytes:
    buf = io.BytesIO()
    torch.save({"state/0/m": _Trap(path)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("rel", ["optim.safetensors", "optim.state.json"])
def test_a_pickle_in_place_of_either_file_is_never_unpickled(committed_optim, tmp_path, rel):
    env = committed_optim
    trap = str(tmp_path / "unpickled")
    _forge(env, env.s + 1, rel, _pickle_trap(trap))
    with pytest.raises(Exception):  # noqa: B017 - which error is the next test's concern; here: no unpickling
        ckptd.load_state(env.root, "optim", env.s + 1)
    assert not os.path.exists(trap)
    with open(f"{env.step_dir(env.s + 1)}/{rel}", "rb") as f:
        assert f.read(2) == b"PK"  # the forged file is the pickle (torch.save's zip)
    pickle.loads(pickle.dumps(_Trap(trap)))  # and the trap works: unpickling it creates the directory
    assert os.path.isdir(trap)


@pytest.mark.parametrize("rel, payload", [
    ("optim.safetensors", "pickle"),
    ("optim.state.json", {"format": _F, "state": {"pickle": "gASV"}}),
    ("optim.state.json", {"format": "ckptd.state/2", "state": 1}),
    ("optim.state.json", {"format": _F, "state": {"tensor": "state/0/missing"}}),
    ("optim.state.json", {"format": _F, "state": {"dict": [[{"tensor": "state/0/m"}, 1]]}}),
    ("optim.state.json", {"format": _F, "state": {"tensor": "state/0/m", "list": []}}),
    ("optim.state.json", {"format": _F, "state": {"float": "1e999"}}),
    ("optim.state.json", {"format": _F, "state": [1, 2]}),
    ("optim.state.json", [_F]),
    ("optim.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),  # a header with no tensors
], ids=lambda p: str(p)[:30])
def test_forged_files_never_unpickle_and_never_load_as_a_state(committed_optim, tmp_path, rel, payload):
    env = committed_optim
    trap = str(tmp_path / "unpickled")
    if payload == "pickle":
        data = _pickle_trap(trap)
    elif isinstance(payload, bytes):
        data = payload
    else:
        data = json.dumps(payload).encode()
    _forge(env, env.s + 1, rel, data)
    with pytest.raises(ckptd.CorruptCheckpointError, match=r"optim\.(safetensors|state\.json)"):
        ckptd.load_state(env.root, "optim", env.s + 1)
    assert not os.path.exists(trap)


@pytest.mark.parametrize("data", [
    b"PK\x03\x04\x80\x02 not utf-8",
    b'{"format": "ckptd.state/1", "state": ' + b"9" * 5000 + b"}",
    b'{"format": "ckptd.state/1", "state": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
], ids=["not-utf-8", "huge-int", "deep"])
def test_an_unreadable_forged_structure_is_a_corrupt_checkpoint(committed_optim, data):
    env = committed_optim
    _forge(env, env.s + 1, "optim.state.json", data)
    with pytest.raises(ckptd.CorruptCheckpointError):
        ckptd.load_state(env.root, "optim", env.s + 1)


@pytest.mark.parametrize("pairs", [
    [["lr", 0.5], ["lr", 0.7]],
    [[1, 0.5], [True, 0.7]],
], ids=["repeated", "1-and-true"])
def test_a_forged_dict_node_with_duplicate_keys_is_a_corrupt_checkpoint(committed_optim, pairs):
    env = committed_optim
    moments = {"dict": [[0, {"dict": [["m", {"tensor": "state/0/m"}]]}]]}
    structure = {"format": _F, "state": {"dict": [["state", moments], *pairs]}}
    _forge(env, env.s + 1, "optim.state.json", json.dumps(structure).encode())
    with pytest.raises(ckptd.CorruptCheckpointError):
        ckptd.load_state(env.root, "optim", env.s + 1)


# -- 7: saves with a write_fn behave as before ------------------------------------------------------


def test_write_fn_saves_get_a_buffer_per_tensor_and_alternate_with_the_default_writer(env):
    coord = env.coord(max_staged=1)
    s = env.s
    seen: list[dict] = []

    def keep(snapshot):
        leaves = _tensors(snapshot)
        seen.append({"ptrs": [t.untyped_storage().data_ptr() for t in leaves],
                     "values": [t.clone() for t in leaves], "lr": snapshot["lr"]})
        return []

    wants = {}
    for i in range(4):
        step = s + 1 + i
        state = {"state": {0: {"m": torch.full((4, 3), float(step)), "step": torch.tensor(step)}}, "lr": float(step)}
        wants[step] = copy.deepcopy(state)
        coord.register(step, checkpoint_thread_count=1)
        default = i % 2 == 1
        coord.save_state_async("optim", state, step, None if default else keep, fenced=i == 2)
        if i == 2:
            coord.before_update()
        _train_step(state)
        coord.wait_committed(step, timeout_s=DEADLINE_S)
        if default:
            _assert_committed(env, step, "optim", wants[step])
        else:
            assert _visible(env.step_dir(step)) == ["ckptd_manifest.json"]
    assert [snap["lr"] for snap in seen] == [float(s + 1), float(s + 3)]
    for snap, step in zip(seen, (s + 1, s + 3), strict=True):
        assert_same_state(_tensors(wants[step]), snap["values"])
        assert len(set(snap["ptrs"])) == 2  # one buffer per tensor, not views of one image
    assert coord.staged_bytes() == _image_size(wants[s + 4])  # the last save's set (the image)
    coord.close()


def test_a_flat_file_written_from_its_image_is_an_ordinary_safetensors_file(env):
    """The flat file written from the image is an ordinary safetensors file with the default
    writer's metadata, header and order (what safetensors and load_state read)."""
    coord = env.coord()
    s = env.s
    state = {"b": torch.arange(5, dtype=torch.int64), "a": torch.randn(3, 2).t(), "s": torch.tensor(2.5)}
    want = copy.deepcopy(state)
    coord.register(s + 1, checkpoint_thread_count=1)
    coord.save_state_async("model", state, s + 1, fenced=True)
    coord.before_update()
    _train_step(state)
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    _assert_committed(env, s + 1, "model", want)
    with open(f"{env.step_dir(s + 1)}/model.safetensors", "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    assert header.pop("__metadata__") == META and list(header) == ["b", "a", "s"]
    assert (8 + n) % 8 == 0 and len(data) == 8 + n + 5 * 8 + 6 * 4 + 4  # the tensors back to back
    coord.close()
