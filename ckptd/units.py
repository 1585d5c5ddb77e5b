"""Save units and the validation of what identifies them."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError

_MAX_NAME = 200


def check_step(step: object, what: str = "global_step") -> int:
    """Return ``step`` if it is a non-negative integer, else raise CheckpointConfigError."""
    # bool is an int subclass; True as a step is always a bug.
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise CheckpointConfigError(
            f"{what} must be a non-negative int, got {type(step).__name__} {step!r}"
        )
    if step < 0:
        raise CheckpointConfigError(f"{what} must be >= 0, got {step}")
    return int(step)


def check_count(count: object, what: str) -> int:
    """Return ``count`` if it is a non-negative integer, else raise CheckpointConfigError."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise CheckpointConfigError(f"{what} must be an int >= 0, got {count!r}")
    if count < 0:
        raise CheckpointConfigError(f"{what} must be >= 0, got {count}")
    return int(count)


def check_name(name: object, what: str = "save name") -> str:
    """Return ``name`` if it is safe to use in a file name, else raise CheckpointConfigError.

    Names end up in receipt file names, so path separators, ``..`` and control characters are
    refused rather than escaped: a name that silently changed would not match the caller's.
    """
    if not isinstance(name, str) or not name:
        raise CheckpointConfigError(f"{what} must be a non-empty string, got {name!r}")
    if len(name) > _MAX_NAME:
        raise CheckpointConfigError(f"{what} must be at most {_MAX_NAME} characters, got {len(name)}")
    bad = [c for c in ("/", "\\", "\x00") if c in name]
    if bad or ".." in name or name == "." or any(ord(c) < 32 for c in name):
        raise CheckpointConfigError(
            f"{what} {name!r} is unsafe: it must not contain path separators, '..' or control "
            "characters; use a plain identifier such as 'model' or 'optimizer_rank0'"
        )
    return name


@dataclass(frozen=True)
class UnitId:
    """One save unit: a save_async or save_sync call, identified by (worker, name, step, kind)."""

    worker: str
    name: str
    step: int
    kind: Kind

    @property
    def label(self) -> str:
        """The unit's name within its step: ``worker/name``."""
        return f"{self.worker}/{self.name}"

    @property
    def file_stem(self) -> str:
        """A file-name-safe form of :attr:`label` (both parts passed :func:`check_name`)."""
        return f"{self.worker}~{self.name}"

    def to_dict(self) -> dict:
        return {"worker": self.worker, "name": self.name, "step": self.step, "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: dict) -> UnitId:
        return cls(d["worker"], d["name"], int(d["step"]), Kind(d["kind"]))
