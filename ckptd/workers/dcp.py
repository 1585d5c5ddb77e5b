"""``torch.distributed.checkpoint`` (DCP) through ckptd: a ``StorageWriter`` that makes a
``dcp.save`` one ckptd save unit per rank.

Code written for DCP (torchtitan's checkpointer, for instance) passes ``storage_writer=
CkptdStorageWriter(coord.step_dir(step) + "/model")`` and runs the call inside a unit::

    # the collectives of dcp.save run on the training thread: save_sync is the unit
    writer = CkptdStorageWriter(f"{coord.step_dir(step)}/model")
    coord.save_sync(lambda: writer.save(model.state_dict()), step)

    # or in the background, as dcp.async_save does: stage, then plan and write on the save
    # thread over a second (gloo) process group, so training collectives are not interleaved
    coord.save_state_async("dcp", model.state_dict(), step,
                           lambda staged: writer.save(staged, process_group=background_group))

The step then commits only when every rank's unit has finished, its tracker moves, retention
applies, and a rank that dies mid-save leaves it uncommitted. DCP's planning (the gather of the
local plans, the global plan, the gather of the results) stays as DCP does it.

The files are those of :func:`ckptd.workers.save_sharded` (version 2): one safetensors file per
rank with DCP's ``DCP_SHARDING_INFO`` in its header, and ``sharded_metadata.json`` written by the
coordinator rank instead of DCP's pickled ``.metadata``. So ckptd's loaders, ``resume``,
``export_hf_step`` and DCP's own ``HuggingFaceStorageReader`` all read it, and nothing is unpickled.
DCP's non-tensor entries (``BytesIO`` items) have no place in safetensors and are refused.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.workers import sharded
from ckptd.workers.files import write_json
from ckptd.workers.safetensors_io import check_tensors, write_safetensors


class CkptdStorageWriter(StorageWriter):
    """Writes a ``dcp.save`` into a ckptd step directory; :attr:`written` lists this rank's files.

    Args:
        out_dir: The sharded directory in the step (``f"{coord.step_dir(step)}/model"``), the
            same on every rank; any fsspec URL.
        storage_options: fsspec options for ``out_dir``.
    """

    def __init__(self, out_dir: str, storage_options: dict | None = None) -> None:
        super().__init__()
        self.out_dir, self.storage_options = str(out_dir), storage_options
        self.written: list[WrittenFile] = []
        self._coordinator = False

    def save(self, state_dict: dict[str, Any], *, process_group: Any = None, **kwargs: Any) -> list[WrittenFile]:
        """``dcp.save(state_dict, storage_writer=self, ...)``; return what this rank wrote (a save
        unit's ``save_fn`` returns it, so ckptd lists the files without reading them back)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self.written = []
        try:
            dcp.save(state_dict, storage_writer=self, process_group=process_group, **kwargs)
        except CheckpointException as e:
            # DCP wraps every rank's failure in a BaseException, which a save unit (and most
            # callers' ``except Exception``) would not see as a failure: hand on the first cause.
            failures = sorted(e.failures.items())
            cause = failures[0][1][0] if failures else e
            what = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in failures[:4])
            err_type = type(cause) if isinstance(cause, CheckpointError) else CheckpointError
            try:
                err = err_type(f"dcp.save failed ({what})")
            except TypeError:  # an error type with other constructor arguments
                err = CheckpointError(f"dcp.save failed ({what})")
            raise err from cause
        return list(self.written)

    # -- StorageWriter ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.out_dir = str(checkpoint_id)
        self.written = []

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        refused = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        if refused:
            raise CheckpointConfigError(
                f"the state dict has non-tensor entries {refused[:5]}; a ckptd DCP checkpoint holds tensors only "
                "(safetensors). Save other values as JSON in a separate unit, e.g. save_training_state")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        import dataclasses

        return [dataclasses.replace(plan, storage_data={"rank": i, "world_size": len(plans)})
                for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = plan.storage_data["rank"]
        name = sharded.shard_name(rank)
        tensors: dict[str, torch.Tensor] = {}
        offsets: dict[str, dict] = {}
        results = []
        for item in plan.items:
            t = planner.resolve_data(item).detach()
            key = item.index.fqn
            if t.device.type != "cpu":
                t = t.to("cpu")
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data=name))
            if t.numel() == 0 and t.dim() > 0:
                continue
            if key in tensors:
                raise CheckpointConfigError(f"two pieces of {key!r} on one rank; ckptd takes one block per rank")
            tensors[key] = t
            offsets[key] = {"saved_offsets": list(item.tensor_data.chunk.offsets) if item.tensor_data else []}
        check_tensors(tensors, "the state dict")
        storage = Storage(self.out_dir, self.storage_options)
        storage.makedirs(storage.root)
        meta = sharded.dcp_header(offsets)
        self.written.append(write_safetensors(storage, f"{storage.root}/{name}", tensors, meta))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = Storage(self.out_dir, self.storage_options)
        shapes = {k: list(v.size) for k, v in metadata.state_dict_metadata.items()
                  if isinstance(v, TensorStorageMetadata)}
        files = [sharded.shard_name(r) for r in range(len(results))]
        self.written.append(write_json(storage, f"{storage.root}/{sharded.METADATA}", sharded.metadata_of(
            len(results), files, shapes)))
