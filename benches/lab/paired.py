"""Paired turns: the tiny MLP's loops timed side by side, a window of steps at a time.

Each variant (a hand-written loop, or an engine's trainer with some hooks) trains in processes
of its own, and the processes take turns: the parent lets one run ``window`` steps, then the
next, and so on round after round, in a fresh random order each round. Only one process runs
at a time, so they never compete for the CPU, and the windows of one round lie within a few
tens of milliseconds of each other: a ratio formed within a round compares the variants on
the same machine state. The median over hundreds of rounds is then steady on a shared machine
whose speed drifts by 5-10% within a minute, where whole runs timed one after another are not
(their ratios spread ±10%).

Each process also has a speed of its own: two processes running the same hand-written loop
differ steadily by up to 3% here (where the allocator put the model's tensors, which core
the process settles on). A variant therefore runs in ``replicas`` processes; a round's time of
a variant is the mean over its processes, and :func:`ratio_ci` resamples the processes as well
as the rounds, so that an interval covers that difference instead of hiding it.

The turn is taken inside the data iterator, which every variant calls once per step: every
``window`` steps it reads the clock (after waiting for the device), reports the window's time
to the parent and waits for its next turn. A window of 20 steps holds one write of the default
stack (period 20) and one log line of the bookkeeping hand loop, whatever the order.

Processes come from a ``forkserver`` (``spawn`` where there is none): a clean process that has
imported torch once, so children start in milliseconds and inherit no threads or locks.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "Variant", "HAND", "HAND_BOOKKEEPING", "GOALS", "Times", "Spawn", "run", "windows", "ratios",
    "ratio_ci", "bootstrap_ci",
]  # fmt: skip

#: seconds a child may take to start (import, build its model) and to run one window
START_TIMEOUT = 300.0
WINDOW_TIMEOUT = 120.0


@dataclass(frozen=True)
class Variant:
    """A loop of :mod:`lab.tiny_mlp`: ``impl`` is ``"hand"`` (the hand-written
    loop; ``hooks="bookkeeping"`` for the one that does its own bookkeeping) or an engine of
    ``tiny_mlp.make_trainer`` (``"hl"``, ``"ref"``, ``"d2"``) with its ``hooks``, writing every
    ``period`` iterations with ``writers`` (empty: those :func:`run` is given)."""

    impl: str
    hooks: str = "none"
    period: int = 20
    writers: Tuple[str, ...] = ()


HAND = Variant("hand")
HAND_BOOKKEEPING = Variant("hand", "bookkeeping")

#: Issue 11's goals for hookloop's trainer: (its hooks, the floor) -> the least steps/s ratio.
GOALS: Dict[Tuple[str, Variant], float] = {
    ("none", HAND): 0.99,
    ("stack", HAND): 0.97,
    ("stack", HAND_BOOKKEEPING): 0.99,
    ("native", HAND): 0.98,
}


def _turns(conn: Any, batches: Sequence[Any], window: int, device: Any) -> Iterator[Any]:
    """The batches, cycled; every ``window`` steps the window's seconds go to the parent and
    the next batch waits for this variant's next turn. ``b"q"`` instead of a turn ends the
    process on the spot: no exception unwinds the trainer, no hook runs, nothing is logged."""
    import torch

    cuda = device.type == "cuda"
    clock = time.perf_counter
    n = len(batches)
    i = 0
    start = 0.0
    while True:
        if i % window == 0:
            if i:
                if cuda:
                    torch.cuda.synchronize(device)
                conn.send(("window", clock() - start))
            if conn.recv_bytes() != b"g":
                conn.close()
                os._exit(0)  # the writers' files are scratch: nothing to flush
            start = clock()
        yield batches[i % n]
        i += 1


def _child(
    conn: Any, variant: Variant, device: str, window: int, steps: int, writers: Sequence[str],
    tmpdir: str, sys_path: List[str],
) -> None:  # fmt: skip
    """One variant's process: builds its loop, then trains until told to stop."""
    sys.path[:] = sys_path  # the parent's (a forkserver keeps the path it started with)
    try:
        import torch

        from lab import overhead, tiny_mlp

        torch.set_num_threads(1)
        dev = torch.device(device)
        batches = tiny_mlp.make_batches(dev)
        data = _turns(conn, batches, window, dev)
        with overhead.printer_logging():
            if variant.impl == "hand":
                bookkeeping = variant.hooks == "bookkeeping"
                tiny_mlp.time_hand(dev, batches, steps, bookkeeping=bookkeeping, data=data)
            else:
                t = tiny_mlp.make_trainer(
                    variant.impl, dev, batches, steps, tmpdir, variant.hooks,
                    period=variant.period, writers=variant.writers or writers, data=data,
                )  # fmt: skip
                t.train(0, steps)
        conn.send(("error", f"{variant} ended after {steps} steps, before it was stopped"))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    conn.close()
    os._exit(0)


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["lab.tiny_mlp"])
        return ctx
    return multiprocessing.get_context("spawn")


def _turn(conn: Any, variant: Variant, timeout: float) -> float:
    """Gives ``variant`` one turn; the seconds of its window."""
    try:
        conn.send_bytes(b"g")
    except OSError:
        pass  # it ended already: its report (an error) may still wait in the pipe
    try:
        if not conn.poll(timeout):
            raise RuntimeError(f"paired bench: {variant} reported nothing within {timeout:g} s")
        kind, value = conn.recv()
    except (OSError, EOFError):
        raise RuntimeError(
            f"paired bench: {variant}'s process ended without a report (a script that calls "
            "paired.run must do so under `if __name__ == '__main__':`)"
        ) from None
    if kind != "window":
        raise RuntimeError(f"paired bench: {variant} failed:\n{value}")
    return float(value)


