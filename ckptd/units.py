"""Validation of what identifies a save (steps, counts, ranks and names) and of wait timeouts."""

from __future__ import annotations

import numbers

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


def check_timeout(timeout_s: object, what: str = "timeout_s") -> float | None:
    """Return ``timeout_s`` as a float (None: no limit) if it is a number >= 0, else raise
    CheckpointConfigError."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or timeout_s != timeout_s:
        raise CheckpointConfigError(f"{what} must be a number of seconds >= 0 or None (no limit), got {timeout_s!r}")
    if timeout_s < 0:
        raise CheckpointConfigError(f"{what} must be >= 0 (or None: no limit), got {timeout_s}")
    return float(timeout_s)


def check_rank(rank: object, world_size: object) -> None:
    """Raise CheckpointConfigError unless ``0 <= rank < world_size``."""
    check_step(rank, "rank")
    if check_step(world_size, "world_size") < 1 or rank >= world_size:
        raise CheckpointConfigError(f"rank must be in [0, world_size), got rank {rank} of world_size {world_size}")


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
