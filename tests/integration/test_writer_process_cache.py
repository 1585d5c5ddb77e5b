"""The writer process's cache of buffer sets (``CheckpointCoordinator(writer="process")``): each
set goes to the writer once and later jobs name its tensors by position. Whatever the cache does,
every committed step must hold the tensors as they were at its save call, for every name: with
shapes and dtypes changing, names alternating, several sets per name, nested states, a writer
killed between saves or mid-write, and sets collected while saves go on."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import weakref
from functools import partial

import pytest
import ray
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.coordinator.staging import tensors_of
from ckptd.storage import Storage
from ckptd.workers.files import write_torch

from .helpers import kill_gated_writer, wait_all, wait_for

# The tests that need no monitor of their own save their own steps (``env``) under one monitor
# that keeps every step.
SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}


# -- what runs in the writer process -------------------------------------------------------------

# Module-level, so they live in the writer process across jobs: weak references to the storages
# of the tensors each name's last job received, and to every storage any job received (weak, so
# that what the writer drops is seen to go). Each job gets new tensor objects (aliases) of the
# sets the writer holds: a cached set shows as the very same storage objects.
_LAST: dict[str, list[weakref.ref]] = {}
_RECEIVED: list[weakref.ref] = []


def write_recording(out: str, name: str, gate: str | None, fail_flag: str | None, snapshot: object) -> list:
    """Writes the snapshot with torch.save to ``out/{name}.pt`` and, to ``out/{name}.json``, what
    the writer process saw: its pid, the ids of the snapshot's storages, whether they are the very
    storages the previous job of ``name`` received, and how many received storages are still alive.
    With ``gate``, waits for that file first; raises if ``fail_flag`` exists."""
    if gate is not None:
        with open(f"{gate}.waiting", "w") as f:
            f.write(str(os.getpid()))
        wait_for(lambda: os.path.exists(gate), timeout_s=60, what="the gate")
    if fail_flag is not None and os.path.exists(fail_flag):
        raise RuntimeError(f"write of {name} failed on purpose")
    tensors = tensors_of(snapshot)
    storages = [t.untyped_storage() for t in tensors]
    last = _LAST.get(name)
    same = last is not None and len(last) == len(storages) and all(
        r() is s for r, s in zip(last, storages, strict=True))
    alive = {id(r()) for r in _RECEIVED if r() is not None}
    _RECEIVED.extend(weakref.ref(s) for s in storages if id(s) not in alive)
    _LAST[name] = [weakref.ref(s) for s in storages]
    del last, alive, storages
    gc.collect()  # only what the writer process itself still holds counts as alive
    record = {"pid": os.getpid(), "ids": [id(t.untyped_storage()) for t in tensors], "same_objects": same,
              "live_storages": sum(r() is not None for r in _RECEIVED)}
    storage = Storage(out)
    storage.makedirs(storage.root)
    record_path = os.path.join(out, f"{name}.json")
    with open(record_path, "w") as f:
        json.dump(record, f)
    return [write_torch(storage, storage.join(f"{name}.pt"), snapshot), record_path]


# -- helpers in the training process -------------------------------------------------------------


def recorder(coord: ckptd.CheckpointCoordinator, step: int, name: str, gate: str | None = None,
             fail_flag: str | None = None) -> partial:
    return partial(write_recording, coord.step_dir(step), name, gate, fail_flag)


def record_of(root: str, step: int, name: str) -> dict:
    with open(os.path.join(root, f"global_step_{step}", f"{name}.json")) as f:
        return json.load(f)


def saved(root: str, step: int, name: str) -> object:
    return torch.load(os.path.join(root, f"global_step_{step}", f"{name}.pt"), weights_only=True)


def clone(state: object) -> object:
    """A deep copy whose tensors are clones: what the state is at this moment."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone(v) for v in state)
    return state


