"""Training state: optimizer, LR scheduler, dataloader, RNG, and where training stands.

    dir/
      optimizer/rank-00000.pt        per rank: optimizer.state_dict()
      lr_scheduler/rank-00000.pt     per rank: lr_scheduler.state_dict()
      rng/rank-00000.pt              per rank: python, numpy, torch CPU (and CUDA) generators
      data.pt                        rank 0: dataloader.state_dict()
      running_states.json            rank 0: epoch, step, step_in_epoch, sample_start_index, ...

Everything is ``torch.save`` of tensors and plain containers, so ``torch.load(weights_only=True)``
reads it back; the world size is recorded, never part of a file name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from ckptd.errors import CheckpointConfigError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.units import check_rank, check_step
from ckptd.workers.files import write_json, write_torch
from ckptd.workers.state_dict import snapshot

RUNNING_STATES = "running_states.json"
DATA = "data.pt"
PER_RANK = ("optimizer", "lr_scheduler", "rng")


def rank_file(part: str, rank: int) -> str:
    return f"{part}/rank-{rank:05d}.pt"


class RunningState(BaseModel):
    """Where training stood when the checkpoint was taken (``running_states.json``).

    Attributes:
        epoch: The epoch the last trained step belongs to (0-based).
        step: Global steps trained so far (the checkpoint's step).
        step_in_epoch: Steps of ``epoch`` trained so far.
        sample_start_index: ``step_in_epoch * batch_size``: where a sampler resumes in the epoch.
        consumed_samples: Samples consumed by all ranks since the start of training.
        world_size: How many ranks trained.
        batch_size: Samples per step per rank, if known.
        steps_per_epoch: Steps in one epoch, if known (``len(dataloader)`` by default).
        extra: Anything else the job recorded (JSON values).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    epoch: int
    step: int
    step_in_epoch: int
    sample_start_index: int
    consumed_samples: int
    world_size: int
    batch_size: int | None = None
    steps_per_epoch: int | None = None
    extra: dict[str, Any] = {}

    @property
    def epoch_finished(self) -> bool:
        """The checkpoint was taken after the last step of its epoch."""
        return self.steps_per_epoch is not None and self.step_in_epoch >= self.steps_per_epoch


@dataclass
class TrainingState:
    """A snapshot of training state, taken on the training thread, written in a save unit."""

    rank: int
    running: RunningState
    optimizer: dict | None = None
    lr_scheduler: dict | None = None
    dataloader: dict | None = None
    rng: dict | None = None


def rng_state() -> dict:
    """Every random generator training draws from: python, numpy's global one, torch CPU, CUDA."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"], "gauss": n["gauss"],
    })
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def end_epoch(dataloader_state: dict) -> dict:
    """The dataloader state of a checkpoint taken after the last batch of an epoch, marked so that
    the next ``iter()`` starts a new epoch.

    StatefulDataLoader's state taken inside the loop, after the last batch but before the loop
    saw StopIteration, restores an exhausted iterator: the first epoch after resuming would be
    silently empty. Its own flag for an epoch that has ended fixes that and keeps the rest of the
    state (sampler, dataset, generator). Other loaders' states pass through unchanged.
    """
    if "_iterator_finished" in dataloader_state:
        return {**dataloader_state, "_iterator_finished": True}
    return dataloader_state


def _state_of(obj: Any, what: str) -> dict | None:
    if obj is None:
        return None
    fn = getattr(obj, "state_dict", None)
    if not callable(fn) or not callable(getattr(obj, "load_state_dict", None)):
        hint = " (use torchdata's StatefulDataLoader)" if what == "dataloader" else ""
        raise CheckpointConfigError(
            f"{what} must have state_dict() and load_state_dict(){hint}, got {type(obj).__name__}"
        )
    return snapshot(fn())


def capture_training_state(
    *,
    epoch: int,
    step: int,
    step_in_epoch: int,
    batch_size: int | None = None,
    steps_per_epoch: int | None = None,
    consumed_samples: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    dataloader: Any = None,
    rng: bool = True,
    extra: dict | None = None,
) -> TrainingState:
    """Snapshot the training state on the training thread; write it with :func:`save_training_state`.

    Call it after the optimizer step of ``step`` and before the next one changes anything.

    Args:
        epoch: Epoch of the last trained step (0-based).
        step: Global steps trained so far.
        step_in_epoch: Steps of ``epoch`` trained so far (``steps_per_epoch`` at the epoch's end).
        batch_size: Samples per step per rank.
        steps_per_epoch: Steps in an epoch; defaults to ``len(dataloader)`` when it has one.
            Resume needs it to tell that a checkpoint ended its epoch.
        consumed_samples: Defaults to ``step * batch_size * world_size``.
        rank, world_size: This rank and the number of ranks.
        optimizer, lr_scheduler, dataloader: Objects with ``state_dict()``/``load_state_dict()``.
        rng: Capture the random generators.
        extra: JSON values to keep in ``running_states.json``.

    Raises:
        CheckpointConfigError: bad numbers or objects without state_dict().
    """
    for name, value in (("epoch", epoch), ("step", step), ("step_in_epoch", step_in_epoch)):
        check_step(value, name)
    check_rank(rank, world_size)
    if steps_per_epoch is None and dataloader is not None:
        try:
            steps_per_epoch = len(dataloader)
        except TypeError:
            steps_per_epoch = None  # an iterable dataset: epoch ends are unknown
    if steps_per_epoch is not None and step_in_epoch > check_step(steps_per_epoch, "steps_per_epoch"):
        raise CheckpointConfigError(f"step_in_epoch {step_in_epoch} is past steps_per_epoch {steps_per_epoch}")
    if batch_size is not None:
        check_step(batch_size, "batch_size")
    if consumed_samples is None:
        consumed_samples = step * (batch_size or 0) * world_size
    running = RunningState(
        epoch=epoch, step=step, step_in_epoch=step_in_epoch,
        sample_start_index=step_in_epoch * (batch_size or 0), consumed_samples=check_step(consumed_samples),
        world_size=world_size, batch_size=batch_size, steps_per_epoch=steps_per_epoch, extra=dict(extra or {}),
    )
    data = _state_of(dataloader, "dataloader") if rank == 0 else None
    if data is not None and running.epoch_finished:
        data = end_epoch(data)
    return TrainingState(
        rank=rank, running=running,
        optimizer=_state_of(optimizer, "optimizer"),
        lr_scheduler=_state_of(lr_scheduler, "lr_scheduler"),
        dataloader=data,
        rng=snapshot(rng_state()) if rng else None,
    )


def save_training_state(
    out_dir: str, state: TrainingState, *, storage_options: dict | None = None
) -> list[WrittenFile]:
    """Write a :class:`TrainingState` into ``out_dir`` (run it in a save unit, on every rank)."""
    storage = Storage(out_dir, storage_options)
    base = storage.root
    written = []
    for part in PER_RANK:
        value = getattr(state, part)
        if value is not None:
            storage.makedirs(f"{base}/{part}")
            written.append(write_torch(storage, f"{base}/{rank_file(part, state.rank)}", value))
    if state.rank == 0:
        storage.makedirs(base)
        if state.dataloader is not None:
            written.append(write_torch(storage, f"{base}/{DATA}", state.dataloader))
        written.append(write_json(storage, f"{base}/{RUNNING_STATES}", state.running.model_dump(mode="json")))
    return written
