"""Resume training from the newest committed full checkpoint, in one call."""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.layout import TRACKERS, read_tracker
from ckptd.resume_inputs import check_inputs, check_scheduler_state
from ckptd.storage import Storage, explains_credentials
from ckptd.units import check_step
from ckptd.verify import CommittedStep, open_step, read_file
from ckptd.workers import reshard
from ckptd.workers.dtensor import GROUPS_FILE, is_dtensor
from ckptd.workers.files import load_json, load_torch
from ckptd.workers.state_file import SUFFIX, nested_states, read_state, saved_states
from ckptd.workers.training_state import DATA, RUNNING_STATES, RunningState, end_epoch, rank_file, set_rng_state
from ckptd.workers.weights import locate, read_weights

log = logging.getLogger("ckptd.resume")


class ResumeState(BaseModel):
    """Where to continue training after :func:`resume`.

    Attributes:
        step: The checkpoint's step: global steps already trained.
        epoch: The epoch to continue in. After a checkpoint taken at the end of an epoch this is
            the next epoch, so no empty epoch is replayed.
        step_in_epoch: Steps of ``epoch`` already trained (skip that many batches).
        sample_start_index: Samples of ``epoch`` already consumed per rank (for samplers that
            take a start index).
        consumed_samples: Samples consumed by all ranks since the start of training.
        path: The step directory that was loaded.
        running: ``running_states.json`` as saved, or None if the checkpoint has none (then
            ``epoch``, ``step_in_epoch`` and ``sample_start_index`` are None too).
    """

    model_config = ConfigDict(frozen=True)

    step: int
    epoch: int | None
    step_in_epoch: int | None
    sample_start_index: int | None
    consumed_samples: int | None
    path: str
    running: RunningState | None


