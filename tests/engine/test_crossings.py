"""The boundary crossings of one ordinary step and one write step of ``SimpleTrainer`` with the
default stack, counted, and docs/architecture.md's figures checked against the counts: the
doc cannot drift from the code.

A profile function (``sys.setprofile``) sees every call Python makes into a C function and
every Python frame that starts; a call into ``hookloop._core`` is a Python -> Rust crossing,
and a Python frame started while such a call is the innermost one is a Rust -> Python
crossing. An attribute store on a Rust object (``storage.iter = i``) is no call: the storage
is a subclass that counts them. Hooks the dispatcher calls are read from its statistics
(Rust halves of hooks are called through Python's calling convention, with no frame to see).
"""

from __future__ import annotations

import collections
import os
import re
import sys
import tempfile
from typing import Any, Dict

from hookloop import bench
from hookloop.engine import IterationTimer, LRScheduler, PeriodicWriter, SimpleTrainer, train_loop
from hookloop.utils.events import CommonMetricPrinter, EventStorage, JSONWriter, TensorboardXWriter

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "architecture.md")
ORDINARY, WRITE = 7, 19  # the default stack writes every 20 iterations: at 19, 39, ...
KINDS = (
    "Python → Rust, calls",
    "Python → Rust, attribute stores",
    "Rust → Python, frames",
    "hooks called by the dispatcher",
)


def _is_core(fn: Any) -> bool:
    """Whether the C function ``fn`` belongs to the extension (a function of the module, or a
    method of one of its types or of a Python subclass of one)."""
    if getattr(fn, "__module__", None) == "hookloop._core":
        return True
    owner = getattr(fn, "__self__", None)
    if owner is None:
        return False
    cls = owner if isinstance(owner, type) else type(owner)
    return any(c.__module__ == "hookloop._core" for c in cls.__mro__)


def count_crossings() -> Dict[int, Dict[str, int]]:
    """Per iteration (``trainer.iter`` when the crossing happened), the crossings of each kind
    in :data:`KINDS`."""
    counts: Dict[int, Dict[str, int]] = collections.defaultdict(collections.Counter)
    on: list = []  # [trainer] while counting
    hooks_done: Dict[int, int] = {}

    def note(kind: str) -> None:
        if on:
            counts[on[0].iter][kind] += 1

    class CountingStorage(EventStorage):
        @property
        def iter(self) -> int:
            return EventStorage.iter.__get__(self)

        @iter.setter
        def iter(self, value: int) -> None:
            note("Python → Rust, attribute stores")
            EventStorage.iter.__set__(self, value)

    stack: list = []  # per active call: whether it is a call into the extension

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            if stack and stack[-1]:
                note("Rust → Python, frames")
            stack.append(False)
        elif event == "c_call":
            core = _is_core(arg)
            if core:
                note("Python → Rust, calls")
            stack.append(core)
        elif event in ("return", "c_return", "c_exception") and stack:
            stack.pop()

    class Counted(SimpleTrainer):
        """Counts from the loop's first iteration; after each step, the hook calls the
        dispatcher made so far (not counted)."""

        def before_train(self) -> None:
            super().before_train()
            on.append(self)
            sys.setprofile(profile)

        def after_step(self) -> None:
            super().after_step()
            on.clear()
            hooks_done[self.iter] = sum(row[2] for row in self._hookloop.dispatcher.hook_stats())
            on.append(self)

        def after_train(self) -> None:
            sys.setprofile(None)
            on.clear()
            super().after_train()

    model, opt, sched = bench.build()
    with tempfile.TemporaryDirectory() as d:
        t = Counted(model, iter(bench.make_batches(count=WRITE + 1)), opt)
        writers = [
            CommonMetricPrinter(WRITE + 1),
            JSONWriter(os.path.join(d, "metrics.json")),
            TensorboardXWriter(d),
        ]
        t.register_hooks([IterationTimer(), LRScheduler(opt, sched), PeriodicWriter(writers, 20)])
        previous = sys.getprofile()
        train_loop.EventStorage = CountingStorage  # type: ignore[misc]
        try:
            t.train(0, WRITE + 1)
        finally:
            train_loop.EventStorage = EventStorage  # type: ignore[misc]
            sys.setprofile(previous)
    out = {}
    for it in (ORDINARY, WRITE):
        row = {kind: counts[it][kind] for kind in KINDS}
        row["hooks called by the dispatcher"] = hooks_done[it] - hooks_done[it - 1]
        out[it] = row
    return out


def documented() -> Dict[int, Dict[str, int]]:
    """docs/architecture.md's table under "Crossings counted": a row per kind, the ordinary
    step's count and the write step's."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    section = text.split("### Crossings counted", 1)[1].split("\n## ", 1)[0]
    out: Dict[int, Dict[str, int]] = {ORDINARY: {}, WRITE: {}}
    for kind in KINDS:
        m = re.search(r"^\| " + re.escape(kind) + r" \| (\d+) \| (\d+) \|", section, re.M)
        assert m, f"docs/architecture.md has no row for {kind!r}"
        out[ORDINARY][kind], out[WRITE][kind] = int(m.group(1)), int(m.group(2))
    return out


def test_the_architecture_docs_crossings_are_the_codes():
    counted = count_crossings()
    assert counted == documented(), counted


def test_an_ordinary_step_crosses_a_handful_of_times():
    """The bound the design keeps: per ordinary step a few calls each way, every hook of the
    default stack that is not due skipped in Rust (PeriodicWriter is not called)."""
    row = count_crossings()[ORDINARY]
    assert row["hooks called by the dispatcher"] == 3  # IterationTimer x2, LRScheduler
    assert row["Python → Rust, calls"] + row["Python → Rust, attribute stores"] <= 6
