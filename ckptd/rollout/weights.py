"""One weight version opened by a subscriber: read verified, pinned while the handle is open."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ckptd.config import Kind
from ckptd.errors import CheckpointError, CorruptCheckpointError
from ckptd.layout import is_committed
from ckptd.verify import open_step
from ckptd.workers.weights import WeightSet, read_weights

if TYPE_CHECKING:
    from ckptd.rollout.subscriber import WeightSubscriber


class Weights:
    """The weights of one committed version, from :meth:`WeightSubscriber.open`.

    Use it as a context manager: while it is open, the version is pinned (with a monitor: a read
    lease that retention honours), and on exit the pin is released. The files are read and
    checked against the manifest on the first :meth:`state_dict` or :meth:`load_into`.

    Tensors returned by :meth:`state_dict` stay valid after the handle is closed (on POSIX they
    map files that stay readable even once deleted).

    Attributes:
        version: The step.
        pinned: Whether a read lease holds the step (False without a monitor).
    """

    def __init__(self, subscriber: WeightSubscriber, version: int, lease_id: str | None,
                 model_dir: str | None) -> None:
        self._sub = subscriber
        self.version = version
        self._lease_id = lease_id
        self._model_dir = model_dir
        self._set: WeightSet | None = None
        self._closed = False

    @property
    def pinned(self) -> bool:
        """A read lease holds the step now (False once released, or if the monitor said it was lost)."""
        return self._lease_id is not None and not self._closed and self._sub._holds(self._lease_id)

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Release the pin (idempotent)."""
        if not self._closed:
            self._closed = True
            if self._lease_id is not None:
                self._sub._release(self._lease_id)

    def _weights(self) -> WeightSet:
        if self._set is None:
            if self._closed:
                raise CheckpointError(f"the weights of step {self.version} were released before they were read; "
                                      "read them inside the with block")
            self._set = self._read()
        return self._set

    def _read(self) -> WeightSet:
        storage, kind = self._sub._storage, self._sub.kind
        committed = open_step(storage, self.version, None)
        if Kind.CHECKPOINT not in committed.kinds and kind is Kind.CHECKPOINT:
            raise CheckpointError(f"step {self.version} is committed as a state dict only, not as a checkpoint")
        try:
            return read_weights(storage, committed, self._model_dir)
        except CorruptCheckpointError as e:
            if not is_committed(storage, self.version, kind):
                why = "its lease was lost" if self._lease_id else "no monitor pinned it"
                raise CheckpointError(
                    f"step {self.version} was deleted while it was read ({why}); open the newest version instead"
                ) from e
            raise

    @property
    def format(self) -> str:
        """``"safetensors"``, ``"sharded"``, ``"lora"`` or ``"torch"``."""
        return self._weights().format

    @property
    def files(self) -> list[str]:
        """The files read, relative to the step directory, each checked against the manifest."""
        return self._weights().files

    def state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Name -> tensor, every file checked against the manifest first.

        On CPU, tensors of safetensors files on POSIX storage are views of a private memory map
        (no second copy); pieces of sharded saves are assembled.

        Raises:
            CorruptCheckpointError: a file differs from the manifest; the message names it.
            CheckpointError: the step is not committed, or was deleted while it was read.
        """
        return self._weights().state_dict(device)

    def load_into(self, model: Any, strict: bool = True, adapter_name: str = "default") -> None:
        """Copy the weights into ``model`` after checking every file, name and shape: a refused load
        leaves the model as it was. See :meth:`ckptd.workers.weights.WeightSet.load_into`."""
        self._weights().load_into(model, strict=strict, adapter_name=adapter_name)