@explains_credentials
def resume(
    root: str,
    *,
    model: Any = None,
    optimizer: Any = None,
    optimizer_name: str | None = None,
    lr_scheduler: Any = None,
    dataloader: Any = None,
    rank: int = 0,
    world_size: int | None = None,
    step: int | None = None,
    model_dir: str | None = None,
    state_dir: str = "",
    restore_rng: bool = True,
    adapter_name: str = "default",
    storage_options: dict | None = None,
    mirror: str | None = None,
    mirror_storage_options: dict | None = None,
) -> ResumeState | None:
    """Restore everything given from the newest committed full checkpoint under ``root``.

    Only committed steps are considered (a manifest exists), and every file read is checked
    against the manifest before it is used. Everything is read and checked first; objects are
    changed only once all of it loaded, so a failed resume leaves them as they were.

    Args:
        root: The checkpoint root.
        model: An ``nn.Module``; its weights come from the HuggingFace, sharded or LoRA-adapter
            files in ``model_dir`` (for an adapter, pass the ``PeftModel``).
        optimizer, lr_scheduler, dataloader: Objects with ``load_state_dict``; each gets the
            state saved by :func:`ckptd.workers.save_training_state` (this rank's, for the first
            two; ``data.pt`` for the dataloader).
        optimizer_name: Load the optimizer from the state that ``save_state_async(optimizer_name,
            optimizer.state_dict(), step)`` saved with the default writer
            (:func:`ckptd.load_state`), instead of this rank's file of ``save_training_state``
            or a sharded state's. The name is taken as it is, on any world size: a state each
            rank saved under its own name is found by that name.
        rank: This rank.
        world_size: This run's number of ranks, if known. On another world size than the
            checkpoint's, a sharded state (:func:`ckptd.workers.sharded_state`) is re-sharded
            (model and optimizer), the scheduler gets the state all saved ranks agree on, and
            ranks beyond the saved ones keep their random generators; per-rank optimizer files
            (:func:`ckptd.workers.save_training_state`) cannot move and are refused.
        step: Resume this committed step instead of the newest.
        model_dir, state_dir: Where in the step directory the model and the training state
            were written ('' for the step directory itself).
        restore_rng: Restore python, numpy, torch (and CUDA) random generators of this rank.
        adapter_name: The adapter to load a LoRA checkpoint into.
        storage_options: fsspec options for ``root``.
        mirror: The run's mirror tier (``start_monitor(mirror=...)``). The newer of the two
            tiers' newest checkpoints is used, so a job restarted on a fresh node, whose local
            root is empty or missing, resumes from the mirror. If the mirror cannot be reached,
            the local root is used when it has a checkpoint.
        mirror_storage_options: fsspec options for ``mirror``.

    Returns:
        Where to continue, or None if neither tier has a committed full checkpoint (a fresh
        start).

    Raises:
        CorruptCheckpointError: a file differs from its manifest, or is missing.
        UnsafeCheckpointError: a file needs arbitrary objects unpickled.
        CheckpointConfigError: the checkpoint lacks what was asked for, the model's keys do not
            match, or the world size changed under per-rank state.
        CheckpointError: ``step`` is not committed (on either tier, with a mirror).
    """
    check_inputs(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader, rank=rank,
                 world_size=world_size, restore_rng=restore_rng, model_dir=model_dir)
    if optimizer_name is not None and (optimizer is None or not isinstance(optimizer_name, str) or not optimizer_name):
        raise CheckpointConfigError(
            f"optimizer_name={optimizer_name!r}: give the name the optimizer's state was saved under with "
            "save_state_async (a non-empty str), together with optimizer= to load it into")
    if step is not None:
        check_step(step, "step")
    storage, committed = _choose_tier(Storage(root, storage_options), step, mirror, mirror_storage_options)
    if committed is None:
        _check_fresh_start(storage)
        log.info("no committed checkpoint under %s%s: starting fresh", root, f" or {mirror}" if mirror else "")
        return None
    prefix = state_dir.strip("/") + "/" if state_dir.strip("/") else ""
    running = None
    if f"{prefix}{RUNNING_STATES}" in committed.files:
        path = f"{committed.path}/{prefix}{RUNNING_STATES}"
        running = RunningState.model_validate(load_json(read_file(storage, committed, prefix + RUNNING_STATES), path))

    # Read and check everything first; change nothing until all of it loaded.
    sharded_dir = _sharded_state_dir(storage, committed, model, None if optimizer_name else optimizer, model_dir)
    try:
        apply = _read_all(storage, committed, running, prefix, sharded_dir, model=model, optimizer=optimizer,
                          optimizer_name=optimizer_name, lr_scheduler=lr_scheduler, dataloader=dataloader,
                          rank=rank, world_size=world_size, model_dir=model_dir, restore_rng=restore_rng,
                          adapter_name=adapter_name)
    except Exception:
        if sharded_dir is not None:
            reshard.agree(False)  # the other ranks must not go on with their part alone
        raise
    if sharded_dir is not None:
        reshard.agree(True)
    for fn in apply:
        fn()

    url = f"{storage.url.rstrip('/')}/{committed.path[len(storage.root):].lstrip('/')}"
    log.info("resumed from step %d (%s)", committed.step, url)
    if running is None:
        return ResumeState(step=committed.step, epoch=None, step_in_epoch=None, sample_start_index=None,
                           consumed_samples=None, path=url, running=None)
    if running.epoch_finished:
        epoch, in_epoch, start = running.epoch + 1, 0, 0
    else:
        epoch, in_epoch, start = running.epoch, running.step_in_epoch, running.sample_start_index
    return ResumeState(step=committed.step, epoch=epoch, step_in_epoch=in_epoch, sample_start_index=start,
                       consumed_samples=running.consumed_samples, path=url, running=running)