def assert_same(got: object, want: object, where: str) -> None:
    """Equal structure, equal non-tensor leaves, and tensors equal in shape, dtype and values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.shape == want.shape and got.dtype == want.dtype, f"{where}: {got.shape}/{got.dtype}"
        assert torch.equal(got, want), f"{where}: the values differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: {got!r}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_flat_file(root: str, step: int, name: str, want: dict) -> None:
    got = load_file(os.path.join(root, f"global_step_{step}", f"{name}.safetensors"))
    assert_same(got, want, f"step {step} {name}")


def kill_writer(coord: ckptd.CheckpointCoordinator) -> int:
    """SIGKILL the coordinator's writer process and wait until it is gone; its pid."""
    pid = coord._writer.pid
    assert pid is not None
    proc = coord._writer._proc
    os.kill(pid, signal.SIGKILL)
    proc.join(30)  # the writer is a child of this process: reap it, so is_alive() sees it dead
    assert not proc.is_alive()
    return pid


def optimizer_state(n: int, lr: float) -> dict:
    """An optimizer-like state dict: int keys, 0-dim step tensors, non-tensor leaves."""
    return {
        "state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(n + i),
                      "exp_avg_sq": torch.rand(n + i, dtype=torch.float64)} for i in range(2)},
        "param_groups": [{"lr": lr, "betas": (0.9, 0.999), "params": [0, 1], "name": "decay"}],
    }


def step_optimizer(state: dict, lr: float) -> None:
    """What an optimizer step does: tensors changed in place, a scalar hyper-parameter replaced."""
    for entry in state["state"].values():
        entry["step"].add_(1)
        entry["exp_avg"].mul_(0.5).add_(1.0)
        entry["exp_avg_sq"].add_(2.0)
    state["param_groups"][0]["lr"] = lr


# -- the cache -----------------------------------------------------------------------------------


def _descriptors_passed() -> int:
    """How many file descriptors this process has handed to multiprocessing's resource sharer
    (the thread that passes a shared-memory tensor's descriptor to another process), ever."""
    from multiprocessing import resource_sharer

    return resource_sharer._resource_sharer._key


def test_later_saves_of_a_name_reach_the_writer_as_the_cached_tensors_holding_the_new_data(env):
    """The cache at work: from the second save of a name on, the training process passes no file
    descriptor to the writer process, whose write_fn gets the very storages it got the first
    time, and they hold each save's data, not the first one's nor the tensors changed after."""
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        pytest.skip("shared tensors go by file descriptor only with torch's file_descriptor strategy")
    root, s = env.root, env.s
    coord = env.coord(writer="process")
    optim = optimizer_state(16, lr=0.1)
    expected = {}
    passed = [_descriptors_passed()]
    for k in (1, 2, 3):
        expected[k] = clone(optim)
        coord.save_state_async("optim", optim, s + k, recorder(coord, s + k, "optim"), fenced=True)
        coord.register(s + k, checkpoint_thread_count=1)
        coord.before_update()
        step_optimizer(optim, lr=0.1 / (k + 1))
        assert wait_all(coord) is None
        passed.append(_descriptors_passed())
    # The first save sends the set's 5 tensors, descriptor by descriptor; later saves send none.
    assert passed[1] - passed[0] >= 5 and passed[3] == passed[1], passed
    coord.wait_committed(s + 3, timeout_s=60)
    records = {k: record_of(root, s + k, "optim") for k in (1, 2, 3)}
    assert len({r["pid"] for r in records.values()}) == 1 and records[1]["pid"] != os.getpid()
    assert not records[1]["same_objects"]  # the first save sends the set
    assert records[2]["same_objects"] and records[3]["same_objects"]  # later ones name it
    assert records[1]["ids"] == records[2]["ids"] == records[3]["ids"]
    for k in (1, 2, 3):
        assert_same(saved(root, s + k, "optim"), expected[k], f"step {s + k}")
        ckptd.verify(root, s + k)
    coord.close()


