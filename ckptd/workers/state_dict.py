"""Preparing what a save unit writes: snapshots and sub-module selection."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] = lambda x: x) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)`` and every other leaf by ``other(leaf)``.

    Dicts (any mapping), lists and tuples are rebuilt, in order, so tensors are visited in the
    same order on every call for the same structure.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn, other) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn, other) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn, other) for v in obj)
    return other(obj)


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are detached host copies; containers are rebuilt.

    Call it on the training thread before ``save_async``: the optimizer changes parameters and
    its own state in place, and a save that reads them later would mix two steps.
    """
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def select_prefix(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under ``prefix`` (one attribute of a composite model), with the prefix removed.

    ``select_prefix(ppo.state_dict(), "policy")`` turns ``policy.model.layers.0...`` into
    ``model.layers.0...``, which is what the policy alone would have as its state dict.

    Raises:
        CheckpointConfigError: no key starts with the prefix; the message lists the top-level
            names the state dict has.
    """
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise CheckpointConfigError(f"prefix must be a non-empty attribute path such as 'policy', got {prefix!r}")
    dotted = prefix.rstrip(".") + "."
    out = {k[len(dotted):]: v for k, v in state_dict.items() if k.startswith(dotted)}
    if not out:
        tops = sorted({k.split(".", 1)[0] for k in state_dict})
        raise CheckpointConfigError(
            f"no key of the state dict starts with {dotted!r}; its top-level names are {tops[:20]}"
        )
    return out