def _sharded_state_dir(storage: Storage, committed: CommittedStep, model: Any, optimizer: Any,
                       model_dir: str | None) -> str | None:
    """The sharded directory to load model (and optimizer) from block by block, or None when the
    model is loaded whole (:func:`ckptd.workers.weights.read_weights`)."""
    if model is None:
        return None
    rel, fmt = locate(committed, model_dir)
    if fmt != "sharded":
        return None
    prefix = f"{rel}/" if rel else ""
    has_optimizer = f"{prefix}{GROUPS_FILE}" in committed.files
    if any(is_dtensor(p) for p in model.parameters()) or (optimizer is not None and has_optimizer):
        return rel
    return None


def _read_all(storage: Storage, committed: CommittedStep, running: RunningState | None, prefix: str,
              sharded_dir: str | None, *, model, optimizer, optimizer_name, lr_scheduler, dataloader, rank: int,
              world_size: int | None, model_dir: str | None, restore_rng: bool, adapter_name: str) -> list:
    apply = []
    moved = running is not None and world_size is not None and running.world_size != world_size
    if sharded_dir is not None:
        has_optimizer = optimizer_name is None and f"{sharded_dir}/{GROUPS_FILE}".lstrip("/") in committed.files
        apply.append(reshard.load_sharded_state(storage, committed, sharded_dir, model,
                                                optimizer if has_optimizer else None))
        if has_optimizer:
            optimizer = None  # loaded with the model, on any world size
    elif model is not None:
        apply.append(_model_loader(storage, committed, model, model_dir, adapter_name))
    if optimizer_name is not None:
        candidates = f"the step's states that can be an optimizer's: {nested_states(committed) or 'none'}"
        if optimizer_name + SUFFIX not in committed.files:
            raise CheckpointConfigError(
                f"step {committed.step} has no state saved as {optimizer_name!r} ({optimizer_name}{SUFFIX} is not in "
                f"its manifest); its default-writer states: {saved_states(committed) or 'none'}, and {candidates} "
                "(an optimizer's state_dict is saved as NAME.safetensors with NAME.state.json). Pass one of those "
                "as optimizer_name=, or leave optimizer=None")
        optimizer_state = read_state(storage, committed, optimizer_name)
        _check_optimizer_state(optimizer_state, optimizer, f"step {committed.step}'s state {optimizer_name!r}",
                               f"; {candidates}")
        apply.append(lambda: optimizer.load_state_dict(optimizer_state))
    elif optimizer is not None:
        _refuse_sharded_optimizer_without_model(committed, model, prefix + rank_file("optimizer", rank))
        if moved:
            raise CheckpointConfigError(
                f"step {committed.step} holds optimizer state of {running.world_size} ranks, one per rank, "
                f"and this run has {world_size}; it cannot be re-sharded. Save it with "
                "ckptd.workers.sharded_state(model, optimizer) to resume on another world size, resume with "
                "the same world size, or leave optimizer=None and start it fresh"
            )
        rel = prefix + rank_file("optimizer", rank)
        optimizer_state = _load(storage, committed, rel, "optimizer", "optimizer_name=")
        _check_optimizer_state(optimizer_state, optimizer, f"{committed.path}/{rel}")
        apply.append(lambda: optimizer.load_state_dict(optimizer_state))
    # Applied first: the loads most likely to raise (a scheduler or dataloader of the user's own)
    # then come before the model and the optimizer are changed.
    first = []
    if lr_scheduler is not None:
        scheduler_state = _scheduler_state(storage, committed, prefix, rank, running if moved else None)
        check_scheduler_state(scheduler_state, lr_scheduler, f"step {committed.step}'s lr_scheduler state")
        first.append(lambda: lr_scheduler.load_state_dict(scheduler_state))
    if dataloader is not None:
        data = _load(storage, committed, prefix + DATA, "dataloader")
        if running is not None and running.epoch_finished:
            data = end_epoch(data)  # also for checkpoints written without it
        first.append(lambda: dataloader.load_state_dict(data))
    apply = first + apply
    if restore_rng:
        rel = prefix + rank_file("rng", rank)
        if rel in committed.files:
            rng = load_torch(read_file(storage, committed, rel), f"{committed.path}/{rel}")
            apply.append(lambda: set_rng_state(rng))
        else:
            log.warning("step %d has no RNG state for rank %d (%s); random generators are not restored",
                        committed.step, rank, f"it was saved by {running.world_size} ranks" if moved else
                        "none was saved")
    return apply


