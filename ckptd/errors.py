"""Exceptions raised by ckptd.

Every exception derives from :class:`CheckpointError`. Those that describe bad input also derive
from :class:`ValueError`, so callers that already catch ``ValueError`` keep working. All of them
take simple constructor arguments so they survive pickling across Ray.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error ckptd raises."""


class CheckpointConfigError(CheckpointError, ValueError):
    """Bad input: an invalid step, unit name, count, option or root. Nothing was written."""


class RegistrationConflictError(CheckpointConfigError):
    """A registration conflicts with what is committed: it adds units to a step that is already
    committed as a checkpoint (registrations of a step otherwise add up)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A committed checkpoint does not match its manifest."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A checkpoint file would need arbitrary Python objects unpickled to load; it was refused."""


class FailpointError(CheckpointError):
    """Raised by a failpoint armed with the ``raise`` action (tests and fault drills only)."""


class CheckpointSaveError(CheckpointError, RuntimeError):
    """A save unit failed: its data is in no manifest. Its step (of that kind) then fails too and
    is never committed, unless the unit was not part of a commit already in flight (it failed,
    or timed out, before it was admitted); such a commit goes on without it (docs/contract.md),
    and ``cause`` then ends with the monitor's words for it. A unit refused because its step's
    commit is undecided (``cause`` says so: a newer job took the root over) fails alone: that
    job decides whether the step is committed. ``wait_committed`` says how the step
    ends.

    Args:
        step: The training step whose save failed.
        kind: ``"checkpoint"`` or ``"state_dict"``.
        unit: The failed unit, as ``worker/name``, or ``None`` when the step failed as a whole
            (a timeout, or a commit that could not be written).
        cause: What went wrong, in words (the exception type and message, or the reason); also
            ``reason``, which stays a string when the error is raised through ``ray.get``: Ray's
            wrapper class sets its own ``cause`` (the exception the actor raised).
    """

    def __init__(self, step: int, kind: str, unit: str | None, cause: str) -> None:
        self.step = step
        self.kind = kind
        self.unit = unit
        self.cause = self.reason = cause
        where = f"unit {unit!r}" if unit else "the step"
        super().__init__(f"{kind} save of step {step} failed in {where}: {cause}")

    def __reduce__(self):  # keep pickling simple for Ray: rebuild from the constructor args
        return (type(self), (self.step, self.kind, self.unit, self.cause))


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A wait (for a weight version, for instance) ran out of time before what it waited for happened."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` so that its traceback shows it (PEP 678): for failures that
    happened beside the one raised and would otherwise be reported nowhere. Python 3.10 has no
    ``add_note``; there the note is kept in ``__notes__`` all the same (tracebacks do not show it)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]
