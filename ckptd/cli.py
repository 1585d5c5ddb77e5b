"""The ``ckptd`` command line: ``ckptd demo`` and ``ckptd latest``."""

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
    args = parser.parse_args(argv)

    if args.command == "demo":
        from ckptd.workers.demo import run_demo

        root = args.root or f"ckptd-demo/{time.strftime('%Y%m%d-%H%M%S')}"
        latest_step = run_demo(root, steps=args.steps, ckpt_every=args.ckpt_every, workers=args.workers)
        return 0 if latest_step is not None or args.steps < args.ckpt_every else 1
    from ckptd.layout import latest_step as _latest

    print(f"checkpoint: {_latest(args.root)}")
    print(f"state_dict: {_latest(args.root, 'state_dict')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