def _scheduler_state(storage: Storage, committed: CommittedStep, prefix: str, rank: int,
                     moved_from: RunningState | None) -> Any:
    """This rank's scheduler state; on another world size, the one every saved rank agrees on."""
    if moved_from is None:
        return _load(storage, committed, prefix + rank_file("lr_scheduler", rank), "lr_scheduler")
    states = [_load(storage, committed, prefix + rank_file("lr_scheduler", r), "lr_scheduler")
              for r in range(moved_from.world_size)]
    if any(s != states[0] for s in states[1:]):
        raise CheckpointConfigError(
            f"step {committed.step} holds different lr_scheduler states on its {moved_from.world_size} ranks, so "
            "none of them is the state of a rank of another world size; resume with the same world size, or "
            "leave lr_scheduler=None")
    return states[0]


def _check_fresh_start(storage: Storage) -> None:
    """Refuse to start fresh where a start would not be fresh: the root is a file, or its tracker
    names a step ckptd did not commit (another tool's checkpoint: its training would be lost)."""
    if storage.root_problem() == Storage.IS_A_FILE:
        storage.require_root()
    named = read_tracker(storage, Kind.CHECKPOINT)
    if named is not None:
        raise CheckpointError(
            f"{storage.join(TRACKERS[Kind.CHECKPOINT])} names step {named}, which ckptd did not commit (it has "
            "no manifest): another tool's checkpoint? ckptd resumes only the steps it committed. Load that step "
            "with the tool that saved it, or remove the tracker to start fresh")


def _choose_tier(local: Storage, step: int | None, mirror: str | None,
                 mirror_options: dict | None) -> tuple[Storage, CommittedStep | None]:
    """The tier to resume from, and its step: the local root's, unless the mirror's is newer."""
    try:
        here = open_step(local, step, Kind.CHECKPOINT)
    except CheckpointError:  # the requested step is not committed locally
        if mirror is None:
            raise
        here = None
    if mirror is None:
        return local, here
    remote = Storage(mirror, mirror_options)
    try:
        there = open_step(remote, step, Kind.CHECKPOINT)
    except (CheckpointError, OSError) as e:
        if here is None:
            raise
        log.warning("resuming from the local root: the mirror %s has no usable checkpoint (%s)", remote.url, e)
        there = None
    if there is not None and (here is None or there.step > here.step):
        log.info("resuming from the mirror %s: its step %d is newer than the local root's %s", remote.url,
                 there.step, None if here is None else here.step)
        return remote, there
    return local, here


def _load(storage: Storage, committed: CommittedStep, rel: str, what: str, by_name: str | None = None) -> Any:
    if rel not in committed.files:
        named = nested_states(committed) if by_name else []  # a model's weights are never an optimizer's
        hint = f", pass {by_name} with the name it was saved under ({named})" if named else ""
        raise CheckpointConfigError(
            f"step {committed.step} has no {what} state ({rel} is not in its manifest); it has "
            f"{_summary(committed)}. Pass state_dir= if it was written elsewhere{hint}, or leave {what}=None"
        )
    return load_torch(read_file(storage, committed, rel), f"{committed.path}/{rel}")


