"""``ckptd timeline``: a picture of a run's saves, commits and uploads over time.

:func:`spans_of_root` and :func:`spans_of_run` fetch the events (persisted under a root, or
from a live monitor), :func:`build_layout` places them, and :func:`render` writes a PNG
(matplotlib, ``ckptd[viz]``) or a self-contained HTML page.
"""

from ckptd.timeline.layout import Bar, Layout, Row, StepMark, StepNumbers, build_layout
from ckptd.timeline.source import newest_attempt, render, spans_of_root, spans_of_run

__all__ = ["Bar", "Layout", "Row", "StepMark", "StepNumbers", "build_layout", "newest_attempt", "render",
           "spans_of_root", "spans_of_run"]
