"""Drawing a :class:`~ckptd.timeline.layout.Layout` as one self-contained HTML file.

The picture is inline SVG (no script, no CDN, nothing fetched): each bar carries a ``<title>``,
which browsers show as a tooltip with the span's numbers. A table of per-step figures follows.
"""

from __future__ import annotations

import math
import time
from html import escape

from ckptd.timeline.layout import Layout
from ckptd.timeline.png import COLORS, LEGEND

_W, _LEFT, _RIGHT, _ROW, _TOP = 1200, 250, 20, 26, 56


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _svg(layout: Layout) -> str:
    rows, n = layout.rows, len(layout.rows)
    span = max(layout.duration, 1e-3)
    plot_w = _W - _LEFT - _RIGHT
    height = _TOP + n * _ROW + 40

    def x(t: float) -> float:
        return _LEFT + plot_w * t / span

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
           f'font-family="sans-serif" font-size="11">']
    tick = _nice_step(span)
    t = 0.0
    while t <= span + 1e-9:
        out.append(f'<line x1="{x(t):.1f}" y1="{_TOP}" x2="{x(t):.1f}" y2="{_TOP + n * _ROW}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x(t):.1f}" y="{_TOP + n * _ROW + 14}" text-anchor="middle">{t:g}</text>')
        t += tick
    out.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_TOP + n * _ROW + 32}" text-anchor="middle">'
               "seconds since the run's first event</text>")
    every = max(1, -(-len(layout.steps) // 40))
    for m in layout.steps[::every]:
        out.append(f'<line x1="{x(m.start):.1f}" y1="{_TOP - 4}" x2="{x(m.start):.1f}" y2="{_TOP + n * _ROW}" '
                   'stroke="#bbbbbb" stroke-dasharray="2,3"/>')
        out.append(f'<text x="{x(m.start):.1f}" y="{_TOP - 8}" text-anchor="middle" class="step">{m.step}</text>')
    out.append(f'<text x="{_LEFT}" y="16" font-size="12">step (where its first save started)</text>')
    min_w = 2.0  # pixels: a 1 ms commit must still show; its tooltip has the truth
    for i, row in enumerate(rows):
        y = _TOP + i * _ROW
        if i and row.worker != rows[i - 1].worker:
            out.append(f'<line x1="0" y1="{y}" x2="{_W}" y2="{y}" stroke="#999999"/>')
        out.append(f'<text x="{_LEFT - 8}" y="{y + _ROW / 2 + 4}" text-anchor="end">{escape(row.title)}</text>')
        out.append(f'<g class="row" data-row="{escape(row.key)}">')
        for bar in row.bars:
            color = COLORS.get(bar.color, "#888888")
            tip = escape(bar.tooltip)
            start = bar.start
            if bar.ready is not None and bar.ready > bar.start:
                out.append(f'<rect x="{x(bar.start):.1f}" y="{y + _ROW / 2 - 2}" '
                           f'width="{x(bar.ready) - x(bar.start):.1f}" height="4" '
                           f'fill="{color}" opacity="0.45"><title>{tip}</title></rect>')
                start = bar.ready
            w = max(x(bar.end) - x(start), min_w)
            out.append(f'<rect class="span" data-step="{bar.step}" data-kind="{bar.color}" x="{x(start):.1f}" '
                       f'y="{y + 4}" width="{w:.1f}" height="{_ROW - 8}" fill="{color}"><title>{tip}</title></rect>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _table(layout: Layout) -> str:
    order = list(dict.fromkeys(r.worker for r in layout.rows if r.worker is not None))
    workers = [w for w in order if any(w in r.blocked_ms for r in layout.table)]
    head = ["step", "committed", "units", "failed", *[f"{escape(w)} blocked ms" for w in workers],
            "saving s", "commit ms", "committed at s", "mirror upload s", "error"]
    lines = ["<table>", "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in layout.table:
        cells = [str(r.step), escape(r.kinds), str(r.units), str(r.failed),
                 *[num(r.blocked_ms.get(w), ".1f") for w in workers],
                 num(r.saving_s, ".3f"), num(r.commit_ms, ".1f"), num(r.committed_at_s, ".3f"),
                 num(r.mirror_s, ".3f"), escape(r.error or "")]
        lines.append(f'<tr data-step="{r.step}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def render_html(layout: Layout) -> str:
    """The whole page, as a string."""
    used = {b.color for r in layout.rows for b in r.bars}
    legend = " ".join(f'<span class="key"><i style="background:{COLORS[k]}"></i>{LEGEND[k]}</span>'
                      for k in COLORS if k in used)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(layout.t0)) if layout.rows else "-"
    title = f"ckptd timeline, run {escape(layout.run)}" if layout.run else "ckptd timeline"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; color: #222; }}
table {{ border-collapse: collapse; font-size: 12px; margin-top: 12px; }}
th, td {{ border: 1px solid #ccc; padding: 2px 6px; text-align: right; }}
th {{ background: #f3f3f3; }}
.key {{ margin-right: 14px; font-size: 12px; }}
.key i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: middle; }}
rect.span:hover {{ stroke: #000; stroke-width: 1; }}
</style></head><body>
<h2>{title}</h2>
<p>{len(layout.steps)} steps in {layout.duration:.1f} s, from {started}. Hover over a bar for its numbers;
a thin line before a unit's bar is the time it waited to be admitted (or for a writer slot).</p>
<p>{legend}</p>
{_svg(layout) if layout.rows else "<p>No events recorded.</p>"}
<h3>Per step</h3>
{_table(layout)}
</body></html>
"""


def write_html(layout: Layout, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(layout))