def _refuse_sharded_optimizer_without_model(committed: CommittedStep, model: Any, rel: str) -> None:
    """An optimizer saved sharded with the weights (``sharded_state(model, optimizer)``) loads only
    with the model from that folder, by parameter name: when it was not loaded so (no ``model=``,
    or the model from another folder) say that, rather than that the step has no optimizer state."""
    if rel in committed.files:
        return
    dirs = sorted(f.removesuffix(GROUPS_FILE) for f in committed.files
                  if f == GROUPS_FILE or f.endswith("/" + GROUPS_FILE))
    if not dirs:
        return
    where = ", ".join(d or "the step directory" for d in dirs)
    do = ("pass model= too (the model the optimizer's parameters belong to, with model_dir= if the step has "
          "several weight folders)" if model is None else
          f"pass model_dir= that folder ({', '.join(repr(d.rstrip('/')) for d in dirs)}), so the model is loaded "
          "from it with its optimizer")
    raise CheckpointConfigError(
        f"step {committed.step} holds the optimizer state sharded with the weights ({where}), and that state loads "
        f"only together with the model, by parameter name: {do}; or leave optimizer=None")


def _summary(committed: CommittedStep) -> str:
    names = sorted(committed.files)
    return ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")


def _model_loader(storage: Storage, committed: CommittedStep, model: Any, model_dir: str | None, adapter_name: str):
    weights = read_weights(storage, committed, model_dir)
    # Checked now (names, shapes), applied once everything else has loaded too.
    return weights.prepare_load(model, strict=True, adapter_name=adapter_name)


#: torch's optimizers whose per-parameter tensors all have their parameter's shape (or are scalars).
_PARAM_SHAPED_STATE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
                                 "RMSprop", "Rprop", "ASGD", "SparseAdam"})


def _check_optimizer_state(state: Any, optimizer: Any, what: str, hint: str = "") -> None:
    """Refuse, before anything is loaded, a state that ``optimizer.load_state_dict`` would refuse
    (another structure, other parameter groups) or that does not fit its parameters: a tensor of
    a parameter's state with another shape, for torch's optimizers whose state has the shapes of
    the parameters (others, such as Adafactor's factored moments, are not compared)."""
    def refuse(why: str) -> None:
        raise CheckpointConfigError(f"{what} is not this optimizer's state: {why}{hint}")

    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) \
            or not isinstance(state.get("param_groups"), list):
        refuse("it is no optimizer state dict (a dict with 'state' and 'param_groups')")
    groups, saved = optimizer.param_groups, state["param_groups"]
    if len(saved) != len(groups):
        refuse(f"it has {len(saved)} parameter groups, the optimizer {len(groups)}")
    for g, mine in zip(saved, groups, strict=True):
        if isinstance(g, dict) and (set(g) - set(mine)) and (set(mine) - set(g)):
            # Each has options the other lacks: another optimizer class (AdamW's betas against SGD's
            # momentum), not the same one from another torch version (which only adds options).
            refuse(f"its parameter groups have {sorted(set(g) - {'params'})}, this "
                   f"{type(optimizer).__name__}'s {sorted(set(mine) - {'params'})}: another optimizer class")
    params: dict[Any, Any] = {}
    for n, (g, mine) in enumerate(zip(saved, groups, strict=True)):
        ids = g.get("params") if isinstance(g, dict) else None
        if not isinstance(ids, list) or not all(isinstance(x, (int, str)) for x in ids) \
                or len(ids) != len(mine["params"]):
            refuse(f"its parameter group {n} lists {len(ids) if isinstance(ids, list) else 'no'} parameters, "
                   f"the optimizer's {len(mine['params'])}")
        params.update(zip(ids, mine["params"], strict=True))
    check_shapes = type(optimizer).__module__.startswith("torch.optim") and \
        type(optimizer).__name__ in _PARAM_SHAPED_STATE
    for i, per in state["state"].items():
        if i not in params:
            refuse(f"it has state for parameter {i!r}, which none of its groups lists")
        if not check_shapes or not isinstance(per, dict):
            continue
        for key, value in per.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[i].shape:
                refuse(f"its {key!r} of parameter {i} has shape {tuple(value.shape)}, the parameter "
                       f"{tuple(params[i].shape)}")
