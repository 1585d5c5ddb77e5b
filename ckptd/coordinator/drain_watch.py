"""Watching for a Ray drain of the node this process runs on.

Ray has no push notification to a worker that its node is being drained. The GCS knows, though:
the autoscaler (idle termination, spot preemption), ``ray drain-node``, and a ``ray start`` node
that receives SIGTERM all drain through it, with a deadline when one is known, and
``get_draining_nodes()`` lists them. Ray Train's own preemption watcher polls the same call. It is a
private API (``ray._private.state``) as of Ray 2.60; if it disappears, the watch logs once and
stops, and signals still work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptd.coordinator.notice import Notice, NoticeSource

log = logging.getLogger("ckptd.preemption")


def draining_nodes() -> dict[str, int]:
    """Ray's draining nodes: ``{node_id_hex: deadline_ms}`` (0: no deadline)."""
    from ray._private import state

    return dict(state.state.get_draining_nodes() or {})


class DrainWatch:
    """Polls the GCS every ``poll_s`` seconds and calls ``on_notice`` once when ``node_id`` drains.

    Args:
        node_id: The Ray node to watch (hex), normally this process's node.
        poll_s: Seconds between polls: one small GCS request each.
        on_notice: Called from the watch thread with the notice; must only record it.
    """

    def __init__(self, node_id: str, poll_s: float, on_notice: Callable[[Notice], None]) -> None:
        self._node = node_id
        self._poll_s = poll_s
        self._on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckptd-drain-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                drained = draining_nodes()
                failures = 0
            except (ImportError, AttributeError) as e:
                log.warning("cannot watch for Ray node drains with this Ray version (%s); only signals "
                            "will tell this process of a preemption", e)
                return
            except Exception as e:  # the GCS is briefly unreachable: try again next round
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("could not ask Ray whether this node is draining (%s failures): %s", failures, e)
                drained = {}
            if self._node in drained:
                deadline_ms = drained[self._node]
                self._on_notice(Notice(NoticeSource.RAY_DRAIN, time.time(),
                                       deadline_ms / 1000.0 if deadline_ms else None,
                                       f"Ray node {self._node} is being drained"))
                return
            self._stop.wait(self._poll_s)

    def stop(self) -> None:
        """Stop polling (returns at once; the thread ends within one poll)."""
        self._stop.set()
