"""Configuration models (pydantic v2, frozen, unknown options rejected)."""

from __future__ import annotations

import numbers
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckptd.errors import CheckpointConfigError
from ckptd.template import StepDirTemplate


class SaveStrategy(str, Enum):
    """How many checkpoint writers may run at once, across the whole run.

    ``unrestricted``: no limit. ``single_thread``: one writer at a time. ``single_process``: the
    writers of one process at a time. ``single_node``: the writers of one node at a time. Slots
    are granted first come, first served.
    """

    UNRESTRICTED = "unrestricted"
    SINGLE_THREAD = "single_thread"
    SINGLE_PROCESS = "single_process"
    SINGLE_NODE = "single_node"


class Kind(str, Enum):
    """What a save unit belongs to: a full checkpoint or a state dict (weights only)."""

    CHECKPOINT = "checkpoint"
    STATE_DICT = "state_dict"

    @classmethod
    def from_flag(cls, is_state_dict: bool) -> Kind:
        """The kind ``is_state_dict`` names. Raises CheckpointConfigError for anything but a bool
        (or an int 0 or 1): a string such as "no" would otherwise count as a state dict."""
        if not isinstance(is_state_dict, bool) and not (isinstance(is_state_dict, numbers.Integral)
                                                        and is_state_dict in (0, 1)):
            raise CheckpointConfigError(
                f"is_state_dict must be True (a state dict: weights only) or False (a full checkpoint), "
                f"got {type(is_state_dict).__name__} {is_state_dict!r}")
        return cls.STATE_DICT if is_state_dict else cls.CHECKPOINT


