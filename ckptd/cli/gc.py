"""``ckptd gc ROOT``: remove what a root no longer needs (see :mod:`ckptd.gc`).

Exit codes: 0 done (or nothing to do), 1 refused (a live monitor owns the root) or a removal
failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXAMPLES = """examples:
  ckptd gc ./ckpt --dry-run                       what would go, and why
  ckptd gc ./ckpt                                 remove leftovers idle for 10 minutes
  ckptd gc ./ckpt --min-idle 0                    ... however recent (no job may be using the root)
  ckptd gc s3://bucket/run --keep-checkpoints 3 --keep-state-dicts 3 --mirror s3://backup/run
                                                  also committed steps past 3 checkpoints and 3
                                                  state dicts, but only those the mirror holds
"""


def add_parser(sub: Any) -> None:
    gc = sub.add_parser(
        "gc", help="remove leftovers (saves that never committed, temp files, old attempts' records) and, "
                   "with --keep-*, committed steps past a retention policy",
        description="Removes step directories without a manifest, files a state-dict step's manifest does not "
                    "list, temp files of unfinished writes, the retention trash, probe files and the ledger "
                    "records of superseded attempts, once each has been idle for --min-idle seconds. A step "
                    "directory the root held before ckptd first used it (another tool's) is never removed. Committed "
                    "steps are never removed unless a --keep-* option asks for it; then the monitor's retention "
                    "rules apply, and tracker targets, leased steps and (with --mirror) steps the mirror does "
                    "not hold yet are kept. Refused while the root's monitor is live in the Ray cluster "
                    "(its own retention does this).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    gc.add_argument("root")
    gc.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    gc.add_argument("--min-idle", type=float, default=600.0, metavar="SECONDS",
                    help="leave leftovers that changed more recently than this (default: 600)")
    gc.add_argument("--keep-checkpoints", type=count, default=None, metavar="N",
                    help="also remove committed full checkpoints past the newest N")
    gc.add_argument("--keep-state-dicts", type=count, default=None, metavar="N",
                    help="also remove committed steps past the newest N state dicts (a checkpoint counts)")
    gc.add_argument("--keep-every", type=count, default=None, metavar="N",
                    help="with --keep-*, keep every step that is a multiple of N")
    gc.add_argument("--mirror", default=None, help="the run's mirror: committed steps it lacks are kept")
    gc.add_argument("--address", default="auto",
                    help="the Ray cluster where the root's monitor would live (default: auto; none found: "
                         "only --min-idle protects a running job)")
    gc.add_argument("--json", action="store_true", help="print what was (or would be) removed as JSON")
    gc.add_argument("--quiet", action="store_true", help="no progress bar")


def count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value} (leave the option out to keep all)")
    return value


def run(args: argparse.Namespace) -> int:
    from ckptd.cli.cluster import refuse_live_root
    from ckptd.cli.progress import bar
    from ckptd.cli.steps import size
    from ckptd.errors import CheckpointError
    from ckptd.gc import plan_gc, run_gc
    from ckptd.monitor.retention import RetentionPolicy

    if args.min_idle < 0:
        print("FAILED: --min-idle must be >= 0", file=sys.stderr)
        return 2
    policy = None
    if args.keep_checkpoints and not args.keep_state_dicts:
        print("FAILED: --keep-checkpoints alone removes nothing: a full checkpoint counts as a state dict, and "
              "without --keep-state-dicts every state dict is kept. Give --keep-state-dicts N too", file=sys.stderr)
        return 2
    if args.keep_checkpoints or args.keep_state_dicts:
        policy = RetentionPolicy(args.keep_checkpoints, args.keep_state_dicts, args.keep_every)
    elif args.keep_every:
        print("FAILED: --keep-every only narrows --keep-checkpoints / --keep-state-dicts; give one of them",
              file=sys.stderr)
        return 2
    try:
        refuse_live_root(args.root, args.address, "collecting garbage")
        plan = plan_gc(args.root, policy=policy, min_idle_s=args.min_idle, mirror=args.mirror)
        removed = plan.items
        if not args.dry_run and plan.items:
            with bar(bytes_=True, quiet=args.quiet or args.json) as progress:
                task = progress.add_task("removing", total=plan.bytes or None)
                removed = run_gc(plan, progress=lambda g: progress.advance(task, g.bytes))
    except (CheckpointError, OSError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        print(json.dumps({"root": plan.root, "dry_run": args.dry_run, "bytes": sum(g.bytes for g in removed),
                          verb.replace(" ", "_"): [vars(g) for g in removed], "not_idle_yet": plan.kept_busy,
                          "not_ckptd": plan.not_ours},
                         indent=1))
        return 0
    for g in removed:
        print(f"{verb}: {g.path}  ({size(g.bytes)}; {g.reason})")
    for rel in plan.kept_busy:
        print(f"kept (changed within {args.min_idle:.0f}s, a save may still be writing it): {rel}")
    for rel in plan.not_ours:
        print(f"kept (there before ckptd first used the root: another tool's): {rel}")
    print(f"{verb} {len(removed)} items, {size(sum(g.bytes for g in removed))} under {plan.root}"
          + ("; run again without --dry-run to remove them" if args.dry_run and removed else ""))
    return 0
