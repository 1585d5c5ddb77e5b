"""Where a timeline's events come from: a live monitor, or what one persisted under a root."""

from __future__ import annotations

from typing import Any

from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.monitor.event_store import read_events, runs_with_events
from ckptd.monitor.events import Span
from ckptd.storage import Storage
from ckptd.timeline.layout import Layout, build_layout


def spans_of_root(root: str, run: str | None = None, storage_options: dict | None = None) -> tuple[str, list[Span]]:
    """The persisted spans of ``run`` under ``root`` (no Ray needed: the run may be over).

    Args:
        root: The checkpoint root (path or fsspec URL).
        run: The run; may be omitted when the root holds the events of one run only.
        storage_options: fsspec options for ``root``.

    Returns:
        ``(run, spans)``.

    Raises:
        CheckpointConfigError: no run has events under the root, ``run`` has none, or several
            runs have and ``run`` was not given (the message lists them).
    """
    storage = Storage(root, storage_options)
    runs = runs_with_events(storage)
    if run is None:
        if not runs:
            raise CheckpointConfigError(
                f"no timeline events under {storage.url}: is it the root a monitor ran on? (events are kept under "
                f"{storage.url}/.ckptd/events/<run>/, written every timeline_flush_s seconds)")
        if len(runs) > 1:
            raise CheckpointConfigError(f"several runs have timeline events under {storage.url}: {runs}; pick one "
                                        "with --run")
        run = runs[0]
    elif run not in runs:
        raise CheckpointConfigError(f"run {run!r} has no timeline events under {storage.url}; runs that have: "
                                    f"{runs or 'none'}")
    return run, read_events(storage, run)


def spans_of_run(monitor: Any) -> tuple[str, list[Span]]:
    """The spans a live monitor holds in memory (which include what earlier monitors of the run
    persisted). ``monitor`` is its actor handle (:func:`ckptd.get_monitor`)."""
    import ray

    answer = ray.get(monitor.timeline.remote())
    return answer["run"], [Span.from_dict(d) for d in answer["spans"]]


def newest_attempt(spans: list[Span]) -> list[Span]:
    """The spans of the newest attempt (job) among ``spans``: a new job of the same run on the same
    root starts a new attempt, and drawing both would stretch the x axis over the pause between
    them. A monitor restarted within a job keeps its attempt."""
    newest = max((s.attempt for s in spans), default=0)
    return [s for s in spans if s.attempt == newest]


def render(spans: list[Span], out: str, run: str = "") -> Layout:
    """Draw ``spans`` into ``out``: a ``.png`` (needs matplotlib) or an ``.html`` page.

    Returns:
        The layout drawn.

    Raises:
        CheckpointConfigError: ``out`` is neither ``.png`` nor ``.html``.
        CheckpointError: nothing to draw, or matplotlib is missing for a PNG.
    """
    lower = out.lower()
    if not lower.endswith((".png", ".html", ".htm")):
        raise CheckpointConfigError(f"--out must end in .png or .html, got {out!r}")
    layout = build_layout(spans, run)
    if not layout.rows:
        raise CheckpointError(f"run {run!r} has no timeline events to draw yet")
    if lower.endswith(".png"):
        from ckptd.timeline.png import draw_png

        draw_png(layout, out)
    else:
        from ckptd.timeline.html import write_html

        write_html(layout, out)
    return layout