class RetentionLimits(BaseModel):
    """How many steps one tier keeps (the root, or the mirror); see :class:`MonitorOptions`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_ckpt_to_keep: int | None = None
    max_state_dict_to_keep: int | None = None
    keep_every_n_steps: int | None = None

    @field_validator("max_ckpt_to_keep", "max_state_dict_to_keep")
    @classmethod
    def _keep(cls, v: int | None, info) -> int | None:
        if v is not None and v < 2:
            raise ValueError(
                f"{info.field_name} must be >= 2, or None to keep all, got {v}. Keeping only one would "
                "delete the previous step while a reader (a resuming job, a rollout worker) may still be "
                "loading it"
            )
        return v

    @field_validator("keep_every_n_steps")
    @classmethod
    def _every(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"keep_every_n_steps must be >= 1, or None, got {v}")
        return v


class MirrorOptions(RetentionLimits):
    """The mirror tier: committed steps uploaded in the background to durable storage.

    Pass ``mirror="s3://bucket/run"`` to :func:`ckptd.start_monitor`, or a dict of these fields
    for more control. Credentials go in ``start_monitor(mirror_storage_options=...)``.

    Attributes:
        url: The mirror's root, any fsspec URL; it gets the same layout as the local root
            (step directories, manifests, trackers), so it can be read and resumed from directly.
        max_ckpt_to_keep, max_state_dict_to_keep, keep_every_n_steps: Retention on the mirror,
            as for the local root; None keeps all (the default).
        state_dicts: Mirror state-dict commits too, not only full checkpoints.
        concurrency: Files uploaded at once.
        retries: How often one request (a file's upload, a manifest, a tracker) is retried,
            with exponential backoff, before the step's upload counts as failed.
        retry_backoff_s: The first retry's delay; each next one doubles it (at most 30 s).
        retry_after_s: A step whose upload failed is tried again this long after.
        verify: ``"checksum"`` reads every uploaded file back from the mirror and compares its
            CRC-32 with the manifest; ``"size"`` compares sizes only (no read-back).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    state_dicts: bool = False
    concurrency: int = Field(default=4, ge=1, le=64)
    retries: int = Field(default=5, ge=0)
    retry_backoff_s: float = Field(default=1.0, ge=0)
    retry_after_s: float = Field(default=60.0, gt=0)
    verify: Literal["checksum", "size"] = "checksum"

    @model_validator(mode="after")
    def _state_dict_limit(self) -> MirrorOptions:
        if self.max_state_dict_to_keep is not None and not self.state_dicts:
            raise ValueError(
                "max_state_dict_to_keep applies to mirrored state dicts; set state_dicts=True to mirror "
                "them, or use max_ckpt_to_keep"
            )
        return self

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("the mirror url must be a non-empty path or URL, e.g. 's3://bucket/run'")
        return v


class MonitorOptions(RetentionLimits):
    """Options of a CheckpointMonitor, passed as keyword arguments to :func:`ckptd.start_monitor`.

    Attributes:
        save_strategy: Write throttling; see :class:`SaveStrategy`.
        step_timeout_s: A step whose registered units have not all finished this many seconds
            after it was first seen is marked failed.
        slot_lease_s: A writer slot whose holder stops renewing it (its process died) is
            released after this many seconds.
        commit_retries: How often a commit whose I/O failed is retried before the step is
            marked failed.
        status_history: How many committed or failed steps ``status()`` reports in detail.
        detached: Start the monitor as a detached actor that outlives the driver.
        step_dir_template: How step directories are named: ``global_step_{step}`` (verl),
            ``epoch-{epoch}_step-{step}`` (ColossalChat) or ``step_{step}`` (open-instruct).
            Recorded under the root; a root keeps the template it was first used with.
        max_ckpt_to_keep: Keep this many newest full checkpoints; None keeps all.
        max_state_dict_to_keep: Keep this many newest state dicts (full checkpoints count);
            None keeps all. The default, 2, keeps the previous version for readers that are
            still loading it.
        keep_every_n_steps: Never delete steps that are a multiple of this; None for none.
        unregistered_warning_s: A unit that finished while its step's kind is unregistered (or
            registered units that never started) is logged and shown in ``status().warnings``
            after this many seconds; the step still fails only at ``step_timeout_s``.
        leftover_grace_s: Step directories without a manifest that are older than the newest
            commit are deleted once nothing in them has changed for this long (failed steps
            are deleted at once).
        read_lease_s: A read lease (a weight subscriber's pin on a step) and a subscriber's
            liveness last this long without renewal; subscribers renew every third of it. Leases
            are recorded under the root, and a monitor that starts restores them for this long.
        keep_served: Retention also keeps the version each live subscriber reports serving.
        mirror: Upload committed steps to this fsspec URL in the background (a
            :class:`MirrorOptions`, or just its URL). Retention applies to each tier separately.
        timeline_steps: How many steps' timeline events (``ckptd timeline``) the monitor keeps,
            in memory and under ``root/.ckptd/events/{run}/``; the oldest steps go first.
        timeline_flush_s: How often new timeline events are written under the root (a monitor
            that is killed loses at most this much of the picture).
        node_relay: Coordinators send their notifications through one relay actor per node,
            which forwards them to the monitor in batches: one call per node and batch instead of
            one per coordinator. Turn it on past a few hundred workers; it adds one local hop
            (about a millisecond) to each notification. A relay holds nothing: one that dies
            costs a retry, never a notification (see :mod:`ckptd.coordinator.relay`).
        relay_zones: With ``node_relay``: node relays send through this many zone relays (a
            node picks one by its id), which send to the monitor, so that the monitor receives
            a few large batches instead of one call per node: for thousands of nodes (about the
            square root of the node count). 0 sends straight to the monitor.
        direct_io: How workers write large local files (32 MiB and up: the safetensors files
            of ``save_state_async``, the HF and sharded writers, the optimizer's): ``"auto"`` with
            O_DIRECT, past the page cache, on ext4 and xfs; ``"on"`` on any local filesystem
            that accepts it; ``"off"`` always through the page cache. Files are fsynced either
            way; see :mod:`ckptd.direct_io`.

    NOTE: retention deletes whole step directories, and only committed steps older than the
    newest commit. The tracker targets and steps still being saved are never deleted.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    save_strategy: SaveStrategy = SaveStrategy.UNRESTRICTED
    step_timeout_s: float = Field(default=3600.0)
    slot_lease_s: float = Field(default=60.0)
    commit_retries: int = Field(default=3)
    status_history: int = Field(default=100)
    detached: bool = False
    step_dir_template: str = "global_step_{step}"
    max_state_dict_to_keep: int | None = 2  # max_ckpt_to_keep and keep_every_n_steps: see RetentionLimits
    leftover_grace_s: float = Field(default=600.0)
    unregistered_warning_s: float = Field(default=60.0)
    read_lease_s: float = Field(default=30.0)
    keep_served: bool = False
    mirror: MirrorOptions | None = None
    timeline_steps: int = Field(default=1000)
    timeline_flush_s: float = Field(default=2.0)
    node_relay: bool = False
    relay_zones: int = Field(default=0)
    direct_io: Literal["auto", "on", "off"] = "auto"

    @field_validator("step_dir_template")
    @classmethod
    def _template(cls, v: str) -> str:
        return StepDirTemplate(v).template

    @field_validator("mirror", mode="before")
    @classmethod
    def _mirror(cls, v: Any) -> Any:
        return {"url": v} if isinstance(v, str) else v

    @field_validator("step_timeout_s", "slot_lease_s", "leftover_grace_s", "unregistered_warning_s", "read_lease_s",
                     "timeline_flush_s")
    @classmethod
    def _positive_seconds(cls, v: float, info) -> float:
        if not v > 0:
            raise ValueError(f"{info.field_name} must be > 0 seconds, got {v}")
        return v

    @field_validator("commit_retries")
    @classmethod
    def _non_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"commit_retries must be >= 0 (0 means no retry), got {v}")
        return v

    @field_validator("relay_zones")
    @classmethod
    def _zones(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"relay_zones must be >= 0 (0: node relays send to the monitor), got {v}")
        return v

    @model_validator(mode="after")
    def _zones_need_relays(self) -> MonitorOptions:
        if self.relay_zones and not self.node_relay:
            raise ValueError("relay_zones needs node_relay=True: zone relays forward what node relays send")
        return self

    @field_validator("status_history", "timeline_steps")
    @classmethod
    def _history(cls, v: int, info) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @classmethod
    def parse(cls, options: dict) -> MonitorOptions:
        """Validate ``options``, turning pydantic's error into a :class:`CheckpointConfigError`."""
        try:
            return cls(**options)
        except ValidationError as e:
            problems = []
            for err in e.errors():
                field = ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown option {field!r}")
                else:
                    problems.append(f"{field}: {err['msg']}")
            known = ", ".join(sorted(cls.model_fields))
            raise CheckpointConfigError(
                f"invalid CheckpointMonitor options: {'; '.join(problems)}. Known options: {known}"
            ) from None
