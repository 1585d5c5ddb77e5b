"""``ckptd timeline RUN_OR_ROOT --out FILE.png|.html``: draw a run's saves, commits and uploads.

A run name asks the run's live monitor (over Ray, like ``ckptd status``); a root path or URL reads
what the monitor persisted under ``root/.ckptd/events/`` (no Ray: the run may be over). Exit
codes: 0 drawn, 1 nothing to draw or no such run, 2 bad arguments (argparse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ckptd.cli.cluster import add_cluster_options


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "timeline", help="draw a run's timeline: units per worker, blocked time, commits, mirror uploads",
        description="Draws, per step, the time each worker's training thread was blocked in save calls, each "
                    "save unit's span per worker, the monitor's commit and the mirror upload. RUN_OR_ROOT is a "
                    "live run's name (its monitor is asked) or a checkpoint root (the events the monitor "
                    "persisted there are read, so a finished run can be drawn).",
        epilog="examples: ckptd timeline my-run --out t.png; ckptd timeline s3://bucket/run --out t.html")
    p.add_argument("source", metavar="RUN_OR_ROOT", help="a live run's name, or a root path or URL")
    p.add_argument("--out", required=True, help="FILE.png (needs ckptd[viz]) or FILE.html (self-contained)")
    p.add_argument("--run", default=None, help="with a root: the run to draw, if several ran there")
    p.add_argument("--root", action="store_true", help="treat RUN_OR_ROOT as a root even if no such path exists "
                                                       "here (a relative path that looks like a run name)")
    p.add_argument("--attempt", default="newest",
                   help="the attempt (job) to draw when several jobs of the run used the root: a number, 'newest' "
                        "(the default) or 'all'")
    p.add_argument("--storage-options", default=None, type=json.loads, help="with a root: fsspec options as JSON")
    add_cluster_options(p, "with a run: ")


def _is_root(args: argparse.Namespace) -> bool:
    return args.root or "://" in args.source or os.path.exists(args.source)


def run(args: argparse.Namespace) -> int:
    from ckptd.errors import CheckpointError
    from ckptd.timeline import newest_attempt, render, spans_of_root

    try:
        if _is_root(args):
            run_name, spans = spans_of_root(args.source, args.run, args.storage_options)
        elif "/" in args.source or args.source.startswith("."):  # a path, as run names cannot be
            print(f"FAILED: {args.source}: no such checkpoint root (a path that does not exist)", file=sys.stderr)
            return 1
        else:
            run_name, spans = _live(args)
        if args.attempt == "newest":
            spans = newest_attempt(spans)
        elif args.attempt != "all":
            spans = [s for s in spans if str(s.attempt) == args.attempt]
        layout = render(spans, args.out, run_name)
    except (CheckpointError, ConnectionError) as e:  # ConnectionError: no Ray cluster at --address
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    units = sum(len(r.bars) for r in layout.rows if r.lane == "unit")
    print(f"{args.out}: run {run_name}, {len(layout.steps)} steps, {units} units, {layout.duration:.1f} s")
    return 0


def _live(args: argparse.Namespace) -> tuple[str, list]:
    from ckptd.cli.cluster import connected, monitor_of
    from ckptd.timeline import spans_of_run

    with connected(args.address, args.namespace):
        return spans_of_run(monitor_of(args.source, args.namespace))
