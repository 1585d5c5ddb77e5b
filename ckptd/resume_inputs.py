"""What :func:`ckptd.resume` checks of its arguments and of the states it read, before it changes
anything: objects of the wrong kind, a model on the meta device, and a scheduler's state saved
from another scheduler class would otherwise fail (or load) half-way through the resume."""

from __future__ import annotations

from typing import Any

from ckptd.errors import CheckpointConfigError
from ckptd.units import check_rank, check_step


def check_inputs(*, model: Any, optimizer: Any, lr_scheduler: Any, dataloader: Any, rank: object,
                 world_size: object, restore_rng: object, model_dir: object) -> None:
    """Raise :class:`CheckpointConfigError` for an argument :func:`ckptd.resume` cannot use."""
    if world_size is None:
        check_step(rank, "rank")
    else:
        check_rank(rank, world_size)
    if not isinstance(restore_rng, bool):
        raise CheckpointConfigError(f"restore_rng must be True or False, got {restore_rng!r}")
    if model_dir is not None and not isinstance(model_dir, str):
        raise CheckpointConfigError(f"model_dir must be a str (the weights' folder in the step) or None, "
                                    f"got {model_dir!r}")
    if model is not None:
        if not all(callable(getattr(model, m, None)) for m in ("state_dict", "load_state_dict", "parameters")):
            raise CheckpointConfigError(
                f"model= must be the model (a torch.nn.Module) to load into, got a {type(model).__name__}; "
                "to read the weights as tensors, use ckptd.load_state or a WeightSubscriber")
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            raise CheckpointConfigError(
                "model= has tensors on the meta device, which loading cannot fill in place: call "
                "model.to_empty(device=...) first (then resume fills every tensor)")
    if optimizer is not None and not (isinstance(getattr(optimizer, "param_groups", None), list)
                                      and callable(getattr(optimizer, "load_state_dict", None))):
        raise CheckpointConfigError(
            "optimizer= must be the optimizer (a torch.optim.Optimizer) to load into, got a "
            f"{type(optimizer).__name__}")
    for what, obj in (("lr_scheduler", lr_scheduler), ("dataloader", dataloader)):
        if obj is not None and not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise CheckpointConfigError(
                f"{what}= must have state_dict() and load_state_dict() (as it had when saved), got a "
                f"{type(obj).__name__}")


def check_scheduler_state(state: Any, scheduler: Any, what: str) -> None:
    """Refuse a scheduler state saved from another scheduler class: its keys are not this one's
    (``load_state_dict`` would copy them in, or fail half-way)."""
    mine = scheduler.state_dict()
    if not isinstance(state, dict) or set(state) != set(mine):
        have = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointConfigError(
            f"{what} is not the state of a {type(scheduler).__name__}: it has {have}, this scheduler "
            f"{sorted(mine)}. Pass the scheduler class the run was saved with, or lr_scheduler=None")
