"""A nested state as tensors and a JSON structure (ckptd/workers/state_file.py): every plain value
and container comes back with its type, tensors by name, and what cannot be kept is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ckptd.coordinator.staging import tensors_of
from ckptd.errors import CheckpointConfigError, CorruptCheckpointError
from ckptd.workers.state_file import flatten, is_flat, unflatten


def _optimizer_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is type(kb) for k, kb in zip(a, b, strict=True)) and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _round_trip(state):
    tensors, structure = flatten(state)
    text = json.dumps(structure)  # what the file holds
    return tensors, unflatten(json.loads(text), tensors)


def test_an_optimizer_state_comes_back_with_int_keys_tuples_and_plain_values():
    state = _optimizer_state()
    tensors, back = _round_trip(state)
    assert _same(state, back)
    assert back["param_groups"][0]["betas"] == (0.8, 0.95) and 0 in back["state"]
    assert "state/0/exp_avg" in tensors  # readable names, by where each tensor sits
    # The tensors come out in the order staging copies them (the file's image depends on it).
    assert [id(t) for t in tensors.values()] == [id(t) for t in tensors_of(state)]


def test_plain_values_keep_their_types_and_names_stay_unique():
    state = {
        1: torch.ones(2), "1": torch.zeros(3), 1.5: [None, True, 2, 2.0, float("nan"), float("-inf"), "s"],
        None: ({"a": torch.arange(3)}, []), False: {}, "x/y": torch.ones(1), "x": {"y": torch.zeros(1)},
    }
    tensors, back = _round_trip(state)
    assert _same(state, back)
    assert len(tensors) == 5  # "1" twice and "x/y" twice, each name given once


@pytest.mark.parametrize("bad, match", [
    ({"w": torch.ones(2), "f": object()}, r"state\['f'\] is a object"),
    ({"w": torch.ones(2), (1, 2): torch.ones(1)}, r"has a key a tuple \(\(1, 2\)\)"),
    ({"w": torch.ones(2), "d": torch.float32}, r"state\['d'\] is a dtype"),
    ({"w": [torch.ones(2, dtype=torch.complex64)]}, "cannot hold"),
])
def test_what_cannot_be_kept_is_refused_with_where_it_is(bad, match):
    with pytest.raises(CheckpointConfigError, match=match):
        flatten(bad)


def test_only_a_dict_of_named_tensors_is_flat():
    assert is_flat({"a": torch.ones(1), "b": torch.zeros(2)})
    assert not is_flat({"a": torch.ones(1), "lr": 0.1})
    assert not is_flat({0: torch.ones(1)}) and not is_flat({}) and not is_flat([torch.ones(1)])


@pytest.mark.parametrize("structure, match", [
    ({"format": "other", "state": 1}, "not a ckptd state structure"),
    ({"format": "ckptd.state/1", "state": {"tensor": "missing"}}, "names tensor 'missing'"),
    ({"format": "ckptd.state/1", "state": {"pickle": "x"}}, "unknown node"),
    ({"format": "ckptd.state/1", "state": {"dict": [[["unhashable"], 1]]}}, "unreadable state structure"),
    ({"format": "ckptd.state/1", "state": {"float": "1e999"}}, "unknown node"),
])
def test_a_structure_that_is_not_one_flatten_writes_is_corrupt(structure, match):
    with pytest.raises(CorruptCheckpointError, match=match):
        unflatten(structure, {"t": torch.ones(1)})
