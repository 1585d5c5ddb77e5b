"""The shared-root check: every process that writes a run's checkpoints must see the same storage.

A local path given to workers on several nodes resolves to each node's own disk: every node
writes its files where no other node (and not the monitor) can see them, and a monitor that
trusted the workers' reports would commit steps whose files are scattered over local disks.
So every coordinator writes a probe file with a random token when it starts, and the monitor
reads it back through its own view of the root before the coordinator may save anything.
``start_monitor`` does the same for the driver.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import ray

from ckptd.errors import CheckpointConfigError
from ckptd.storage import Storage

PROBE_DIR = ".ckptd/probes"


@dataclass(frozen=True)
class Probe:
    rel: str  # relative to the root
    token: str
    writer: str  # who wrote it, in words


def where_am_i() -> str:
    """This process, in words an operator can act on: node id, host and pid."""
    node, ip = "?", "?"  # not connected to Ray (a plain script): asking would start a local Ray
    if ray.is_initialized():
        try:
            node = ray.get_runtime_context().get_node_id()[:12]
            ip = ray.util.get_node_ip_address()
        except Exception:
            pass
    return f"node {node} ({socket.gethostname()}, {ip}) pid {os.getpid()}"


def write_probe(storage: Storage, writer: str) -> Probe:
    """Write a probe file for the monitor to read back.

    Raises:
        CheckpointConfigError: the root cannot be written.
    """
    token = uuid.uuid4().hex
    rel = f"{PROBE_DIR}/{token}.txt"
    try:
        storage.write_atomic(storage.join(rel), f"{token}\n{writer}\n".encode(), durable=False)
    except OSError as e:
        raise _unwritable(storage, writer, e) from e
    return Probe(rel, token, writer)


def check_writable(storage: Storage, writer: str) -> None:
    """Write and delete a probe file (retention and ledger clean-up delete too), or raise
    CheckpointConfigError."""
    probe = write_probe(storage, writer)
    try:
        storage.rm(storage.join(probe.rel))
    except OSError as e:
        raise _unwritable(storage, writer, e) from e


def _unwritable(storage: Storage, writer: str, e: OSError) -> CheckpointConfigError:
    return CheckpointConfigError(
        f"checkpoint root {storage.url!r} cannot be written by {writer} ({type(e).__name__}: {e}); "
        "pass a directory or bucket this job can write to"
    )


def remove_probe(storage: Storage, probe: Probe) -> None:
    try:
        storage.rm(storage.join(probe.rel))
    except OSError:
        pass  # a stray probe file is harmless


def probe_visible(storage: Storage, rel: str, token: str) -> bool:
    text = storage.read_text_or_none(storage.join(rel))
    return text is not None and text.split("\n", 1)[0] == token


def unshared_message(url: str, writer: str, reader: str) -> str:
    hint = (
        " memory:// is private to each process: use it only for single-process tests, not with a monitor."
        if url.startswith("memory://") else ""
    )
    return (
        f"checkpoint root {url!r} is not shared storage: {writer} wrote a probe file under it, but the "
        f"monitor on {reader} cannot read it, so files saved there would be missing from the checkpoint. "
        "Every worker and the monitor must see the same storage: use a filesystem mounted at the same "
        "path on every node (NFS, Lustre) or an object store URL (s3://, gs://...)." + hint
    )
