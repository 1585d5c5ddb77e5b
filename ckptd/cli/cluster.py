"""How the commands reach a Ray cluster: connecting quietly, finding a run's monitor (``status``,
``timeline``), and asking whether a root's monitor is live before changing the root (``gc``,
``retire``): a live monitor owns its root, and a step it is committing has no manifest yet."""

from __future__ import annotations

import argparse
import logging
import socket
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

    _probe(address)
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError at once if nothing listens at a ``host:port`` (or ``ray://host:port``)
    address: Ray itself keeps trying to reach a missing cluster for a minute or more."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return  # "auto", "local", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"nothing listens at {address} ({e})") from e


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
    except ConnectionError as e:
        if address == "auto":
            return  # no cluster on this machine: no monitor of it can be live
        from ckptd.errors import CheckpointConfigError

        raise CheckpointConfigError(
            f"no Ray cluster at {address!r} ({e}): cannot check that no monitor is live on {root} before "
            f"{doing}. Fix --address, or leave it out when no cluster runs the root's job") from e
