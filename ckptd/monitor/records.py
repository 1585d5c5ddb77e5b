"""What the monitor knows of one step: its kinds, its units and their tallies (plain data, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ckptd.config import Kind
from ckptd.manifest import FileEntry
from ckptd.protocol import UnitFailure, UnitId

SD, CKPT = Kind.STATE_DICT, Kind.CHECKPOINT


class StepState(str, Enum):
    PENDING = "pending"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"


@dataclass
class UnitRecord:
    unit: UnitId
    seen_at: float
    files: list[FileEntry] | None = None  # set once finished
    failure: UnitFailure | None = None
    after_sd_commit: bool = False  # a state-dict unit that counts toward the full checkpoint only
    found: bool = False  # its files were found by time (save_fn returned None): they may be another unit's

    @property
    def running(self) -> bool:
        return self.files is None and self.failure is None


@dataclass
class KindRecord:
    kind: Kind
    expected: int = 0
    monitored: bool = False
    registered_at: float | None = None
    state: StepState = StepState.PENDING
    reason: str | None = None
    failed_unit: str | None = None
    ready_at: float | None = None
    committed_at: float | None = None
    committed_units: set[str] = field(default_factory=set)  # unit keys in the committed manifest
    committed_files: dict[str, FileEntry] = field(default_factory=dict)  # what that manifest lists
    deferred: bool = False  # a commit waits for the other kind's running units (see the commit path)
    withdrawing: bool = False  # committed, and being withdrawn: its files changed (see the commit path)
    checks: int = 0  # checks of its files against storage in flight (see UnitReports._changed_state_dict)
    files_unknown: bool = False  # committed, and its record rebuilt after a prune: what it lists is read back

    @property
    def settled(self) -> bool:
        return self.state in (StepState.COMMITTED, StepState.FAILED)


@dataclass
class Tally:
    """Units of one group of a step, by outcome: kept as units come and go, so that the commit
    rule costs the same for 4 units as for 40,000 (no scan of the units per notification)."""

    total: int = 0
    finished: int = 0
    failed: int = 0
    first_seen: float | None = None  # when the group's first unit was seen

    @property
    def running(self) -> int:
        return self.total - self.finished - self.failed

    def complete(self, expected: int) -> bool:
        """Exactly ``expected`` units, all finished."""
        return self.total == expected and self.finished == expected


@dataclass
class StepRecord:
    step: int
    first_seen: float
    kinds: dict[Kind, KindRecord] = field(default_factory=lambda: {k: KindRecord(k) for k in Kind})
    units: dict[str, UnitRecord] = field(default_factory=dict)
    registrations: set[str] = field(default_factory=set)
    last_unit_at: float | None = None
    # Per kind (every unit of it), and the state-dict units admitted before its commit: see counted().
    tallies: dict[Kind, Tally] = field(default_factory=lambda: {k: Tally() for k in Kind})
    counted_sd: Tally = field(default_factory=Tally)

    def __getitem__(self, kind: Kind) -> KindRecord:
        return self.kinds[kind]

    # Units change only through these three, which keep the tallies.
    def add_unit(self, u: UnitRecord) -> None:
        self.units[u.unit.key] = u
        for t in self._tallies_of(u):
            t.total += 1
            t.first_seen = u.seen_at if t.first_seen is None else min(t.first_seen, u.seen_at)

    def set_finished(self, u: UnitRecord, files: list[FileEntry], found: bool) -> None:
        assert u.running, "a unit's outcome is set once"
        u.files, u.found = list(files), found
        for t in self._tallies_of(u):
            t.finished += 1

    def set_failed(self, u: UnitRecord, failure: UnitFailure) -> None:
        assert u.running, "a unit's outcome is set once"
        u.failure = failure
        for t in self._tallies_of(u):
            t.failed += 1

    def _tallies_of(self, u: UnitRecord) -> tuple[Tally, ...]:
        kind_tally = self.tallies[u.unit.kind]
        return (kind_tally, self.counted_sd) if u.unit.kind is SD and not u.after_sd_commit else (kind_tally,)

    def counted_tally(self, kind: Kind) -> Tally:
        """The tally of :meth:`counted` (for the checkpoint: both kinds' units, summed)."""
        if kind is SD:
            return self.counted_sd
        sd, ck = self.tallies[SD], self.tallies[CKPT]
        firsts = [t for t in (sd.first_seen, ck.first_seen) if t is not None]
        return Tally(sd.total + ck.total, sd.finished + ck.finished, sd.failed + ck.failed,
                     min(firsts) if firsts else None)

    def active(self, kind: Kind) -> bool:
        """Whether the kind has anything to report: registrations, units or an outcome."""
        k = self.kinds[kind]
        return k.expected > 0 or k.monitored or k.state is not StepState.PENDING or self.tallies[kind].total > 0

    def has_running(self, kinds: tuple[Kind, ...] = (SD, CKPT)) -> bool:
        return any(self.tallies[k].running for k in kinds)

    def counted(self, kind: Kind) -> list[UnitRecord]:
        """Units that count toward ``kind``: the state dict counts only units admitted before its
        commit; the checkpoint counts every unit of the step."""
        if kind is SD:
            return [u for u in self.units.values() if u.unit.kind is SD and not u.after_sd_commit]
        return list(self.units.values())

    def finished(self, kind: Kind) -> dict[str, list[FileEntry]]:
        """Unit key -> files, of every finished unit of ``kind`` (after-commit ones included)."""
        return {key: u.files for key, u in self.units.items() if u.unit.kind is kind and u.files is not None}