def test_names_alternating_with_shapes_and_dtypes_changing_and_two_sets_per_name_keep_each_steps_data(env):
    """Two names saved at every step, with max_staged=2 (two sets per name in turn), fenced and
    eager saves alternating, the model's shape and dtype changing now and then (old sets are
    dropped for new ones, and dropped by the writer): every committed step holds its own data."""
    root, s = env.root, env.s
    coord = env.coord(writer="process", max_staged=2)
    layouts = [(8, torch.float32), (8, torch.float32), (16, torch.float32), (8, torch.float32),
               (8, torch.bfloat16), (8, torch.bfloat16), (16, torch.float32), (16, torch.float32),
               (4, torch.int64), (8, torch.float32), (8, torch.float32), (8, torch.float32)]
    optim = optimizer_state(6, lr=1.0)
    expected_model, expected_optim = {}, {}
    for k, (n, dtype) in enumerate(layouts, start=1):
        step = s + k
        model = {"w": (torch.arange(n * n) * k).reshape(n, n).to(dtype), "b": torch.full((n,), k).to(dtype),
                 "count": torch.tensor([k, -k])}
        expected_model[step], expected_optim[step] = clone(model), clone(optim)
        fenced = k % 2 == 0
        coord.save_state_async("model", model, step, fenced=fenced)
        coord.save_state_async("optim", optim, step, recorder(coord, step, "optim"), fenced=fenced)
        coord.register(step, checkpoint_thread_count=2)
        if fenced:
            coord.before_update()
        model["w"].add_(1)
        model["b"].mul_(-1)
        step_optimizer(optim, lr=1.0 / (k + 1))
    assert wait_all(coord) is None
    coord.wait_committed(s + len(layouts), timeout_s=60)
    for step in range(s + 1, s + len(layouts) + 1):
        assert_flat_file(root, step, "model", expected_model[step])
        assert_same(saved(root, step, "optim"), expected_optim[step], f"step {step} optim")
        ckptd.verify(root, step)
    coord.close()


def test_the_writer_drops_the_sets_of_a_name_whose_state_changed_shape(env):
    """Eight saves, each with a new shape (max_staged=1): each needs a new buffer set and drops
    the old one. The writer process holds the current set, not all eight; every step is right."""
    root, s = env.root, env.s
    coord = env.coord(writer="process")
    expected = {}
    for k in range(1, 9):
        step = s + k
        state = {"a": torch.randn(k + 2), "b": torch.randn(3, k), "c": torch.tensor(k)}
        expected[step] = clone(state)
        coord.save_state_async("opt", state, step, recorder(coord, step, "opt"))
        coord.register(step, checkpoint_thread_count=1)
        state["a"].zero_()
        gc.collect()
    assert wait_all(coord) is None
    coord.wait_committed(s + 8, timeout_s=60)
    records = [record_of(root, step, "opt") for step in range(s + 1, s + 9)]
    assert not any(r["same_objects"] for r in records)  # a new shape is a new set
    # The writer drops a set with the job after its end here: at most the last two are alive.
    assert records[-1]["live_storages"] <= 6, records[-1]
    for step in range(s + 1, s + 9):
        assert_same(saved(root, step, "opt"), expected[step], f"step {step}")
    coord.close()


def test_a_shape_that_comes_back_gets_a_new_set_with_its_own_data(env):
    """A name flips between two shapes at every save (max_staged=1): the writer never writes from
    a set of the other shape, nor from the earlier set of the same shape (dropped meanwhile)."""
    root, s = env.root, env.s
    coord = env.coord(writer="process")
    expected = {}
    for k in range(1, 9):
        step = s + k
        n = 5 if k % 2 else 7
        state = {"x": torch.arange(n, dtype=torch.float32) + 100 * k}
        expected[step] = clone(state)
        coord.save_state_async("flip", state, step, fenced=True)
        coord.register(step, checkpoint_thread_count=1)
        coord.before_update()
        state["x"].fill_(-1)
    assert wait_all(coord) is None
    coord.wait_committed(s + 8, timeout_s=60)
    for step in range(s + 1, s + 9):
        assert_flat_file(root, step, "flip", expected[step])
        ckptd.verify(root, step)
    coord.close()


