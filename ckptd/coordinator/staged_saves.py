"""Staged saves, the :class:`~ckptd.CheckpointCoordinator` half that snapshots tensors into
reusable host buffers (``save_state_async``, ``before_update``) and writes them in the background,
streamed behind the copy when it is fenced (see :mod:`ckptd.coordinator.staging`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ckptd import phases
from ckptd.coordinator.staging import tensors_of
from ckptd.coordinator.writer_process import check_picklable, in_mode, write_flat, write_flat_into
from ckptd.errors import CheckpointConfigError
from ckptd.metrics import FENCE_WAIT
from ckptd.workers.safetensors_io import plan_safetensors
from ckptd.workers.state_file import split

_METADATA = {"format": "pt"}  # the default writer's, as safetensors.torch.save_file writes it


class StagedSaves:
    """What the coordinator provides: its storage, template, staging, writer, queue and outbox."""

    _storage: Any
    _template: Any
    _staging: Any
    _writer: Any
    _root_url: str
    _attempt: int
    _client: Any
    _outbox: Any
    _worker: str
    _fence_step: int | None
    _unit: Callable
    _queue: Callable
    _blocked: Callable

    def save_state_async(
        self,
        name: str,
        state: Any,
        global_step: int,
        write_fn: Callable[[Any], Any] | None = None,
        *,
        is_state_dict: bool = False,
        fenced: bool = False,
    ) -> None:
        """Snapshot ``state`` into this name's reusable host buffers, then write it in the background.

        The tensors of ``state`` (a nested dict/list of tensors and plain values, such as a
        model or optimizer state dict) are copied into host buffers owned by ``name`` and reused
        by its next save (pinned when the tensors are on a GPU); ``write_fn(snapshot)`` then
        runs in the save thread ``name`` as one save unit, on a copy with the same structure.
        Training may change the original tensors as soon as the copy is done.

        Args:
            name: The save's name; saves of one name share buffers and run in call order.
            state: What to save.
            global_step: The training step.
            write_fn: Writes the snapshot and returns what it wrote (paths or WrittenFile), e.g.
                ``lambda sd: save_hf_model(out, sd, config)``. By default the tensors are
                written to ``{step_dir}/{name}.safetensors``, staged as that file's image and
                written from it; a state that is not a flat dict of tensors (an optimizer's)
                also gets its structure in ``{name}.state.json``. :func:`ckptd.load_state`
                reads either back.
            is_state_dict: As for :meth:`save_async`.
            fenced: Copy on a staging thread and return at once; the training loop must call
                :meth:`before_update` before anything changes the tensors (the optimizer
                step). The default writer then streams each chunk out as soon as it is staged,
                so the save is durable about one write after the call, not a copy plus a write.
                Otherwise the copy runs here, and this returns when it is done.

        Blocks while ``max_staged`` snapshots of ``name`` are still being written (back-pressure).

        Raises:
            CheckpointConfigError: bad name, step, state or write_fn; nothing was started.
            CheckpointError: an eager copy failed (the buffers are released).

        NOTE: with ``fenced=True``, a call to :meth:`before_update` must come before the state
        changes, or the checkpoint mixes two steps; nothing can detect a missing fence.
        """
        called_at = time.time()
        unit = self._unit(name, global_step, is_state_dict)
        leaves = tensors_of(state)
        if not leaves:
            if write_fn is not None:
                raise CheckpointConfigError(f"state of save {name!r} holds no tensors, so nothing is staged for its "
                                            "write_fn; use save_async for other data")
            self._save_plain(unit, name, state)
            self._blocked(unit, called_at, "save_state_async")
            return
        streamed = False  # the default thread writer streams each chunk out as soon as it is staged
        plan = None  # the default writer's file, staged into as its image (see BufferSet)
        if write_fn is None:
            flat, metadata, _ = split(state, _METADATA)  # a nested state also gets a JSON structure
            path = self._storage.join(self._template.name(unit.step), f"{name}.safetensors")
            streamed = self._writer is None and fenced
            if len(flat) == len(leaves) and all(a is b for a, b in zip(flat.values(), leaves, strict=True)):
                plan = plan_safetensors(flat, metadata)  # not for DTensors: their local blocks are staged
            write_fn = (partial(write_flat_into, self._storage, path, metadata=_METADATA) if self._writer is None
                        else partial(write_flat, self._root_url, self._storage.storage_options, path,
                                     metadata=_METADATA))
        elif not callable(write_fn):
            raise CheckpointConfigError(f"write_fn must be callable, got {type(write_fn).__name__}")
        elif self._writer is not None:
            check_picklable(write_fn)
        writer = self._writer
        snap = self._staging.snapshot(name, state, leaves, fenced, plan)
        if plan is not None:
            write_fn = partial(write_fn, image=snap.buffers.image)

        def ready(buffer: Any, nbytes: int) -> None:
            with phases.phase(phases.STAGING):  # only the waits: the rest of the copy overlaps the write
                snap.wait_staged(buffer, nbytes)

        def save_fn() -> Any:
            try:
                if streamed:
                    written = write_fn(snap.state, ready=ready)
                    snap.wait()
                    return written
                snap.wait()
                phases.add(phases.STAGING, snap.copy_seconds)
                if writer is None:
                    return write_fn(snap.state)
                fence = (self._root_url, self._storage.storage_options, self._attempt)
                return writer.run(in_mode, self._storage.direct_io, fence, write_fn, snap.state, buffers=snap.buffers)
            finally:
                snap.release()

        try:
            # snap.release again once the unit has ended: a unit refused before it starts never
            # runs save_fn, and its buffers would be lost to the name (its next save would wait
            # for them for ever). Releasing twice hands them back once.
            self._queue(unit, save_fn, snap.release)
        except BaseException:
            snap.abort()
            raise
        if fenced:
            self._fence_step = unit.step
        self._blocked(unit, called_at, "save_state_async (fenced)" if fenced else "save_state_async")

    def _save_plain(self, unit: Any, name: str, state: Any) -> None:
        """A state with no tensors for the default writer (an optimizer before its first step,
        SGD without momentum): nothing to stage. Its plain values are copied now, and written as
        any nested state is (a tensors file holding none, and the structure beside it)."""
        split(state, _METADATA)  # refused now, before anything starts, if the writer cannot take it
        path = self._storage.join(self._template.name(unit.step), f"{name}.safetensors")
        self._queue(unit, partial(write_flat_into, self._storage, path, copy.deepcopy(state), metadata=_METADATA))

    def before_update(self) -> None:
        """Wait until every fenced staging copy has finished; call it before the optimizer step.

        Returns at once when nothing is being staged. Otherwise the calling thread copies the
        chunks the staging thread has not reached yet (from the end backwards) rather than wait
        idle: with a core free, the wait is about halved. A copy error is not raised here: the
        save fails with it.
        """
        started = time.time()
        fenced = self._staging.fence()
        now = time.time()
        if fenced:
            self._client.metrics.observe(FENCE_WAIT, now - started)
        step, self._fence_step = self._fence_step, None
        if step is not None:
            self._outbox.blocked(self._worker, step, started, now, "before_update (fence)")

    def staged_bytes(self) -> int:
        """Host memory held by staging buffers, all names together."""
        return self._staging.allocated_bytes
