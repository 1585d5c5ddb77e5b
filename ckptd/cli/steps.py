"""Commands that read a root's committed steps: ``latest``, ``ls``, ``show``, ``export-hf``.

They read storage only (no Ray), so they work on a finished run, a copy, or a mirror. Exit
codes: 0 done, 1 nothing committed or the step is not committed, 2 bad arguments (argparse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from typing import Any

from ckptd.config import Kind


def utc(seconds: float) -> str:
    """A manifest's time (seconds since the epoch) as people read it: ``2026-11-27 14:22:13.303 UTC``."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def add_parsers(sub: Any, storage_options_help: str) -> None:
    latest = sub.add_parser("latest", help="print the newest committed step of each kind under a root",
                            description="Exit 1 when nothing is committed (or the root does not exist).",
                            epilog="example: ckptd latest s3://bucket/run --json")
    latest.add_argument("root")
    latest.add_argument("--json", action="store_true", help="print {\"checkpoint\": N, \"state_dict\": N}")

    ls = sub.add_parser("ls", help="list the committed steps under a root: kinds, files, bytes, mirrored, pinned",
                        epilog="example: ckptd ls ./ckpt --mirror s3://bucket/run")
    ls.add_argument("root")
    ls.add_argument("--mirror", default=None, help="the run's mirror URL: also say which steps it holds")
    ls.add_argument("--json", action="store_true", help="one JSON object per step, in a list")

    show = sub.add_parser("show", help="print the manifests of a committed step",
                          epilog="example: ckptd show ./ckpt 300 --json")
    show.add_argument("root")
    show.add_argument("step", type=int)
    show.add_argument("--json", action="store_true", help="the manifests as JSON, by kind")

    export = sub.add_parser("export-hf", help="write a committed step's weights as a HuggingFace checkpoint",
                            description="Reads the step's weights (checked against its manifest): HF, sharded "
                                        "(FSDP, DCP) or ckptd shards, and writes model.safetensors (with an index "
                                        "above --max-shard-size) and config.json, which from_pretrained loads.",
                            epilog="example: ckptd export-hf ./ckpt 300 ./hf-300 --config ./hf-base/config.json")
    export.add_argument("root")
    export.add_argument("step", type=int)
    export.add_argument("out")
    export.add_argument("--config", default=None,
                        help="config.json to write with the weights (default: the step's own config.json)")
    export.add_argument("--model-dir", default=None, help="the weights' folder in the step (default: found)")
    export.add_argument("--max-shard-size", default="5GB")
    export.add_argument("--quiet", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    from ckptd.errors import CheckpointError

    try:
        return {"latest": _latest, "ls": _ls, "show": _show, "export-hf": _export}[args.command](args)
    except CheckpointError as e:  # a damaged manifest or tracker, an unreadable root: said, not a traceback
        print(f"FAILED: {e}", file=sys.stderr)
        return 1


def _nothing_committed(root: str) -> str:
    """What to say when nothing is committed under ``root``: why, if the root itself is the reason."""
    from ckptd.storage import Storage

    problem = Storage(root).root_problem()
    return f"nothing is committed under {root}" + (f": {problem}" if problem else "")


def _latest(args: argparse.Namespace) -> int:
    from ckptd.layout import latest_step

    found = {k.value: latest_step(args.root, k.value) for k in Kind}
    if args.json:
        print(json.dumps(found))
    else:
        for kind, step in found.items():
            print(f"{kind}: {'-' if step is None else step}")
    if all(v is None for v in found.values()):
        print(_nothing_committed(args.root), file=sys.stderr)
        return 1
    return 0


def _rows(root: str, mirror: str | None) -> list[dict]:
    from ckptd.errors import CheckpointError
    from ckptd.layout import scan_steps
    from ckptd.monitor.publication import leased_steps
    from ckptd.storage import Storage
    from ckptd.verify import open_step

    storage = Storage(root)
    mirrored: set[int] = set()
    if mirror is not None:
        problem = Storage(mirror).root_problem()
        if problem is not None:
            print(f"warning: the mirror {mirror} cannot be read ({problem}): no step shows as mirrored",
                  file=sys.stderr)
        mirrored = {s for s, e in scan_steps(Storage(mirror)).items() if e.kinds}
    pinned = leased_steps(storage)
    rows = []
    for step, entry in sorted(scan_steps(storage).items()):
        if not entry.kinds:
            continue
        try:
            committed = open_step(storage, step, None)
        except CheckpointError as e:  # one damaged manifest does not hide the other steps
            rows.append({"step": step, "kinds": sorted(k.value for k in entry.kinds), "error": str(e),
                         "path": storage.join(entry.name)})
            continue
        rows.append({
            "step": step, "kinds": sorted(k.value for k in entry.kinds), "files": len(committed.files),
            "bytes": sum(f.size for f in committed.files.values()), "path": committed.path,
            "mirrored": (step in mirrored) if mirror is not None else None, "pinned": step in pinned,
        })
    return rows


def _ls(args: argparse.Namespace) -> int:
    rows = _rows(args.root, args.mirror)
    damaged = [r for r in rows if "error" in r]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0 if rows and not damaged else 1
    if not rows:
        print(_nothing_committed(args.root), file=sys.stderr)
        return 1
    print(f"{'step':>8}  {'kinds':<22} {'files':>5} {'size':>10}  {'mirrored':<8} {'pinned':<6}")
    for r in rows:
        if "error" in r:
            print(f"{r['step']:>8}  {','.join(r['kinds']):<22} DAMAGED: {r['error']}")
            continue
        mirrored = "-" if r["mirrored"] is None else ("yes" if r["mirrored"] else "no")
        print(f"{r['step']:>8}  {','.join(r['kinds']):<22} {r['files']:>5} {size(r['bytes']):>10}  "
              f"{mirrored:<8} {'yes' if r['pinned'] else 'no':<6}")
    return 1 if damaged else 0


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _show(args: argparse.Namespace) -> int:
    from ckptd.errors import CheckpointError
    from ckptd.storage import Storage
    from ckptd.verify import open_step

    try:
        committed = open_step(Storage(args.root), args.step, None)
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    manifests = {k.value: m.model_dump(mode="json") for k, m in committed.manifests.items()}
    if args.json:
        print(json.dumps(manifests, indent=1))
        return 0
    print(f"step {committed.step}: {committed.path}")
    for kind, m in manifests.items():
        print(f"\n{kind}: committed {utc(m['committed_at'])} by attempt {m.get('attempt')}, "
              f"{len(m['units'])} units, {len(m['files'])} files")
        for f in sorted(m["files"], key=lambda f: f["path"]):
            print(f"  {f['path']:<60} {size(f['size']):>10}  crc32 {f['crc32']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ckptd.cli.progress import bar
    from ckptd.errors import CheckpointError
    from ckptd.storage import Storage
    from ckptd.verify import open_step, read_file
    from ckptd.workers.export import export_hf_step
    from ckptd.workers.weights import locate

    try:
        if args.config is not None:
            try:
                with open(args.config) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                print(f"FAILED: --config {args.config}: not a readable JSON model config ({e})", file=sys.stderr)
                return 1
        else:
            storage = Storage(args.root)
            committed = open_step(storage, args.step, None)
            rel, _ = locate(committed, args.model_dir)
            name = f"{rel}/config.json".lstrip("/")
            if name not in committed.files:
                print(f"FAILED: step {args.step} has no {name}; pass --config", file=sys.stderr)
                return 1
            config = json.loads(read_file(storage, committed, name))
        with bar(quiet=args.quiet) as progress:
            progress.add_task(f"exporting step {args.step} (checking, then writing)", total=None)
            written = export_hf_step(args.root, args.step, args.out, config, model_dir=args.model_dir,
                                     max_shard_size=args.max_shard_size)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    total = sum(w.size for w in written)
    where = args.out if "://" in args.out else os.path.abspath(args.out)
    print(f"wrote {len(written)} files ({size(total)}) to {where}")
    return 0