# -- states the cache must not confuse ----------------------------------------------------------


def test_one_tensor_twice_views_and_odd_tensors_in_a_nested_state_keep_each_steps_data(env):
    """The same tensor object at two places, a view of it, a transposed (non-contiguous) tensor,
    an empty tensor, a 0-dim bool and a tuple of tensors, in a nested state with non-tensor
    leaves that change between saves: each position gets its own buffer and its own data."""
    root, s = env.root, env.s
    coord = env.coord(writer="process")
    x = torch.arange(10, dtype=torch.float32)
    y = torch.randn(3, 4)
    state = {"a": x, "nested": {"again": x, "view": x[2:6], "t": y.t()},
             "pair": (torch.zeros(2), torch.ones(3, dtype=torch.int8)),
             "empty": torch.empty(0), "flag": torch.tensor(True), "meta": {"epoch": 0, "tag": "s0"}}
    expected = {}
    for k in (1, 2, 3):
        step = s + k
        state["meta"] = {"epoch": k, "tag": f"s{k}"}
        expected[step] = clone(state)
        coord.save_state_async("mixed", state, step, recorder(coord, step, "mixed"), fenced=True)
        coord.register(step, checkpoint_thread_count=1)
        coord.before_update()
        x.mul_(2).add_(1)  # the view changes with it
        y.sub_(3)
        state["pair"][0].add_(5)
        state["flag"].logical_not_()
    assert wait_all(coord) is None
    coord.wait_committed(s + 3, timeout_s=60)
    assert record_of(root, s + 3, "mixed")["same_objects"]
    for step in (s + 1, s + 2, s + 3):
        got = saved(root, step, "mixed")
        assert_same(got, expected[step], f"step {step}")
        assert torch.equal(got["a"], got["nested"]["again"])
        assert torch.equal(got["nested"]["view"], got["a"][2:6])
    coord.close()


def test_a_state_with_the_layout_of_another_reuses_its_set_and_writes_its_own_structure(env):
    """Two states of one name with the same tensor layout but other keys and leaves: the set is
    reused (same objects in the writer), the structure and values are the new state's."""
    root, s = env.root, env.s
    coord = env.coord(writer="process")
    first = {"p": torch.ones(4), "q": [torch.zeros(2, 2), 7]}
    second = {"renamed": torch.full((4,), 3.0), "other": [torch.eye(2), "seven"]}
    for step, state in ((s + 1, first), (s + 2, second)):
        coord.save_state_async("s", state, step, recorder(coord, step, "s"))
        coord.register(step, checkpoint_thread_count=1)
    assert wait_all(coord) is None
    coord.wait_committed(s + 2, timeout_s=60)
    assert record_of(root, s + 2, "s")["same_objects"]
    assert_same(saved(root, s + 1, "s"), first, "step 1")
    assert_same(saved(root, s + 2, "s"), second, "step 2")
    coord.close()


# -- a writer that fails or dies ------------------------------------------------------------------


