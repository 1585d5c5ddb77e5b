"""The ``ckptd`` command line: ``demo``, ``status``, ``latest``, ``ls``, ``show``, ``verify``, ``gc``,
``export-hf``, ``retire`` and ``timeline``."""

from __future__ import annotations

import argparse
import sys
import time


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (every subcommand and option)."""
    from ckptd import __version__
    from ckptd.cli import gc, status, steps, timeline

    parser = argparse.ArgumentParser(
        prog="ckptd", description="Asynchronous checkpointing on Ray. `ckptd COMMAND --help` explains each command.",
        epilog="examples:\n  ckptd demo\n  ckptd status my-run\n  ckptd ls ./ckpt\n  ckptd show ./ckpt 300\n"
               "  ckptd verify s3://bucket/run --step 300\n  ckptd gc ./ckpt --dry-run\n"
               "  ckptd export-hf ./ckpt 300 ./hf-300\n\n"
               "Storage credentials come from the environment (e.g. AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny Llama with FSDP2 on 2 Ray actors (gloo), saving through "
                                       "ckptd; then resume it on 3 ranks, load it with DCP, export it to HF",
                          epilog="examples: ckptd demo --steps 10 --root ./demo;  ckptd demo --rl")
    demo.add_argument("--root", default=None,
                      help="checkpoint root (default: ./ckptd-demo/<timestamp>)")
    demo.add_argument("--steps", type=_positive, default=20)
    demo.add_argument("--ckpt-every", type=_positive, default=5)
    demo.add_argument("--workers", type=_positive, default=2, help="ranks (the global batch of 12 must divide)")
    demo.add_argument("--resume-on", type=_positive, default=3, help="ranks to resume the last checkpoint on")
    demo.add_argument("--address", default=None,
                      help="run on this Ray cluster (auto or host:port) instead of a local one; ranks spread over "
                           "its nodes, and the root must be storage every node sees")
    demo.add_argument("--mirror", default=None, help="also upload committed steps to this URL (the mirror tier)")
    demo.add_argument("--rl", action="store_true",
                      help="the RL demo: a trainer publishes weights every step, 2 rollout actors follow them")
    status.add_parser(sub)
    steps.add_parsers(sub, "")
    gc.add_parser(sub)
    timeline.add_parser(sub)
    verify = sub.add_parser("verify", help="check every file of a committed step against its manifest",
                            description="Reads every file the step's manifests list and checks its size and "
                                        "CRC-32. Exit 0 when all match, 1 when a file is missing or differs "
                                        "(each is named) or the step is not committed.",
                            epilog="example: ckptd verify s3://bucket/run --step 300")
    verify.add_argument("root")
    verify.add_argument("--step", type=int, default=None, help="the step (default: the newest checkpoint)")
    verify.add_argument("--kind", choices=["checkpoint", "state_dict"], default="checkpoint")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")
    retire = sub.add_parser("retire", help="remove the steps newer than --after, so a job resuming from an "
                                           "older step can save them again (stop the run's monitor first)",
                            epilog="example: ckptd retire ./ckpt --after 150 --yes")
    retire.add_argument("root")
    retire.add_argument("--after", type=int, required=True, help="keep steps up to and including this one")
    retire.add_argument("--mirror", default=None, help="the run's mirror URL, retired too")
    retire.add_argument("--yes", action="store_true", help="do it; without it, only list what would go")
    retire.add_argument("--address", default="auto",
                        help="the Ray cluster where the root's monitor would live: refused while it is live "
                             "(default: auto; none found: nothing to check)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from ckptd.storage import credentials_missing, no_credentials_error

    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except Exception as e:  # what a subcommand did not say itself: ckptd's errors, a storage client's
        from ckptd.errors import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"FAILED: {e}", file=sys.stderr)
        elif credentials_missing(e):
            print(f"FAILED: {no_credentials_error(getattr(args, 'root', None), e)}", file=sys.stderr)
        else:
            raise
        return 1


def _run(args: argparse.Namespace) -> int:
    from ckptd.cli import gc, status, steps, timeline

    if args.command in ("latest", "ls", "show", "export-hf"):
        return steps.run(args)
    if args.command == "timeline":
        return timeline.run(args)
    if args.command == "retire":
        return _retire(args)
    if args.command == "status":
        return status.run(args)
    if args.command == "gc":
        return gc.run(args)

    if args.command == "demo":
        from ckptd.workers.demo import run_demo

        root = args.root or f"ckptd-demo/{time.strftime('%Y%m%d-%H%M%S')}"
        if args.rl:
            from ckptd.rollout.demo import run_rl_demo

            served = run_rl_demo(root, steps=args.steps, ckpt_every=args.ckpt_every, ranks=args.workers)
            return 0 if served == args.steps else 1
        from ray.exceptions import RayTaskError

        from ckptd.errors import CheckpointError

        try:
            latest_step = run_demo(root, steps=args.steps, ckpt_every=args.ckpt_every, workers=args.workers,
                                   resume_on=args.resume_on, address=args.address, mirror=args.mirror)
        except CheckpointError as e:
            print(f"FAILED: {e.cause if isinstance(e, RayTaskError) else e}", file=sys.stderr)  # a rank's: its own
            return 1
        return 0 if latest_step is not None or args.steps < args.ckpt_every else 1
    if args.command == "verify":
        return _verify(args)
    raise AssertionError(f"unhandled command {args.command}")


def _retire(args: argparse.Namespace) -> int:
    from ckptd.cli.cluster import refuse_live_root
    from ckptd.errors import CheckpointError
    from ckptd.retire import retire_steps, steps_to_retire

    try:
        newer = steps_to_retire(args.root, args.after)  # checks the arguments first, as --yes does
        refuse_live_root(args.root, args.address, "retiring steps")
        if not args.yes:
            print(f"would retire steps {newer} under {args.root}; run again with --yes")
            return 0
        retire_steps(args.root, args.after, mirror=args.mirror)
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"retired steps {newer}; latest checkpoint is now {_latest_of(args.root)}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from ckptd.cli.progress import bar
    from ckptd.errors import CheckpointError
    from ckptd.layout import parse_kind
    from ckptd.storage import Storage
    from ckptd.verify import open_step, verify

    try:
        committed = open_step(Storage(args.root), args.step, parse_kind(args.kind) if args.step is None else None)
        if committed is None:
            print(f"FAILED: no committed {args.kind} under {args.root}", file=sys.stderr)
            return 1
        with bar(bytes_=True, quiet=args.quiet) as progress:
            task = progress.add_task(f"checking step {committed.step}",
                                     total=sum(f.size for f in committed.files.values()))
            step = verify(args.root, committed.step, progress=lambda n: progress.advance(task, n))
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"step {step.step}: {len(step.files)} files match the manifest ({step.path})")
    return 0


def _latest_of(root: str) -> int | None:
    from ckptd.layout import latest_step

    return latest_step(root)


if __name__ == "__main__":
    sys.exit(main())
