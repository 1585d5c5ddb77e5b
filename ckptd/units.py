"""Save units and the validation of what identifies them."""

from __future__ import annotations

import numbers
import re
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


_FIELD_RE = re.compile(r"\{([^{}]*)\}")
_NUMBER = r"(0|[1-9][0-9]*)"  # canonical integers only: "global_step_010" is not step 10


class StepDirTemplate:
    """How a step directory is named: a template with ``{step}`` and optionally ``{epoch}``.

    ``global_step_{step}`` (verl, the default), ``epoch-{epoch}_step-{step}`` (ColossalChat) and
    ``step_{step}`` (open-instruct) are the usual ones. Parsing accepts canonical integers only,
    and callers sort by the parsed step, never by the name, so step 9 comes before step 10.

    Raises:
        CheckpointConfigError: the template has no ``{step}``, another field, a format spec, a
            path separator, or two fields with nothing between them.
    """

    def __init__(self, template: str) -> None:
        if not isinstance(template, str):
            raise CheckpointConfigError(f"step_dir_template must be a string, got {template!r}")
        fields = _FIELD_RE.findall(template)
        literals = _FIELD_RE.split(template)[::2]
        problem = None
        if any(":" in f or "!" in f for f in fields):
            problem = "format specs such as {step:06d} are not supported"
        elif "step" not in fields:
            problem = "it has no {step} field"
        elif any(f not in ("step", "epoch") for f in fields) or len(set(fields)) != len(fields):
            problem = f"its fields are {fields}; only {{step}} and {{epoch}}, once each, are allowed"
        elif any(c in template for c in "/\\") or template.startswith("."):
            problem = "it contains a path separator or starts with '.'"
        elif any(lit == "" for lit in literals[1:-1]) or "{" in "".join(literals) or "}" in "".join(literals):
            problem = "two fields must be separated by literal text, and braces must pair"
        if problem:
            raise CheckpointConfigError(
                f"invalid step_dir_template {template!r}: {problem}. Use for example "
                "'global_step_{step}', 'epoch-{epoch}_step-{step}' or 'step_{step}'"
            )
        self.template = template
        self.needs_epoch = "epoch" in fields
        pattern = "".join(
            re.escape(part) if i % 2 == 0 else f"(?P<{part}>{_NUMBER})"
            for i, part in enumerate(_FIELD_RE.split(template))
        )
        self._re = re.compile(f"^{pattern}$")

    def name(self, step: int, epoch: int | None = None) -> str:
        """The directory name of ``step`` (``epoch`` is required by epoch templates only)."""
        step = check_step(step)
        if self.needs_epoch:
            if epoch is None:
                raise CheckpointConfigError(
                    f"the step directory template {self.template!r} needs the epoch; pass epoch="
                )
            return self.template.format(step=step, epoch=check_step(epoch, "epoch"))
        return self.template.format(step=step)

    def parse(self, name: str) -> int | None:
        """The step of a directory name, or None if the name does not follow the template."""
        m = self._re.match(name)
        return int(m.group("step")) if m else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepDirTemplate) and other.template == self.template

    def __hash__(self) -> int:
        return hash(self.template)

    def __repr__(self) -> str:
        return f"StepDirTemplate({self.template!r})"