def test_a_writer_killed_between_saves_is_sent_the_sets_again_and_writes_the_new_data(env):
    """Killed while idle, after it received the sets of two names: the next saves start a new
    writer that is sent the sets again (not named by position to a process that never got them)
    and write the data of their own step."""
    root, s = env.root, env.s
    coord = env.coord(writer="process", max_staged=2)
    model = {"w": torch.randn(32), "b": torch.randn(4)}
    optim = optimizer_state(8, lr=0.5)
    expected = {}
    for k in range(1, 7):
        step = s + k
        expected[k] = (clone(model), clone(optim))
        coord.save_state_async("model", model, step, fenced=True)
        coord.save_state_async("optim", optim, step, recorder(coord, step, "optim"), fenced=True)
        coord.register(step, checkpoint_thread_count=2)
        coord.before_update()
        model["w"].add_(1.0)
        step_optimizer(optim, lr=0.5 / (k + 1))
        if k in (2, 4):
            assert wait_all(coord) is None  # idle: the kill lands between saves
            kill_writer(coord)
    assert wait_all(coord) is None
    coord.wait_committed(s + 6, timeout_s=60)
    records = {k: record_of(root, s + k, "optim") for k in range(1, 7)}
    pids = [records[k]["pid"] for k in range(1, 7)]
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4] == pids[5]
    assert not records[3]["same_objects"] and not records[5]["same_objects"]  # sent again
    for k in range(1, 7):
        want_model, want_optim = expected[k]
        assert_flat_file(root, s + k, "model", want_model)
        assert_same(saved(root, s + k, "optim"), want_optim, f"step {s + k} optim")
        ckptd.verify(root, s + k)
    coord.close()


