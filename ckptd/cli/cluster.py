"""Asking the Ray cluster whether a root's monitor is live, for the commands that change a root
(``gc``, ``retire``): a live monitor owns its root, and a step it is committing has no manifest yet."""

from __future__ import annotations

import logging


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
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, configure_logging=False)
    except ConnectionError:
        return
    try:
        refuse_live(Storage(root), doing)
    finally:
        ray.shutdown()
