"""The ``ckptd`` command line: ``demo``, ``status``, ``latest``, ``ls``, ``show``, ``verify``,
``export-hf`` and ``retire``."""

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
    from ckptd import __version__
    from ckptd.cli import steps

    parser = argparse.ArgumentParser(prog="ckptd", description="Asynchronous checkpointing on Ray.")
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny Llama with FSDP2 on 2 Ray actors (gloo), saving through "
                                       "ckptd; then resume it on 3 ranks, load it with DCP, export it to HF")
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
    status = sub.add_parser("status", help="show a live run's monitor: trackers, steps in flight, subscribers "
                                           "and the versions they serve, read leases")
    status.add_argument("--run", default="default", help="the run name given to start_monitor")
    status.add_argument("--namespace", default=None, help="the monitor's Ray namespace")
    status.add_argument("--address", default="auto", help="the Ray cluster to connect to (default: auto)")
    status.add_argument("--json", action="store_true", help="print the whole status as JSON")
    steps.add_parsers(sub, "")
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

    if args.command in ("latest", "ls", "show", "export-hf"):
        return steps.run(args)
    if args.command == "retire":
        return _retire(args)
    if args.command == "status":
        return _status(args)

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
        from ckptd.errors import CheckpointError
        from ckptd.verify import verify as _verify

        try:
            step = _verify(args.root, args.step, kind=args.kind)
        except CheckpointError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
        print(f"step {step.step}: {len(step.files)} files match the manifest ({step.path})")
        return 0
    raise AssertionError(f"unhandled command {args.command}")


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


def _status(args: argparse.Namespace) -> int:
    import logging

    import ray

    from ckptd.errors import CheckpointError
    from ckptd.monitor import get_monitor

    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False, logging_level=logging.ERROR,
             configure_logging=False)
    try:
        status = ray.get(get_monitor(args.run, _namespace_of(args.run, args.namespace)).status.remote())
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    if args.json:
        print(status.model_dump_json(indent=1))
        return 0
    print(_format_status(status))
    return 0


def _namespace_of(run: str, namespace: str | None) -> str | None:
    """The namespace to find the run's monitor in: the one given, or the only one that has it (a
    job that called ray.init() without a namespace runs in an anonymous one)."""
    if namespace is not None:
        return namespace
    import ray

    from ckptd.protocol import actor_name

    found = sorted({a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"] == actor_name(run)})
    if len(found) > 1:
        raise SystemExit(f"the monitor of run {run!r} exists in several namespaces {found}; pass --namespace")
    return found[0] if found else None


def _format_status(status) -> str:
    now = time.time()
    lines = [f"run {status.run}: root {status.root}, attempt {status.attempt}"
             + (f", FENCED: {status.fenced}" if status.fenced else ""),
             f"latest checkpoint {status.trackers.checkpoint}, latest state dict {status.trackers.state_dict}"]
    in_flight = [s for s in status.steps if not s.committed and s.state.value != "failed"]
    if in_flight:
        lines.append("in flight: " + ", ".join(f"{s.step} {s.kind.value} ({len(s.finished)}/{s.expected} finished)"
                                               for s in in_flight))
    if status.subscribers:
        lines += ["", f"{'subscriber':<24} {'kind':<10} {'serving':>7} {'since':>9} {'lag steps':>9} "
                      f"{'lag s':>7} {'live':>4}  pins"]
        for s in status.subscribers:
            since = "-" if s.serving_since is None else f"{now - s.serving_since:.0f}s ago"
            lag_s = "-" if s.lag_s is None else f"{s.lag_s:.2f}"
            lines.append(f"{s.name[:24]:<24} {s.kind.value:<10} {_dash(s.serving):>7} {since:>9} "
                         f"{_dash(s.lag_steps):>9} {lag_s:>7} {'yes' if s.live else 'no':>4}  {s.pins or '-'}")
    if status.pins:
        lines.append("read leases: " + ", ".join(f"step {p.step} by {p.subscriber} ({p.expires_in_s:.0f}s left)"
                                                 for p in status.pins))
    lines += [f"warning: {w}" for w in status.warnings]
    return "\n".join(lines)


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _latest_of(root: str) -> int | None:
    from ckptd.layout import latest_step

    return latest_step(root)


if __name__ == "__main__":
    sys.exit(main())