#: Per variant, per process (replica), the seconds of its window in each round.
Times = Dict[Variant, List[List[float]]]


#: ``spawn(variant, conn, steps, tmpdir)``: the target of a variant's process and its
#: arguments, for loops that :func:`_child` does not build (other builds of hookloop:
#: ``benches/bench_compare_builds.py``). The target trains ``steps`` steps taking its turns
#: through :func:`_turns` on ``conn``; it runs in a fresh interpreter (``spawn``), so its
#: arguments should be plain values.
Spawn = Callable[[Variant, Any, int, str], Tuple[Callable[..., None], Tuple[Any, ...]]]


def run(
    variants: Sequence[Variant],
    *,
    device: Any = "cpu",
    window: int = 20,
    rounds: int = 300,
    warmup: int = 5,
    replicas: int = 1,
    writers: Sequence[str] = ("printer", "json", "tb"),
    tick: Optional[Callable[[], None]] = None,
    seed: int = 0,
    spawn: Optional[Spawn] = None,
) -> Times:
    """Seconds of the window of each of every variant's ``replicas`` processes in each of
    ``rounds`` rounds (after ``warmup`` untimed ones), in round order: ratios are formed
    between the entries of one round. Each round takes the processes in an order drawn from
    ``seed``. With ``spawn``, each process runs what it returns (see :data:`Spawn`)."""
    if window < 1 or rounds < 1 or warmup < 0 or replicas < 1:
        raise ValueError(f"window, rounds and replicas must be positive, warmup not negative; "
                         f"got {window}, {rounds}, {replicas}, {warmup}")  # fmt: skip
    if len(set(variants)) != len(variants):
        raise ValueError(f"variants must differ, got {list(variants)}")
    ctx = _context() if spawn is None else multiprocessing.get_context("spawn")
    steps = window * (warmup + rounds + 2)  # never reached: the parent stops them first
    tmpdir = tempfile.mkdtemp(prefix="hookloop-paired-")
    kids: List[Tuple[Variant, List[float], Any, Any]] = []
    times: Times = {v: [] for v in variants}
    order = random.Random(seed)
    try:
        for _ in range(replicas):
            for v in variants:
                ours, theirs = ctx.Pipe()
                if spawn is None:
                    target: Callable[..., None] = _child
                    args: Tuple[Any, ...] = (theirs, v, str(device), window, steps,
                                             tuple(writers), tmpdir, list(sys.path))  # fmt: skip
                else:
                    target, args = spawn(v, theirs, steps, tmpdir)
                p = ctx.Process(target=target, args=args, daemon=True)
                p.start()
                theirs.close()
                own: List[float] = []
                times[v].append(own)
                kids.append((v, own, p, ours))
        for r in range(warmup + rounds):
            turn = kids[:]
            order.shuffle(turn)
            for v, own, _, conn in turn:
                seconds = _turn(conn, v, START_TIMEOUT if r == 0 else WINDOW_TIMEOUT)
                if r >= warmup:
                    own.append(seconds)
            if tick is not None and r >= warmup:
                tick()
    finally:
        for _, _, _, conn in kids:
            try:
                conn.send_bytes(b"q")
            except OSError:
                pass  # it ended already
        for _, _, p, conn in kids:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(10.0)
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return times


def windows(times: Times, variant: Variant) -> List[float]:
    """The variant's seconds per window in each round: the mean over its processes."""
    return [statistics.fmean(w) for w in zip(*times[variant])]


def ratios(times: Times, floor: Variant, variant: Variant) -> List[float]:
    """The variant's steps/s over the floor's, one per round (each the mean over its
    processes)."""
    return [f / t for f, t in zip(windows(times, floor), windows(times, variant))]


def ratio_ci(
    times: Times, floor: Variant, variant: Variant, level: float = 0.95,
    resamples: int = 1000, seed: int = 0,
) -> Tuple[float, float]:  # fmt: skip
    """A bootstrap confidence interval of the median of :func:`ratios` (see
    :func:`bootstrap_ci`). With one process per variant it covers the rounds' noise only, not
    the processes' own speeds."""
    return bootstrap_ci(
        times, [floor, variant], lambda f, v: np.median(f / v), level, resamples, seed
    )


def bootstrap_ci(
    times: Times, variants: Sequence[Variant], statistic: Callable[..., Any],
    level: float = 0.95, resamples: int = 1000, seed: int = 0,
) -> Tuple[float, float]:  # fmt: skip
    """A bootstrap confidence interval of ``statistic(*w)``, where ``w`` holds each of
    ``variants``' seconds per window in every round (arrays over the rounds, each the mean
    over the variant's processes). Each resample draws every variant's processes and the
    rounds, with replacement (the percentile method, a fixed seed: the same times give the
    same interval); a variant named twice is drawn once."""
    unique = list(dict.fromkeys(variants))
    arrays = [np.asarray(times[v], dtype=np.float64) for v in unique]
    if any(a.size == 0 for a in arrays):
        raise ValueError("bootstrap_ci needs at least one round of each variant")
    n = arrays[0].shape[1]
    for v, a in zip(unique, arrays):
        if a.shape[1] != n:
            raise ValueError(f"bootstrap_ci: {n} rounds of {unique[0]}, {a.shape[1]} of {v}")
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    for b in range(resamples):
        cols = rng.integers(n, size=n)
        means = {
            v: a[rng.integers(a.shape[0], size=a.shape[0])][:, cols].mean(axis=0)
            for v, a in zip(unique, arrays)
        }
        stats[b] = statistic(*(means[v] for v in variants))
    stats.sort()
    lo = int((1 - level) / 2 * (resamples - 1))
    return float(stats[lo]), float(stats[resamples - 1 - lo])
