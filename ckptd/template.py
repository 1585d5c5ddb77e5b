"""How step directories are named: the ``step_dir_template`` of a root."""

from __future__ import annotations

import re

from ckptd.errors import CheckpointConfigError
from ckptd.units import check_step

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
