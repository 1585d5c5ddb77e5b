"""The ``ckptd`` command line: ``ckptd demo``, ``latest``, ``verify`` and ``retire``."""

from __future__ import annotations

import argparse
import sys
import time


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckptd", description="Asynchronous checkpointing on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on 2 Ray workers, saving through ckptd")
    demo.add_argument("--root", default=None,
                      help="checkpoint root (default: ./ckptd-demo/<timestamp>)")
    demo.add_argument("--steps", type=_positive, default=30)
    demo.add_argument("--ckpt-every", type=_positive, default=5)
    demo.add_argument("--workers", type=_positive, default=2)
    latest = sub.add_parser("latest", help="print the latest committed steps under a root")
    latest.add_argument("root")
    verify = sub.add_parser("verify", help="check every file of a committed step against its manifest")
    verify.add_argument("root")
    verify.add_argument("--step", type=int, default=None, help="the step (default: the newest checkpoint)")
    verify.add_argument("--kind", choices=["checkpoint", "state_dict"], default="checkpoint")
    retire = sub.add_parser("retire", help="remove the steps newer than --after, so a job resuming from an "
                                           "older step can save them again (stop the run's monitor first)")
    retire.add_argument("root")
    retire.add_argument("--after", type=int, required=True, help="keep steps up to and including this one")
    retire.add_argument("--mirror", default=None, help="the run's mirror URL, retired too")
    retire.add_argument("--yes", action="store_true", help="do it; without it, only list what would go")
    args = parser.parse_args(argv)

    if args.command == "retire":
        return _retire(args)

    if args.command == "demo":
        from ckptd.workers.demo import run_demo

        root = args.root or f"ckptd-demo/{time.strftime('%Y%m%d-%H%M%S')}"
        latest_step = run_demo(root, steps=args.steps, ckpt_every=args.ckpt_every, workers=args.workers)
        return 0 if latest_step is not None or args.steps < args.ckpt_every else 1
    if args.command == "verify":
        from ckptd.errors import CheckpointError
        from ckptd.verify import verify as _verify

        try:
            step = _verify(args.root, args.step, kind=args.kind)
        except CheckpointError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
        print(f"step {step.step}: {len(step.files)} files match the manifest ({step.path})")
        return 0
    from ckptd.layout import latest_step as _latest

    print(f"checkpoint: {_latest(args.root)}")
    print(f"state_dict: {_latest(args.root, 'state_dict')}")
    return 0


def _retire(args: argparse.Namespace) -> int:
    from ckptd.errors import CheckpointError
    from ckptd.layout import scan_steps
    from ckptd.retire import retire_steps
    from ckptd.storage import Storage

    try:
        newer = sorted(s for s in scan_steps(Storage(args.root)) if s > args.after)
        if not args.yes:
            print(f"would retire steps {newer} under {args.root}; run again with --yes")
            return 0
        retire_steps(args.root, args.after, mirror=args.mirror)
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"retired steps {newer}; latest checkpoint is now {_latest_of(args.root)}")
    return 0


def _latest_of(root: str) -> int | None:
    from ckptd.layout import latest_step

    return latest_step(root)


if __name__ == "__main__":
    sys.exit(main())
