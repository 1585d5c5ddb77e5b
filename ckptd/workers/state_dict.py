"""Preparing what a save unit writes: snapshots and sub-module selection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are detached host copies; containers are rebuilt.

    Call it on the training thread before ``save_async``: the optimizer changes parameters and
    its own state in place, and a save that reads them later would mix two steps.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    return obj


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
