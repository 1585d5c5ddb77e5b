"""``ckptd status RUN``: a live run, from its monitor, as tables a person reads (or ``--json``).

Exit codes: 0 the monitor answered, 1 no monitor of that run could be reached.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from ckptd.cli.cluster import add_cluster_options

EXAMPLES = """examples:
  ckptd status my-run                      the run's monitor, found in whichever namespace has it
  ckptd status my-run --namespace train    when several namespaces have a monitor of that name
  ckptd status my-run --json | jq .steps   the whole status, for scripts
  ckptd status my-run --address ray://head:10001
"""


def add_parser(sub: Any) -> None:
    status = sub.add_parser(
        "status", help="show a live run: trackers, steps in flight, failures, writer queue, mirror, subscribers",
        description="Connects to the Ray cluster and asks the run's monitor. Shows the trackers; the steps in "
                    "flight with their expected, started, finished and failed units per kind; failed steps and "
                    "why; the writer slots and their queue; the mirror's queue and lag; the weight subscribers "
                    "and the versions they serve; read leases; warnings. Exit 1 when no monitor of the run "
                    "can be reached.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    status.add_argument("run", nargs="?", default=None, help="the run name given to start_monitor")
    status.add_argument("--run", dest="run_opt", default=None, help=argparse.SUPPRESS)  # the 0.1 spelling
    add_cluster_options(status)
    status.add_argument("--json", action="store_true", help="print the whole status as JSON")


def run(args: argparse.Namespace) -> int:
    import ray

    from ckptd.cli.cluster import connected, monitor_of
    from ckptd.errors import CheckpointError

    name = args.run or args.run_opt or "default"
    try:
        with connected(args.address, args.namespace):
            status = ray.get(monitor_of(name, args.namespace).status.remote())
    except ConnectionError as e:
        print(f"FAILED: no Ray cluster at {args.address!r} ({e}); pass --address", file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(status.model_dump_json(indent=1))
        return 0
    console = Console(highlight=False, soft_wrap=True)  # soft wrap: a long line stays one line for grep
    console.print(*render(status, time.time()), sep="\n")
    return 0


def render(status: Any, now: float) -> list[Any]:
    """The status as printable rich objects (headline lines and tables), in reading order."""
    out: list[Any] = [
        f"[bold]run {status.run}[/]: root {status.root}, attempt {status.attempt}, "
        f"monitor on {status.storage.monitor}, up {_ago(now - status.started_at)}, {status.notifications} notifications"
        + (f"\n[red]FENCED[/]: {status.fenced}" if status.fenced else ""),
        f"latest checkpoint [bold]{_dash(status.trackers.checkpoint)}[/], "
        f"latest state dict [bold]{_dash(status.trackers.state_dict)}[/]",
    ]
    in_flight = [s for s in status.steps if s.state.value in ("pending", "committing")]
    if in_flight:
        t = _table("steps in flight", "step", "kind", "state", "expected", "started", "finished", "failed", "age")
        for s in sorted(in_flight, key=lambda s: (s.step, s.kind.value)):
            expected = str(s.expected) if s.monitored else f"{s.expected} (not registered)"
            t.add_row(str(s.step), s.kind.value, s.state.value, expected, str(len(s.started)), str(len(s.finished)),
                      str(len(s.failed)), _ago(now - s.first_seen))
        out.append(t)
    failed = [s for s in status.steps if s.state.value == "failed"]
    if failed:
        t = _table("failed steps", "step", "kind", "cause")
        for s in sorted(failed, key=lambda s: (s.step, s.kind.value)):
            causes = [f"{f.unit}: {f.cause}" for f in s.failed] or [s.reason or "?"]
            t.add_row(str(s.step), s.kind.value, "\n".join(causes))
        out.append(t)
    w = status.writers
    out.append(f"writer slots ({w.strategy.value}): {len(w.holders)} writing"
               + (f" ({', '.join(w.holders)})" if w.holders else "")
               + f", {len(w.waiting)} queued" + (f" ({', '.join(w.waiting)})" if w.waiting else ""))
    if status.mirror is not None:
        out.append(_mirror(status, now))
    if status.subscribers:
        t = _table("weight subscribers", "subscriber", "kind", "serving", "since", "lag steps", "lag s", "live",
                   "pins")
        for s in status.subscribers:
            t.add_row(s.name, s.kind.value, _dash(s.serving),
                      "-" if s.serving_since is None else f"{_ago(now - s.serving_since)} ago", _dash(s.lag_steps),
                      "-" if s.lag_s is None else f"{s.lag_s:.2f}", "yes" if s.live else "no",
                      ", ".join(map(str, s.pins)) or "-")
        out.append(t)
    if status.pins:
        out.append("read leases: " + ", ".join(f"step {p.step} by {p.subscriber} ({p.expires_in_s:.0f}s left)"
                                               for p in status.pins))
    r = status.retention
    out.append(f"retention: {r.passes} passes, deleted steps {r.deleted_steps[-10:] or '-'}"
               + (f", [red]{len(r.errors)} errors[/] (last: {r.errors[-1]})" if r.errors else ""))
    out += [f"[yellow]warning[/]: {w}" for w in status.warnings]
    return out


def _mirror(status: Any, now: float) -> Table:
    from ckptd.monitor.gauges import mirror_lag

    m = status.mirror
    lag_steps, lag_s = mirror_lag(status, now)
    t = _table(f"mirror {m.url}: latest checkpoint {_dash(m.trackers.checkpoint)}, state dict "
               f"{_dash(m.trackers.state_dict)}; lag {_dash(lag_steps)} steps, {lag_s:.1f} s; queue {m.queued or '-'}"
               f"; {_size(m.uploaded_bytes)} uploaded, {m.retried_requests} retried requests",
               "step", "state", "attempts", "size", "error")
    for s in m.steps[-10:]:
        t.add_row(str(s.step), s.state.value, str(s.attempts), _size(s.bytes), s.error or "")
    if m.start_error:
        t.caption = f"[red]could not start[/]: {m.start_error}"
    return t


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False)
    for c in columns:
        t.add_column(c, justify="left" if c in ("kind", "state", "cause", "error", "subscriber", "pins") else "right")
    return t


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _size(n: int) -> str:
    from ckptd.cli.steps import size

    return size(n)
