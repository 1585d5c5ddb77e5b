"""How the commands reach a Ray cluster: connecting quietly, finding a run's monitor (``status``,
``timeline``), and asking whether a root's monitor is live before changing the root (``gc``,
``retire``): a live monitor owns its root, and a step it is committing has no manifest yet."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def add_cluster_options(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--namespace`` and ``--address``, for the commands that ask a run's monitor."""
    parser.add_argument("--namespace", default=None, help=f"{prefix}the monitor's Ray namespace (default: found)")
    parser.add_argument("--address", default="auto", help=f"{prefix}the Ray cluster to connect to (default: auto)")


@contextmanager
def connected(address: str, namespace: str | None = None) -> Iterator[None]:
    """Ray connected to the cluster at ``address`` for the block, without Ray's log lines.

    Raises:
        ConnectionError: no Ray cluster there.
    """
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def monitor_of(run: str, namespace: str | None) -> Any:
    """The actor handle of the run's monitor (on a connected Ray).

    Raises:
        CheckpointError: no monitor of that run.
    """
    from ckptd.monitor import get_monitor

    return get_monitor(run, namespace)


def refuse_live_root(root: str, address: str, doing: str) -> None:
    """Raise CheckpointConfigError if the monitor of the root's newest attempt is live in the
    cluster at ``address`` (or in this driver's cluster, when Ray is already initialised here).
    Without a reachable cluster there is nothing to ask, and nothing is refused."""
    import ray

    from ckptd.retire import refuse_live
    from ckptd.storage import Storage

    if ray.is_initialized():  # called from a driver (a script, a test): ask its cluster
        refuse_live(Storage(root), doing)
        return
    try:
        with connected(address):
            refuse_live(Storage(root), doing)
    except ConnectionError:
        return
