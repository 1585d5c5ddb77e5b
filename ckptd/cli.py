"""The ``ckptd`` command line: ``ckptd demo``, ``ckptd latest`` and ``ckptd verify``."""

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
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