def test_a_writer_killed_mid_write_commits_nothing_wrong_and_the_next_saves_write_their_own_data(
        make_monitor, tmp_path):
    """The writer holds the sets of two names; it is killed while writing step 2 of one. Step 2
    fails; step 3's saves, on the same sets, go to a new writer and commit step 3's data."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0", writer="process")
    model = {"w": torch.randn(64)}
    optim = optimizer_state(8, lr=0.5)
    gate = str(tmp_path / "gate")
    expected = {}
    for step in (1, 2, 3):
        expected[step] = (clone(model), clone(optim))
        coord.register(step, checkpoint_thread_count=2)
        coord.save_state_async("model", model, step, fenced=True)
        coord.save_state_async("optim", optim, step, recorder(coord, step, "optim", gate if step == 2 else None),
                               fenced=True)
        coord.before_update()
        model["w"].add_(1.0)
        step_optimizer(optim, lr=0.5 / (step + 1))
        if step == 2:
            kill_gated_writer(gate)
            error = wait_all(coord)
            assert error is not None and "died" in error and "exit code -9" in error
            with pytest.raises(ckptd.CheckpointSaveError):
                coord.wait_committed(2, timeout_s=30)
        else:
            assert wait_all(coord) is None
    coord.wait_committed(3, timeout_s=60)
    assert ckptd.latest_step(root) == 3
    assert record_of(root, 3, "optim")["pid"] != record_of(root, 1, "optim")["pid"]
    for step in (1, 3):
        want_model, want_optim = expected[step]
        assert_flat_file(root, step, "model", want_model)
        assert_same(saved(root, step, "optim"), want_optim, f"step {step} optim")
        ckptd.verify(root, step)
    coord.close()


def test_a_write_that_raises_keeps_the_writer_and_its_sets_and_the_next_step_is_right(env, tmp_path):
    """A write_fn that raises in the writer process fails its step only; the writer keeps running
    with its sets, and the next save, named by position, writes its own data."""
    root, s = env.root, env.s
    coord = env.coord(writer="process")
    flag = str(tmp_path / "fail")
    state = {"w": torch.randn(20), "n": torch.tensor(0)}
    expected = {}
    for step in (s + 1, s + 2, s + 3):
        if step == s + 2:
            open(flag, "w").close()
        expected[step] = clone(state)
        coord.register(step, checkpoint_thread_count=1)
        coord.save_state_async("s", state, step, recorder(coord, step, "s", fail_flag=flag))
        state["w"].add_(1.0)
        state["n"].add_(1)
        error = wait_all(coord)
        if step == s + 2:
            assert error is not None and "failed on purpose" in error
            with pytest.raises(ckptd.CheckpointSaveError):
                coord.wait_committed(s + 2, timeout_s=30)
            os.remove(flag)
        else:
            assert error is None
    coord.wait_committed(s + 3, timeout_s=60)
    assert record_of(root, s + 3, "s")["same_objects"]  # the same writer, the same cached set
    assert record_of(root, s + 3, "s")["pid"] == record_of(root, s + 1, "s")["pid"]
    for step in (s + 1, s + 3):
        assert_same(saved(root, step, "s"), expected[step], f"step {step}")
    coord.close()


# -- collection racing with saves ----------------------------------------------------------------


def test_sets_collected_while_saves_go_on_never_leave_a_job_naming_a_dropped_set(env):
    """A thread runs gc.collect() over and over while three names save with shapes changing at
    every few steps (sets dropped and collected at any moment, in any thread): every step
    commits with its own data."""
    root, s = env.root, env.s
    coord = env.coord(writer="process", max_staged=2)
    stop = threading.Event()

    def collect() -> None:
        # A collection of this process's heap holds the GIL ~0.1 s: one in every 0.15 s or so.
        while not stop.wait(0.05):
            gc.collect()

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    expected = {}
    try:
        for i in range(1, 11):
            step = s + i
            states = {name: {"t": torch.arange(3 + (i + k) // 3, dtype=torch.float32) * i + k,
                             "u": torch.full((2, 1 + i % 2), float(-i))}
                      for k, name in enumerate(("a", "b", "c"))}
            expected[step] = clone(states)
            for name, state in states.items():
                coord.save_state_async(name, state, step, fenced=i % 3 == 0)
            coord.register(step, checkpoint_thread_count=3)
            coord.before_update()
            for state in states.values():
                state["t"].fill_(0)
        assert wait_all(coord) is None
        coord.wait_committed(s + 10, timeout_s=60)
    finally:
        stop.set()
        collector.join()
    for step in range(s + 1, s + 11):
        for name in ("a", "b", "c"):
            assert_flat_file(root, step, name, expected[step][name])
        ckptd.verify(root, step)
    coord.close()


# -- more than one writer ------------------------------------------------------------------------


def test_two_coordinators_in_one_process_each_send_their_own_sets_to_their_own_writer(env, make_monitor, tmp_path):
    """Two coordinators of one training process (buffer set uids are unique in the process, the
    cache is per writer): saves of the same name and layout, interleaved, each write their own
    coordinator's data, each by its own writer process, which names the set from the second
    save on; one tensor saved under two names of one coordinator is staged for each."""
    # The first on the module's monitor, the second on a monitor (and root) of its own; both save
    # steps s + 1..3.
    s = env.s
    roots = [env.root, str(tmp_path / "ckpt1")]
    coords = [env.coord(writer="process"),
              ckptd.CheckpointCoordinator(make_monitor(roots[1]), worker_id="w1", writer="process")]
    shared = torch.arange(12, dtype=torch.float32)
    states = [{"t": torch.zeros(12) + 10 * i, "shared": shared} for i in range(2)]
    expected = {}
    for step in (s + 1, s + 2, s + 3):
        for i, coord in enumerate(coords):
            expected[i, step] = clone(states[i])
            coord.save_state_async("model", states[i], step, recorder(coord, step, "model"))
            coord.save_state_async("alias", {"shared": shared}, step, fenced=True)
            coord.register(step, checkpoint_thread_count=2)
            coord.before_update()
            states[i]["t"].add_(1)
        shared.mul_(-2)
    for coord in coords:
        assert wait_all(coord) is None
        coord.wait_committed(s + 3, timeout_s=60)
    pids = {record_of(roots[i], s + 1, "model")["pid"] for i in range(2)}
    assert len(pids) == 2 and os.getpid() not in pids
    for i, root in enumerate(roots):
        assert record_of(root, s + 3, "model")["same_objects"]
        for step in (s + 1, s + 2, s + 3):
            assert_same(saved(root, step, "model"), expected[i, step], f"coordinator {i} step {step}")
            assert_flat_file(root, step, "alias", {"shared": expected[i, step]["shared"]})
            ckptd.verify(root, step)
    for coord in coords:
        coord.close()


@ray.remote(num_cpus=0)
class ProcessWriterTrainer:
    """A training worker (a Ray actor) whose coordinator writes through a writer process."""

    def __init__(self, run: str, worker_id: str = "actor0") -> None:
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id=worker_id, writer="process")
        self.optim = optimizer_state(10, lr=0.3)

    def train(self, steps: int, first: int = 1) -> list:
        """Saves at every step from ``first`` on, ``steps`` of them (fenced, then the optimizer
        step); what each save held."""
        expected = []
        for k in range(1, steps + 1):
            step = first + k - 1
            expected.append(clone(self.optim))
            self.coord.save_state_async("optim", self.optim, step, recorder(self.coord, step, "optim"), fenced=True)
            self.coord.register(step, checkpoint_thread_count=1)
            self.coord.before_update()
            step_optimizer(self.optim, lr=0.3 / (k + 1))
        error = wait_all(self.coord)
        self.coord.wait_committed(first + steps - 1, timeout_s=60)
        return [error, expected, os.getpid()]

    def close(self) -> None:
        self.coord.close()


def test_a_coordinator_in_a_ray_actor_writes_each_steps_data_through_its_cached_sets(env, shared_run):
    """Where coordinators live in practice: a Ray actor starts the writer process (spawned from a
    Ray worker), which names the set from the second save on and writes every step's data."""
    root, s = env.root, env.s
    trainer = ProcessWriterTrainer.remote(shared_run, worker_id=f"actor{s}")
    try:
        error, expected, actor_pid = ray.get(trainer.train.remote(3, first=s + 1), timeout=120)
        assert error is None
        records = [record_of(root, step, "optim") for step in (s + 1, s + 2, s + 3)]
        assert len({r["pid"] for r in records}) == 1 and records[0]["pid"] not in (actor_pid, os.getpid())
        assert [r["same_objects"] for r in records] == [False, True, True]
        for k in (1, 2, 3):
            assert_same(saved(root, s + k, "optim"), expected[k - 1], f"step {s + k}")
            ckptd.verify(root, s + k)
        ray.get(trainer.close.remote(), timeout=60)
    finally:
        ray.kill(trainer, no_restart=True)


