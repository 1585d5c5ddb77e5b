"""The event log's indexes (span by identity, unflushed span by object) against a plain model:
the same random adds, amendments, trims, flushes and failed flushes, the same spans out."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ckptd.monitor.events import UNIT, Amendment, EventLog, Span


class Model:
    """What the log keeps, computed the obvious way: linear scans, no index."""

    def __init__(self, max_steps: int, max_spans: int) -> None:
        self.max_steps, self.max_spans = max_steps, max_spans
        self.steps: dict[int, list[Span]] = {}
        self.unflushed: list[Span] = []

    def add(self, spans, flushed=False):
        for span in spans:
            if span.step not in self.steps:
                if len(self.steps) >= self.max_steps and span.step < min(self.steps):
                    continue
                self.steps[span.step] = []
            kept = self.steps[span.step]
            same = [i for i, s in enumerate(kept) if s.identity == span.identity]
            if same:  # sent again: one record, with the phases of both (the kept ones win)
                old = kept[same[0]]
                new = dataclasses.replace(span, phases={**(span.phases or {}), **(old.phases or {})} or None)
                if new != old or new.phases != old.phases:
                    self._put(kept, same[0], new)
                continue
            kept.append(span)
            if not flushed:
                self.unflushed.append(span)
        dropped = set()
        while len(self.steps) > self.max_steps or (
                sum(map(len, self.steps.values())) > self.max_spans and len(self.steps) > 1):
            dropped.add(min(self.steps))
            self.steps.pop(min(self.steps))
        self.unflushed = [s for s in self.unflushed if s.step not in dropped]

    def amend(self, amendments):
        for a in amendments:
            spans = self.steps.get(a.step, [])
            for i, span in enumerate(spans):
                if span.identity == a.identity:
                    self._put(spans, i, dataclasses.replace(span, phases={**(span.phases or {}), **a.phases}))
                    break

    def _put(self, spans, i, new):
        span, spans[i] = spans[i], new
        at = [j for j, s in enumerate(self.unflushed) if s is span]
        if at:
            self.unflushed[at[0]] = new
        else:
            self.unflushed.append(new)

    def take(self):
        out, self.unflushed = self.unflushed, []
        return out

    def give_back(self, spans):
        self.unflushed = [s for s in spans if s.step in self.steps] + self.unflushed

    def spans(self):
        return sorted((s for v in self.steps.values() for s in v), key=lambda s: (s.step, s.start))


@pytest.mark.parametrize("seed", range(8))
def test_the_log_keeps_and_amends_what_the_linear_model_does(seed):
    rng = random.Random(seed)
    log, model = EventLog(max_steps=4, max_spans=60), Model(4, 60)
    taken: list[tuple[list[Span], list[Span]]] = []  # (the log's, the model's): each amends its own objects
    for _ in range(600):
        op = rng.random()
        step, worker, start = rng.randrange(12), f"w{rng.randrange(6)}", float(rng.randrange(5))
        if op < 0.45:  # duplicates happen: a re-sent span has the identity of the first
            spans = [Span(UNIT, step, start, start + 1, worker=worker, name="m", kind="checkpoint",
                          phases=rng.choice([None, {"write": 0.5}, {"receipt": rng.random()}]))
                     for _ in range(rng.randrange(1, 3))]
            flushed = rng.random() < 0.1
            log.add(spans, flushed=flushed)
            model.add(spans, flushed=flushed)
        elif op < 0.8:
            amendments = [Amendment(step, worker, "m", start, {rng.choice(["receipt", "notification"]): rng.random()})]
            log.amend(amendments)
            model.amend(amendments)
        elif op < 0.9:
            got, want = log.take_unflushed(), model.take()
            assert got == want and all(g.phases == w.phases for g, w in zip(got, want, strict=True))
            taken.append((got, want))
        elif taken:
            back, model_back = taken.pop(rng.randrange(len(taken)))
            log.give_back(back)
            model.give_back(model_back)
        got, want = log.spans(), model.spans()
        assert got == want and [s.phases for s in got] == [s.phases for s in want]
        assert len({s.identity for s in got}) == len(got)  # one record per span, as readers keep
    assert log.take_unflushed() == model.take()


def test_an_amendment_costs_the_same_in_a_step_of_40000_spans():
    """Constant time per amendment: a linear scan would make this test take minutes."""
    log = EventLog(max_steps=2, max_spans=200_000)
    spans = [Span(UNIT, 1, float(i), i + 1.0, worker=f"r{i}", name="m", kind="checkpoint") for i in range(40_000)]
    log.add(spans)
    log.amend([Amendment(1, f"r{i}", "m", float(i), {"notification": 0.001}) for i in range(40_000)])
    assert all(s.phases == {"notification": 0.001} for s in log.spans())
    assert len(log.take_unflushed()) == 40_000  # each span once, amended in place
