"""Public names of a package loaded on first use (PEP 562), so that a process that needs part of
ckptd pays only for that part: a monitor or relay actor never imports torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], sources: dict[str, str]) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of a package whose names ``sources`` maps to the
    modules that define them; ``namespace`` is the package's ``globals()``."""

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        namespace[name] = value  # later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
