"""Drawing a :class:`~ckptd.timeline.layout.Layout` as a PNG with matplotlib (``ckptd[viz]``).

Uses matplotlib's object API with the Agg canvas, never pyplot, so it changes no global state of
the caller's process (backend, open figures).
"""

from __future__ import annotations

from ckptd.errors import CheckpointError
from ckptd.timeline.layout import Layout

COLORS = {
    "checkpoint": "#3b6fb6",
    "state_dict": "#4aa35a",
    "blocked": "#e07b24",
    "commit": "#7b4bb0",
    "mirror": "#2a9d9a",
    "failed": "#d62728",
}
LEGEND = {
    "checkpoint": "checkpoint unit",
    "state_dict": "state-dict unit",
    "blocked": "training thread blocked",
    "commit": "commit",
    "mirror": "mirror upload",
    "failed": "failed",
}
_ROW_IN = 0.42  # inches per row
_MAX_STEP_LABELS = 40


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise CheckpointError(
            "drawing a PNG timeline needs matplotlib: pip install 'ckptd[viz]' (or write --out FILE.html, "
            "which needs nothing)"
        ) from e
    return Figure, FigureCanvasAgg, Patch, Line2D


def _text_width(text: str, span: float, points: float = 7) -> float:
    """Roughly how much of the x axis ``text`` covers (the axes are about 11 inches wide)."""
    return span * (len(text) + 1) * points * 0.6 / 72 / 11


def draw_png(layout: Layout, path: str, *, width_in: float = 14.0, dpi: int = 110) -> None:
    """Write ``layout`` to ``path`` as a PNG.

    Raises:
        CheckpointError: matplotlib is not installed, or the layout has no rows.
    """
    Figure, FigureCanvasAgg, Patch, Line2D = _matplotlib()
    if not layout.rows:
        raise CheckpointError(f"run {layout.run!r} has no timeline events to draw")
    rows = layout.rows
    n = len(rows)
    fig = Figure(figsize=(width_in, 1.9 + _ROW_IN * n), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    span = max(layout.duration, 1e-3)
    min_w = span * 0.0025  # a 1 ms commit in a 60 s run must still show; the tooltips have the truth
    for i, row in enumerate(rows):
        y = n - 1 - i  # first row on top
        for bar in row.bars:
            color = COLORS.get(bar.color, "#888888")
            if bar.ready is not None and bar.ready > bar.start:
                # Waiting for admission or a writer slot: a thin line before the bar.
                ax.broken_barh([(bar.start, bar.ready - bar.start)], (y - 0.06, 0.12), color=color, alpha=0.45)
                start = bar.ready
            else:
                start = bar.start
            ax.broken_barh([(start, max(bar.end - start, min_w))], (y - 0.32, 0.64), color=color,
                           edgecolor="white", linewidth=0.4)
        if row.lane in ("commit", "mirror"):
            free = -span  # where the last label ended: labels that would overlap it are left out
            for bar in row.bars:  # the step number: inside a wide bar, else just after it
                width = max(bar.end - bar.start, min_w)
                text_w = _text_width(bar.label, span)
                inside = width > text_w * 1.3
                x = bar.start + width / 2 - text_w / 2 if inside else bar.start + width + span * 0.002
                if x < free:
                    continue
                free = x + text_w
                ax.text(x, y, bar.label, ha="left", va="center", fontsize=7, color="white" if inside else "#333333")
    # Separate the workers' groups from each other and from the monitor's rows.
    for i in range(1, n):
        if rows[i].worker != rows[i - 1].worker:
            ax.axhline(n - i - 0.5, color="#999999", linewidth=0.8)
    ax.set_yticks(range(n))
    ax.set_yticklabels([r.title for r in reversed(rows)], fontsize=9)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlim(-span * 0.01, span * 1.01)
    ax.set_xlabel("seconds since the run's first event")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    marks = layout.steps
    every = max(1, -(-len(marks) // _MAX_STEP_LABELS))
    for m in marks:
        ax.axvline(m.start, color="#bbbbbb", linewidth=0.6, linestyle=":", zorder=0)
    labelled, free = [], -span
    for m in marks[::every]:  # left to right, leaving out labels that would overlap the previous one
        if m.start - _text_width(str(m.step), span, 8) / 2 >= free:
            labelled.append(m)
            free = m.start + _text_width(str(m.step), span, 8) / 2
    top = ax.secondary_xaxis("top")
    top.set_xticks([m.start for m in labelled])
    top.set_xticklabels([str(m.step) for m in labelled], fontsize=8)
    top.set_xlabel("step (where its first save started)", fontsize=9)
    used = {b.color for r in rows for b in r.bars}
    handles = [Patch(color=COLORS[k], label=LEGEND[k]) for k in COLORS if k in used]
    if any(b.ready is not None and b.ready > b.start for r in rows for b in r.bars):
        handles.append(Line2D([], [], color="#777777", alpha=0.6, linewidth=3,
                              label="unit waiting to be admitted (or for a writer slot)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    title = f"ckptd timeline, run {layout.run}" if layout.run else "ckptd timeline"
    ax.set_title(f"{title}: {len(marks)} steps in {layout.duration:.1f} s", fontsize=11, pad=28)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    fig.savefig(path, format="png")