# -- what a write_fn does to the tensors it is given ---------------------------------------------


def write_batched(out: str, snapshot: dict) -> list:
    """Adds a leading batch dimension to each tensor in place (metadata only: no data is
    written into the shared buffers), then writes the snapshot."""
    for t in snapshot.values():
        t.unsqueeze_(0)
    storage = Storage(out)
    storage.makedirs(storage.root)
    return [write_torch(storage, storage.join("batched.pt"), snapshot)]


def test_a_write_fns_in_place_view_change_of_one_save_does_not_reach_the_next(env):
    """A write_fn that reshapes the snapshot's tensors in place (writing no data into them) gets,
    at each save, tensors shaped like that save's state: the writer process holds the sets, and
    hands each job new aliases of their tensors."""
    root, s = env.root, env.s
    coord = env.coord(writer="process")
    state = {"w": torch.arange(6, dtype=torch.float32)}
    for step in (s + 1, s + 2):
        coord.save_state_async("b", state, step, partial(write_batched, coord.step_dir(step)))
        coord.register(step, checkpoint_thread_count=1)
    assert wait_all(coord) is None
    coord.wait_committed(s + 2, timeout_s=60)
    for step in (s + 1, s + 2):
        got = torch.load(os.path.join(root, f"global_step_{step}", "batched.pt"), weights_only=True)
        assert got["w"].shape == (1, 6), f"step {step}: {tuple(got['w'].shape)}"
    coord.close()
