#!/usr/bin/env python
"""The GPU check of issue 11: host-device synchronizations and steps/s on CUDA.

    python benches/gpu_check.py [--iters 200] [--n 2000] [--repeats 5] [--json out.json]
                                [--graph-n 300] [--loader-n 300]
                                [--parts syncs,graph,loader,reads,speed] [--profile profile.txt]

Without CUDA it says so and exits 0 (CI has no GPU). With CUDA, on the tiny MLP of
``lab.tiny_mlp`` (Linear 32→64, ReLU, Linear 64→1, batch 16, SGD momentum,
4 losses, data already on the device), in parts:

1. **Synchronizations** (``syncs``). hookloop's ``SimpleTrainer`` and ``AMPTrainer`` with
   IterationTimer + LRScheduler(MultiStepLR) + PeriodicWriter([printer, JSON, TensorBoard], 20),
   and a hook that puts a CUDA scalar tensor at every iteration (``put_scalar``, as model code
   puts accuracies from inside ``forward``), train with
   ``torch.cuda.set_sync_debug_mode`` on every iteration where nothing is written (from the
   end of the iteration before to the end of that one; write iterations run in the default
   mode). A first run in ``"warn"`` mode counts the synchronizations and where they come from
   (by stack: torch's GradScaler when its frame is on the stack inside hookloop's, else
   hookloop's innermost frame, else the innermost frame outside torch); a second in
   ``"error"`` mode must finish without ``RuntimeError`` (the first one's iteration and place
   are reported; the mode is back to default as soon as a step raises, so ``after_train``'s
   writes run unchecked). torch's GradScaler synchronizes in ``step()`` by itself (the
   hand-written AMP loop too): in ``"warn"`` mode those are listed and not counted against
   hookloop, in ``"error"`` mode ``GradScaler.step`` and ``update`` run in the default mode.
   The hand-written loop is counted the same way, for comparison.
2. **One transfer per read** (``reads``). The default stack reads the losses at each write
   (every 20 iterations); the seeds' stack (the default stack plus ``PeriodicWriter([JSON,
   TensorBoard], 1)`` with ``window_size=1``) at every iteration. On CUDA they wait in the
   storage's pending queue and are read in one batched copy per read: with the sync debug mode
   in ``"warn"`` from ``before_train`` to the end of the last iteration, at most one
   synchronization per read may be counted (each is the loss copy; where they come from is
   listed). The default stack counts none: at the 20-iteration cap its copy is started without
   blocking, and the write waits on that copy's event, which torch's sync debug mode does not
   report (seen on an H200, torch 2.11); the seeds' stack, read before any copy started, counts
   one per read.
3. **Speed** (``speed``). steps/s of hookloop's trainer, the pure-Python detectron2-semantics
   reference's and a hand-written loop making the same model calls, with and without AMP
   (float16 with a GradScaler): medians over interleaved repetitions (``lab.overhead``'s) of
   the ratio to the hand-written loop, formed within each repetition. The default stack is
   also given as a fraction of a hand-written loop that does its own bookkeeping
   (``tiny_mlp.hand_loop_bookkeeping``: ``scheduler.step()`` every step, the losses read with
   one ``.item()`` and one line logged every 20 steps), as ``bench_mlp_paired.py`` does.
4. **CUDA graph** (``graph``). hookloop's ``CUDAGraphTrainer`` (the whole step captured as one
   CUDA graph, fused SGD with momentum, MultiStepLR) against the hand-written eager loop, on
   the tiny MLP (batch 16) and on a small CNN (3 blocks of conv3x3 + BN + ReLU + max-pool, a
   linear head; batch 128 of 3x32x32, cross-entropy), each without hooks and with the default
   stack, beside hand-made graphs of 1 and 4 steps per replay (no bookkeeping: the ceiling,
   and whether several steps per replay would pay): steps/s and the hand loop's time per step
   over theirs, formed within each of ``--repeats`` interleaved rounds in one process
   (``--graph-n`` steps per run). The trainer is timed after its capture iteration
   (``hookloop.bench.steady_clock``; its one-time before_train, warm-up and capture are given
   apart); below issue 34's goals (``GRAPH_GOALS``, + default stack) is a miss. Then the
   synchronizations per iteration of ``CUDAGraphTrainer`` + default stack (``"warn"`` mode from
   ``before_train`` to the last iteration, counted by iteration): the warm-up and capture
   iterations (``torch.cuda.graph`` synchronizes once at the capture), the write iterations
   (one read of the losses each, at most), and the other iterations after the capture, which
   must make none.
5. **Loaders** (``loader``, issue 44's honest baseline). Per model (the tiny MLP fed from
   50,000 × 32 samples in batches of 16; the small CNN from 80 batches of 128 3x32x32 images
   with RandomCrop(32, 4) + RandomHorizontalFlip made on the device), in ``--repeats``
   interleaved rounds of ``--loader-n`` steps in one process: the hand-written eager loop fed by
   ``DataLoader(TensorDataset, batch_size, shuffle=True, pin_memory=True)`` (each batch copied
   to the device; the CNN's augmentations on the device in the forward, ``DeviceAugment``)
   beside the same loop fed by pre-made device batches, the hand-made 1-step graph with static
   batches, and CUDAGraphTrainer + default stack fed by that DataLoader and by
   ``DeviceResidentLoader`` (its gather and augmentations captured in the graph); steps/s over
   the DataLoader-fed hand loop's, per round. Then the resident run's synchronizations per
   iteration (as in the graph part; the CNN's run crosses epochs). Issue 44's Done-when goals
   (``LOADER_GOALS``: >= 20x on the tiny MLP, >= 3x on the small CNN; >= ``LOADER_OF_BARE`` of
   the hand-made 1-step graph; no synchronization on an iteration after the capture that
   writes nothing) are reported met or missed; a missed one is a miss (the speed goals on CUDA
   only).
6. **Host profile** (``profile``, with ``--profile PATH``): cProfile of ``--profile-steps``
   steps of hookloop's ``SimpleTrainer`` + the default stack and of the bookkeeping hand loop
   (each after an unprofiled run of as many steps, whose steps/s are given), the top 25
   functions by own time written to PATH: where the host time of an eager step goes.

The parts run in the order syncs, graph, loader, reads, profile, speed, each in a child process
of its own under a timeout (``--timeout-scale`` scales them; ``--budget`` caps the whole run,
each part leaving 20 s to each one after it), so that a check ends in bounded time whatever fails: a
part that raises, is killed at its timeout, or does not exit after writing its results is
reported as such, with what it had finished (the speed part keeps its rows as it goes), and
the summary (``--json``) is always written, also when the script gets SIGTERM (a caller's
``timeout``). A child that outlives its timeout first dumps its threads' stacks to stderr.
``--in-process`` runs the parts in this process, without timeouts (the tests' dry run).

Exit status: 0 when every part finished, hookloop's non-write iterations made no
synchronization, each read of the losses made one and (on CUDA) the graph and loader parts met
their goals; 1 otherwise (the report and the JSON's ``misses`` say which); 2 for a debug build.
The speed part's figures are reported, not checked.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import faulthandler
import functools
import io
import itertools
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

NO_CUDA = "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check."

PERIOD = 20
# The graph part: CUDAGraphTrainer's warm-up steps (its default), the steps per replay of the
# hand-made graphs, the ratios over the hand loop it reports, and issue 34's goals for
# CUDAGraphTrainer + default stack over the hand loop (a miss below them, on CUDA).
GRAPH_WARMUP = 3
BARE_STEPS = (1, 4)
SPEEDUPS = ("bare-1", "bare-4", "graph-none", "graph-stack")
GRAPH_GOALS = {"mlp": 15.0, "cnn": 2.8}

# The loader part (issue 44): its variants, and its goals for CUDAGraphTrainer + default stack
# fed by DeviceResidentLoader: over the hand eager loop fed by the pinned DataLoader (a miss
# below them, on CUDA), and as a fraction of the hand-made 1-step graph with static batches.
LOADER_VARIANTS = ("hand", "hand-dl", "bare-1", "graph-dl", "graph-res")
LOADER_GOALS = {"mlp": 20.0, "cnn": 3.0}
LOADER_OF_BARE = 0.9

PARTS = ("syncs", "graph", "loader", "reads", "profile", "speed")  # in the order they run
# Seconds each part may take in its child process (times --timeout-scale). On an H200 with a
# slow host (an eager tiny-MLP step ~1.6 ms), the defaults of --iters, and the --n/--repeats
# of scripts/gpu_check.sh: well under each.
TIMEOUTS = {"syncs": 90.0, "graph": 75.0, "loader": 75.0, "reads": 60.0, "profile": 45.0,
            "speed": 200.0}  # fmt: skip
# With --budget, the seconds each part still to run keeps from the ones before it.
RESERVE = 20.0
# After a child has written its results, how long it may take to exit.
EXIT_GRACE = 10.0

# The sync debug mode's message ("warn": a UserWarning; "error": a RuntimeError). Other
# warnings (torch's one-time "Synchronization debug mode is a prototype feature ...") are not
# synchronizations.
SYNC_MESSAGE = "called a synchronizing CUDA operation"

# torch.cuda.set_sync_debug_mode / get_sync_debug_mode, or (--cpu-dry-run) stand-ins that
# record the modes set
set_mode: Any = torch.cuda.set_sync_debug_mode
get_mode: Any = torch.cuda.get_sync_debug_mode
dry_run_modes: List[Any] = []


def _writes_at(it: int, max_iter: int, period: int) -> bool:
    """Whether PeriodicWriter writes at the end of iteration ``it``."""
    return (it + 1) % period == 0 or it == max_iter - 1


def _guard(period: int, mode: str) -> Any:
    """A hook, registered last, that turns the sync debug mode on from the end of one
    iteration to the end of the next when nothing is written in that next one."""
    from hookloop.engine.train_loop import HookBase

    class SyncGuard(HookBase):
        def _set_for(self, it: int) -> None:
            max_iter = self.trainer.max_iter
            # after the last iteration, after_train's writes and closes run unchecked
            write = it >= max_iter or _writes_at(it, max_iter, period)
            set_mode("default" if write else mode)

        def before_train(self) -> None:
            self._set_for(self.trainer.start_iter)

        def after_step(self) -> None:
            self._set_for(self.trainer.iter + 1)

        def on_exception(self, exc: BaseException) -> None:
            # before any after_train: the writers' final write reads the losses, which in
            # "error" mode would raise again over the first error
            set_mode("default")

        def after_train(self) -> None:
            set_mode("default")

    return SyncGuard()


def _unchecked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run in the default sync debug mode, the mode before restored after it."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        before = get_mode()
        set_mode("default")
        try:
            return fn(*args, **kwargs)
        finally:
            set_mode(before)

    return call


# What _DevicePuts puts: model code's scalars on the device (detectron2 models put accuracies
# and counts from inside forward).
DEVICE_SCALAR = "gpu_check/device_scalar"


def _device_puts() -> Any:
    """A hook that puts a scalar tensor on the model's device at every iteration, before the
    step (inside the checked span): ``put_scalar`` must keep it unread."""
    from hookloop.engine.train_loop import HookBase

    class DevicePuts(HookBase):
        def before_train(self) -> None:
            self._x = torch.ones((), device=next(self.trainer.model.parameters()).device)

        def before_step(self) -> None:
            self.trainer.storage.put_scalar(DEVICE_SCALAR, self._x * 0.5)

    return DevicePuts()


def _where(filename: str, lineno: int) -> str:
    parts = filename.replace(os.sep, "/").split("/")
    return f"{'/'.join(parts[-3:])}:{lineno}"


# torch's GradScaler reads found_inf with .item() in step() (unless the optimizer is fused):
# the hand-written AMP loop makes those synchronizations too, so they are listed, not counted
# against hookloop
INHERENT = ("torch/amp/grad_scaler.py",)


def _inherent(where: str) -> bool:
    place = where.split(" ", 1)[0]
    return any(part in place for part in INHERENT)


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def _attribute(frames: Sequence[traceback.FrameSummary]) -> str:
    """Where a synchronization made with the stack ``frames`` (outermost first) belongs:
    walking outwards from the innermost frame, the first of torch's GradScaler or of hookloop
    decides (hookloop's AMPTrainer calls GradScaler.step, whose ``.item()`` is torch's);
    without either, the innermost frame outside torch (a hand-written loop's line). The
    innermost frame follows in parentheses when it is another."""
    if not frames:
        return "?"
    import hookloop

    hl, th = _package_dir(hookloop), _package_dir(torch)
    chosen = None
    for f in reversed(frames):
        name = f.filename.replace(os.sep, "/")
        if any(name.endswith(part) for part in INHERENT) or os.path.abspath(f.filename).startswith(
            hl
        ):
            chosen = f
            break
    if chosen is None:
        outside = [f for f in frames if not os.path.abspath(f.filename).startswith(th)]
        chosen = outside[-1] if outside else frames[-1]
    where = _where(chosen.filename, chosen.lineno or 0)
    inner = _where(frames[-1].filename, frames[-1].lineno or 0)
    return where if inner == where else f"{where} (in {inner})"


def _count_syncs(
    fn: Any, label: Optional[Callable[[str], str]] = None
) -> Tuple[int, collections.Counter]:
    """Runs ``fn()`` counting the sync debug mode's warnings by where they were made (by
    stack, :func:`_attribute`; ``label`` may rename each place, once per warning); other
    warnings are shown as usual."""
    where: collections.Counter = collections.Counter()
    show = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if SYNC_MESSAGE not in str(message):
            show(message, category, filename, lineno, *rest)
            return
        stack = traceback.extract_stack(sys._getframe(1))
        while stack and stack[-1].filename == warnings.__file__:
            stack.pop()  # warnings' own frames, between the caller and this function
        place = _attribute(stack)
        where[label(place) if label else place] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            fn()
        finally:
            set_mode("default")
    return sum(where.values()), where


def _first_sync_error(e: BaseException) -> Tuple[str, str]:
    """The first synchronization error in ``e``'s chain (a later one, raised by after_train
    while the mode was still "error", has the first as its context) and where it was made."""
    chain: List[BaseException] = []
    cur: Optional[BaseException] = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__context__
    for x in reversed(chain):
        if isinstance(x, RuntimeError) and "synchroniz" in str(x):
            return str(x).splitlines()[0], _attribute(traceback.extract_tb(x.__traceback__))
    return f"{type(e).__name__}: {e}", "?"


def _sync_checks(
    iters: int, tmpdir: str, device: torch.device
) -> Tuple[bool, List[Dict[str, Any]]]:
    from lab import tiny_mlp

    batches = tiny_mlp.make_batches(device)
    non_write = sum(not _writes_at(i, iters, PERIOD) for i in range(iters))
    results = []
    clean = True
    for amp in (False, True):
        name = "AMPTrainer" if amp else "SimpleTrainer"
        trainer: List[Any] = []

        def run(mode: str, amp: bool = amp, trainer: List[Any] = trainer) -> None:
            t = tiny_mlp.make_trainer(
                "hl", device, batches, iters, tmpdir, "stack", amp, PERIOD,
                extra=[_device_puts, lambda: _guard(PERIOD, mode)],
            )  # fmt: skip
            scaler = getattr(t, "grad_scaler", None)
            if mode == "error" and scaler is not None and scaler.is_enabled():
                # torch's own synchronization (found_inf's .item()), which "warn" lists
                scaler.step = _unchecked(scaler.step)
                scaler.update = _unchecked(scaler.update)
            trainer[:] = [t]
            t.train(0, iters)
            stored = len(t.storage.history(DEVICE_SCALAR).values())
            if stored != iters:
                raise RuntimeError(f"{DEVICE_SCALAR}: {stored} values stored for {iters} puts")

        count, where = _count_syncs(lambda: run("warn"))
        error = "finished"
        error_counts = True
        try:
            run("error")
        except Exception as e:
            message, at = _first_sync_error(e)
            error = f"{message} (iteration {trainer[0].iter}, {at})"
            error_counts = not _inherent(at)
        finally:
            set_mode("default")
        counted = sum(v for k, v in where.items() if not _inherent(k))
        clean = clean and counted == 0 and not (error != "finished" and error_counts)
        results.append(
            {"what": f"hookloop {name} + default stack", "iterations": iters,
             "non_write_iterations": non_write, "syncs": count, "syncs_counted": counted,
             "where": dict(where), "error_mode": error}
        )  # fmt: skip

        def hand(amp: bool = amp) -> None:
            model, opt, _ = tiny_mlp.build(device)
            enabled = tiny_mlp.amp_settings(device)[2]
            scaler = torch.amp.GradScaler(device.type, enabled=enabled) if amp else None
            set_mode("warn")
            tiny_mlp.hand_loop(model, opt, itertools.cycle(batches), iters, amp, scaler)

        count, where = _count_syncs(hand)
        results.append(
            {"what": "hand-written loop" + (" (AMP)" if amp else ""), "iterations": iters,
             "non_write_iterations": iters, "syncs": count,
             "syncs_counted": sum(v for k, v in where.items() if not _inherent(k)),
             "where": dict(where), "error_mode": "not run"}
        )  # fmt: skip
    return clean, results


def _reads(iters: int, tmpdir: str, device: torch.device) -> List[Dict[str, Any]]:
    """The default stack and the seeds' stack on ``device`` with the sync debug mode in
    "warn" over the whole loop: the synchronizations each made, and how many it reads the
    losses (each read is one batched copy, one synchronization): at each write of
    PeriodicWriter(20) for the default stack, at every iteration for the seeds' stack."""
    from hookloop.engine.train_loop import HookBase
    from lab import tiny_mlp

    class Warn(HookBase):  # registered last: from before_train to the last iteration's end
        def before_train(self) -> None:
            set_mode("warn")

        def after_step(self) -> None:
            if self.trainer.iter == self.trainer.max_iter - 1:
                set_mode("default")  # after_train's closes are not counted

    batches = tiny_mlp.make_batches(device)
    writes = sum(_writes_at(i, iters, PERIOD) for i in range(iters))
    rows = []
    for hooks, what, reads in (
        ("stack", f"hookloop SimpleTrainer + default stack (writes every {PERIOD})", writes),
        ("seeds", "hookloop SimpleTrainer + the seeds' stack (every iteration read)", iters),
    ):
        t = tiny_mlp.make_trainer("hl", device, batches, iters, tmpdir, hooks, extra=[Warn])
        count, where = _count_syncs(lambda t=t: t.train(0, iters))
        counted = sum(v for k, v in where.items() if not _inherent(k))
        rows.append({"what": what, "hooks": hooks, "iterations": iters, "reads": reads,
                     "syncs": count, "syncs_counted": counted, "per_read": counted / reads,
                     "where": dict(where)})  # fmt: skip
    return rows


def _figure(values: Sequence[float]) -> Dict[str, float]:
    """The median over the repetitions and the best one (the highest steps/s or ratio)."""
    return {"median": statistics.median(values), "best": max(values)}


def _speed(
    n: int,
    repeats: int,
    tmpdir: str,
    device: torch.device,
    done: Callable[[List[Dict[str, Any]]], None] = lambda rows: None,
) -> List[Dict[str, Any]]:
    """The speed rows (without AMP, then with); ``done(rows)`` after each one."""
    from lab import overhead, tiny_mlp

    batches = tiny_mlp.make_batches(device)
    rows: List[Dict[str, Any]] = []
    for amp in (False, True):
        variants = {
            "hand": lambda amp=amp: tiny_mlp.time_hand(device, batches, n, amp),
            "hand-bk": lambda amp=amp: tiny_mlp.time_hand(device, batches, n, amp, True),
        }
        for impl in ("hl", "ref"):
            for hooks in ("none", "stack", "seeds"):

                def f(impl: str = impl, hooks: str = hooks, amp: bool = amp) -> float:
                    t = tiny_mlp.make_trainer(impl, device, batches, n, tmpdir, hooks, amp)
                    return tiny_mlp.time_trainer(t, n)

                variants[f"{impl}-{hooks}"] = f
        for f in variants.values():
            f()  # untimed: first calls allocate, compile, fill caches
        res = overhead._interleaved(variants, repeats)
        hand = res["hand"]
        row: Dict[str, Any] = {"amp": amp, "n": n, "repeats": repeats}
        row["hand_steps_per_s"] = _figure([n / h for h in hand])
        for key in variants:
            if key != "hand":
                row[key] = _figure([h / t for h, t in zip(hand, res[key])])
        for impl in ("hl", "ref"):
            runs = zip(res["hand-bk"], res[f"{impl}-stack"])
            row[f"{impl}-stack-over-bk"] = _figure([h / t for h, t in runs])
        # each loop's own steps/s (the median of its repetitions)
        row["steps_per_s"] = {k: n / statistics.median(v) for k, v in res.items()}
        rows.append(row)
        done(rows)
    return rows


def _profile(n: int, path: str, tmpdir: str, device: torch.device) -> Dict[str, Any]:
    """cProfile of ``n`` steps of hookloop's SimpleTrainer + the default stack and of the
    bookkeeping hand loop, each after an unprofiled run of ``n`` steps; the top 25 functions
    by own time of each are written to ``path``, with the callers of the top 8. Returns the
    unprofiled steps/s."""
    from lab import tiny_mlp

    batches = tiny_mlp.make_batches(device)

    def stack() -> float:
        t = tiny_mlp.make_trainer("hl", device, batches, n, tmpdir, "stack")
        return tiny_mlp.time_trainer(t, n)

    def hand_bk() -> float:
        return tiny_mlp.time_hand(device, batches, n, False, True)

    runs = {
        "hookloop SimpleTrainer + default stack": stack,
        "hand-written loop with its own bookkeeping (.item() every 20 steps)": hand_bk,
    }
    out = io.StringIO()
    steps_per_s = {}
    for what, run in runs.items():
        steps_per_s[what] = n / run()  # unprofiled (the first run also warms up)
        prof = cProfile.Profile()
        prof.enable()
        seconds = run()
        prof.disable()
        out.write(f"## {what} on {device}: {n} steps, {steps_per_s[what]:,.1f} steps/s "
                  f"unprofiled, {n / seconds:,.1f} profiled\n")  # fmt: skip
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(25)
        stats.print_callers(8)  # who calls the top 8
    with open(path, "w", encoding="utf-8") as f:
        f.write(out.getvalue())
    return {"path": path, "steps": n, "steps_per_s": steps_per_s}


def _fmt(c: Any) -> str:
    return f"{c['median']:,.3f} ({c['best']:,.3f})"


def _print_report(
    clean: Optional[bool],
    syncs: Sequence[Dict[str, Any]],
    speed: Sequence[Dict[str, Any]],
    n: int,
    device: Any,
    reads: Sequence[Dict[str, Any]] = (),
) -> None:
    print("## Synchronizations on iterations where nothing is written")
    print()
    print("| run | non-write iterations | syncs (warn mode) | of which not GradScaler's "
          "| error mode | where (count) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in syncs:
        where = "; ".join(f"{k} ({v})" for k, v in sorted(r["where"].items(), key=lambda x: -x[1]))
        print(f"| {r['what']} | {r['non_write_iterations']} of {r['iterations']} | {r['syncs']} "
              f"| {r['syncs_counted']} | {r['error_mode']} | {where or '—'} |")  # fmt: skip
    print()
    print("torch's GradScaler synchronizes in step() by itself (the hand-written AMP loop too);")
    print("its synchronizations are listed but not counted against hookloop.")
    verdict = {
        True: "none: PASS",
        False: "some, or not checked to the end: FAIL (see 'where' and the misses)",
        None: "not checked (--cpu-dry-run: the sync debug mode is a stand-in on the CPU)",
    }[clean]
    print(f"hookloop's non-write iterations synchronized with the device: {verdict}")
    print()
    if reads:
        print("## Synchronizations over the whole loop: at most one per read of the losses")
        print()
        print("| run | iterations | reads | syncs counted | per read | where (count) |")
        print("|---|---|---|---|---|---|")
        for r in reads:
            where = "; ".join(f"{k} ({v})" for k, v in sorted(r["where"].items()))
            print(f"| {r['what']} | {r['iterations']} | {r['reads']} | {r['syncs_counted']} "
                  f"| {r['per_read']:.3f} | {where or '—'} |")  # fmt: skip
        print()
    if not speed:
        return
    print(
        f"## steps/s on {device}, as a fraction of the hand-written loop's (median (best), n={n})"
    )
    print()
    print("| AMP | hand loop steps/s | bookkeeping hand loop | hookloop, no hooks "
          "| hookloop + stack | hookloop + stack, × the bookkeeping loop | reference, no hooks "
          "| reference + stack | reference + stack, × the bookkeeping loop "
          "| hookloop + seeds' stack | reference + seeds' stack |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    keys = ("hand_steps_per_s", "hand-bk", "hl-none", "hl-stack", "hl-stack-over-bk",
            "ref-none", "ref-stack", "ref-stack-over-bk", "hl-seeds", "ref-seeds")  # fmt: skip
    for r in speed:
        text = " | ".join(_fmt(r[k]) for k in keys)
        amp = ("float16" if str(device).startswith("cuda") else "bfloat16") if r["amp"] else "no"
        print(f"| {amp} | {text} |")
    print()
    print("steps/s of each loop (median):")
    for r in speed:
        cells = ", ".join(f"{k} {v:,.1f}" for k, v in r["steps_per_s"].items())
        print(f"- AMP {'on' if r['amp'] else 'off'}: {cells}")


# -- the CUDA graph part ---------------------------------------------------------------------


class SmallCNN(torch.nn.Module):
    """3 blocks of conv3x3 + BN + ReLU + max-pool (3→32→64→128 channels, 32→4 pixels), a
    linear head to 10 classes; the cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        blocks: List[Any] = []
        for c_in, c_out in ((3, 32), (32, 64), (64, 128)):
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]  # fmt: skip
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(128 * 4 * 4, 10)

    def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
        x, y = batch
        logits = self.head(self.body(x).flatten(1))
        return {"loss_cls": torch.nn.functional.cross_entropy(logits, y)}


def _cnn_batches(device: torch.device, count: int = 8, batch: int = 128) -> List[Any]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, 3, 32, 32, generator=g).to(device),
         torch.randint(0, 10, (batch,), generator=g).to(device))
        for _ in range(count)
    ]  # fmt: skip


def _graph_model(which: str, device: torch.device) -> Tuple[Any, List[Any]]:
    from lab import tiny_mlp

    torch.manual_seed(0)
    if which == "mlp":
        return tiny_mlp.TinyMLP().to(device), tiny_mlp.make_batches(device)
    # The CPU dry run (the script's own test) takes batches of 8: 128 would take seconds.
    return SmallCNN().to(device), _cnn_batches(device, batch=128 if device.type == "cuda" else 8)


def _graph_hand(which: str, device: torch.device, n: int) -> float:
    """Seconds per step of ``n`` steps of the hand-written eager loop (SGD with momentum,
    torch's default foreach step) on a fresh model."""
    from lab import tiny_mlp

    model, batches = _graph_model(which, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = itertools.cycle(batches)
    _sync(device)
    t0 = time.perf_counter()
    tiny_mlp.hand_loop(model, opt, data, n)
    _sync(device)
    return (time.perf_counter() - t0) / n


def _graph_bare(which: str, device: torch.device, n: int, k: int) -> float:
    """Seconds per step of a hand-made CUDA graph of ``k`` training steps (torch's whole-network
    recipe through hookloop's capture seam: static batches, three warm-up steps on a side
    stream, then ``k`` times zero_grad (set_to_none), forward, loss sum, backward and the fused
    SGD step in one capture), replayed ``n // k`` times, each replay after copying ``k``
    batches into its static ones. With ``k = 1``: what a trainer with no bookkeeping at all
    reaches; ``k > 1``: whether several steps per replay would pay (issue 34's optional item).
    On the CPU (the dry run) the seam's eager implementation runs the steps at each replay."""
    model, batches = _graph_model(which, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=True)
    static = [tuple(torch.empty_like(t) for t in batches[0]) for _ in range(k)]
    data = itertools.cycle(batches)

    def stage() -> None:
        for dst in static:
            for d, src in zip(dst, next(data)):
                d.copy_(src, non_blocking=True)

    def steps() -> None:
        for batch in static:
            opt.zero_grad(set_to_none=True)
            sum(model(batch).values()).backward()
            opt.step()

    def staged_steps() -> None:
        stage()
        steps()

    # hookloop's capture seam, with nothing of the trainer around it
    from hookloop.engine.graph import CUDAStepGraph, EagerStepGraph

    seam = CUDAStepGraph(device) if device.type == "cuda" else EagerStepGraph()
    for _ in range(3):
        seam.warmup(staged_steps)
    seam.capture(steps, list(model.parameters()))
    replays = max(1, n // k)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(replays):
        stage()
        seam.replay()
    _sync(device)
    return (time.perf_counter() - t0) / (replays * k)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graph_trainer(which: str, device: torch.device, n: int, tmpdir: str, hooks: str,
                   extra: Sequence[Callable[[], Any]] = (),
                   loader: str = "batches") -> Any:  # fmt: skip
    """CUDAGraphTrainer (the seam's eager implementation on the CPU) on a fresh model, with the
    default stack or no hooks, fed by pre-made device batches (``loader="batches"``) or by a
    loader over :func:`_loader_data` (``"dataloader"``, ``"resident"``: :func:`_make_loader`)."""
    from hookloop.engine import CUDAGraphTrainer
    from lab import overhead

    model, batches = _graph_model(which, device)
    data: Any = itertools.cycle(batches)
    if loader != "batches":
        data, model = _make_loader(which, device, loader, model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [10**9], gamma=0.1)
    graph = "cuda" if device.type == "cuda" else "eager"
    t = CUDAGraphTrainer(model, data, opt, graph=graph, warmup_iters=GRAPH_WARMUP)
    hs: List[Any] = []
    if hooks == "stack":
        d = tempfile.mkdtemp(prefix=f"graph-{which}-", dir=tmpdir)
        hs = overhead.stack_hooks(overhead.engine("hl"), opt, sched, PERIOD, n, d)
    t.register_hooks(hs + [make() for make in extra])
    return t


def _graph_time(which: str, device: torch.device, n: int, tmpdir: str, hooks: str,
                setups: List[float], loader: str = "batches") -> float:  # fmt: skip
    """Seconds per step of CUDAGraphTrainer after its capture (``hookloop.bench.steady_clock``,
    registered last); its one-time ``before_train``, warm-up and capture go to ``setups``."""
    from hookloop import bench

    t = _graph_trainer(which, device, n, tmpdir, hooks, loader=loader)
    clock = bench.steady_clock(device, GRAPH_WARMUP)
    t.register_hooks([clock])
    t.train(0, n)
    setups.append(float(clock.setup()))
    return float(clock.per_step())


def _graph_syncs(which: str, device: torch.device, iters: int, tmpdir: str,
                 loader: str = "batches") -> Dict[str, Any]:  # fmt: skip
    """Synchronizations per iteration of CUDAGraphTrainer + default stack (fed as
    :func:`_graph_trainer` with ``loader``), the sync debug mode in "warn" from before_train to
    the end of the last iteration."""
    from hookloop.engine.train_loop import HookBase

    current = [-1]

    class Warn(HookBase):  # registered last
        def before_train(self) -> None:
            set_mode("warn")

        def before_step(self) -> None:
            current[0] = self.trainer.iter

        def after_step(self) -> None:
            if self.trainer.iter == self.trainer.max_iter - 1:
                set_mode("default")
                current[0] = -1

    per_iter: collections.Counter = collections.Counter()

    def at_iteration(place: str) -> str:
        per_iter[current[0]] += 1
        return f"iter {current[0]}: {place}"

    t = _graph_trainer(which, device, iters, tmpdir, "stack", extra=[Warn], loader=loader)
    warmup = GRAPH_WARMUP  # steps before the capture iteration
    _, where = _count_syncs(lambda: t.train(0, iters), at_iteration)
    writes = [i for i in range(iters) if _writes_at(i, iters, PERIOD)]
    after = [i for i in range(warmup + 1, iters) if i not in writes]
    return {
        "what": f"CUDAGraphTrainer + default stack, {which}" + LOADER_LABELS[loader],
        "iterations": iters,
        "warmup_and_capture": sum(per_iter[i] for i in range(warmup + 1)),
        "before_train": per_iter[-1],
        "write_iterations": len(writes),
        "syncs_on_writes": sum(per_iter[i] for i in writes),
        "non_write_iterations_after_capture": len(after),
        "syncs_after_capture_non_write": sum(per_iter[i] for i in after),
        "per_iteration": {str(k): v for k, v in sorted(per_iter.items())},
        "where": dict(where),
    }


def _graph_part(n: int, repeats: int, iters: int, tmpdir: str,
                device: torch.device) -> Dict[str, Any]:  # fmt: skip
    """Speed of CUDAGraphTrainer and of hand-made graphs over the hand-written eager loop, per
    round, and CUDAGraphTrainer's synchronizations per iteration."""
    from lab import overhead

    rows = []
    for which in ("mlp", "cnn"):
        setups: Dict[str, List[float]] = {"none": [], "stack": []}
        variants: Dict[str, Callable[[], float]] = {
            "hand": lambda which=which: _graph_hand(which, device, n),
            **{f"bare-{k}": lambda which=which, k=k: _graph_bare(which, device, n, k)
               for k in BARE_STEPS},
        }  # fmt: skip
        for hooks in ("none", "stack"):

            def f(
                which: str = which, hooks: str = hooks, into: List[float] = setups[hooks]
            ) -> float:
                return _graph_time(which, device, n, tmpdir, hooks, into)

            variants[f"graph-{hooks}"] = f
        for f in variants.values():
            f()  # untimed: first calls allocate, pick kernels, fill caches
        for v in setups.values():
            v.clear()
        res = overhead._interleaved(variants, repeats)  # seconds per step
        hand = res["hand"]
        row: Dict[str, Any] = {"model": which, "n": n, "repeats": repeats}
        row["steps_per_s"] = {k: 1 / statistics.median(v) for k, v in res.items()}
        for key in SPEEDUPS:
            ratios = [h / t for h, t in zip(hand, res[key])]
            row[f"{key}-speedup-per-round"] = ratios
            row[f"{key}-speedup"] = _figure(ratios)
        # The fraction of the bare graph's rate the trainer keeps, with its bookkeeping.
        row["graph-stack-of-bare"] = _figure(
            [b / t for b, t in zip(res["bare-1"], res["graph-stack"])]
        )
        row["setup_s"] = {k: statistics.median(v) for k, v in setups.items()}
        rows.append(row)
    syncs = [_graph_syncs(which, device, iters, tmpdir) for which in ("mlp", "cnn")]
    clean = all(r["syncs_after_capture_non_write"] == 0 for r in syncs)
    return {"graph": rows, "graph_syncs": syncs, "graph_clean": clean}


def _print_graph(part: Dict[str, Any], device: Any) -> None:
    rows, syncs = part.get("graph", []), part.get("graph_syncs", [])
    if rows:
        print(f"## CUDA graphs on {device}, over the hand-written eager loop (hand loop's time per "
              "step ÷ theirs, after the capture, median (best) of the rounds)")  # fmt: skip
        print()
        print("| model | steps | hand loop steps/s | hand-made graph, 1 step per replay "
              "| hand-made graph, 4 steps per replay | CUDAGraphTrainer, no hooks "
              "| CUDAGraphTrainer + stack | + stack ÷ hand-made (1) | trainer steps/s "
              "(no hooks, stack) | trainer's setup s (no hooks, stack) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            sps, setup = r["steps_per_s"], r["setup_s"]
            cells = " | ".join(_fmt(r[f"{k}-speedup"]) for k in SPEEDUPS)
            print(f"| {r['model']} | {r['n']} | {sps['hand']:,.1f} | {cells} "
                  f"| {_fmt(r['graph-stack-of-bare'])} | {sps['graph-none']:,.1f}, "
                  f"{sps['graph-stack']:,.1f} "
                  f"| {setup['none']:.3f}, {setup['stack']:.3f} |")  # fmt: skip
        print()
        print("Per round, CUDAGraphTrainer (no hooks; stack) over the hand loop: " + "; ".join(
            f"{r['model']}: " + " / ".join(
                ", ".join(f"{x:.2f}" for x in r[f"{k}-speedup-per-round"])
                for k in ("graph-none", "graph-stack"))
            for r in rows))  # fmt: skip
        print()
    if syncs:
        print("## CUDAGraphTrainer + default stack: synchronizations per iteration")
        print()
        print("| run | iterations | before_train | warm-up + capture | writes (syncs) "
              "| other iterations after the capture (syncs) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for r in syncs:
            print(f"| {r['what']} | {r['iterations']} | {r['before_train']} "
                  f"| {r['warmup_and_capture']} | {r['write_iterations']} ({r['syncs_on_writes']}) "
                  f"| {r['non_write_iterations_after_capture']} "
                  f"({r['syncs_after_capture_non_write']}) |")  # fmt: skip
        print()


# -- the loader part (issue 44) ----------------------------------------------------------------

# What _graph_syncs' rows add to their name, by how the trainer is fed.
LOADER_LABELS = {"batches": "", "dataloader": ", DataLoader (pinned)",
                 "resident": ", DeviceResidentLoader"}  # fmt: skip


@functools.cache
def _loader_data(which: str, device: torch.device) -> Tuple[List[torch.Tensor], int, List[Any]]:
    """The loader part's dataset on the CPU, its batch size and the augmentations made on the
    device: for the tiny MLP ``hookloop.bench``'s loader rows' 50,000 × 32 in batches of 16; for
    the small CNN 80 batches of 128 images of 3x32x32 and labels (whole batches: no short last
    batch, whose shape would be a second capture) with RandomCrop(32, 4) and
    RandomHorizontalFlip. The CPU dry run takes 16 batches of 8 images. Made once per model
    (the loaders only read them)."""
    from hookloop import bench
    from hookloop.data import RandomCrop, RandomHorizontalFlip

    if which == "mlp":
        return list(bench.loader_data()), bench.LOADER_BATCH, []
    batch = 128 if device.type == "cuda" else 8
    size = batch * (80 if device.type == "cuda" else 16)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(size, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (size,), generator=g)
    return [images, labels], batch, [RandomCrop(32, 4), RandomHorizontalFlip()]


class DeviceAugment(torch.nn.Module):
    """``model`` behind the augmentations of a DataLoader-fed run, made on the device in the
    forward (so a graph holds them too), drawing from ``Randoms`` by a device batch counter:
    the DataLoader's runs do the resident loader's device work per step."""

    def __init__(self, model: torch.nn.Module, augment: Sequence[Any], seed: int = 0) -> None:
        super().__init__()
        self.model, self.augment, self.seed = model, list(augment), seed
        device = next(model.parameters()).device
        self.register_buffer("count", torch.zeros((), dtype=torch.int64, device=device))

    def forward(self, batch: Any) -> Any:
        from hookloop.data.resident import Randoms

        x, rest = batch[0], list(batch[1:])
        randoms = Randoms(self.seed, self.count, x.device)
        for aug in self.augment:
            x = aug(x, randoms)
        self.count.add_(1)
        return self.model([x, *rest])


def _make_loader(which: str, device: torch.device, loader: str,
                 model: torch.nn.Module) -> Tuple[Any, torch.nn.Module]:  # fmt: skip
    """A fresh loader over :func:`_loader_data` and the model it feeds: ``"dataloader"``,
    ``DataLoader(TensorDataset, batch_size, shuffle=True, pin_memory=True)`` (pinned on CUDA;
    its batches stay on the host) and ``model`` behind :class:`DeviceAugment`; ``"resident"``,
    ``DeviceResidentLoader`` on ``device`` with the augmentations, and ``model``."""
    from hookloop.data import DeviceResidentLoader
    from torch.utils.data import DataLoader, TensorDataset

    tensors, batch, augment = _loader_data(which, device)
    if loader == "resident":
        return DeviceResidentLoader(tensors, batch, seed=0, device=device, augment=augment), model
    if loader != "dataloader":
        raise ValueError(f"unknown loader {loader!r}")
    pin = device.type == "cuda"
    data = DataLoader(TensorDataset(*tensors), batch, shuffle=True, pin_memory=pin)
    return data, DeviceAugment(model, augment) if augment else model


def _hand_dataloader(which: str, device: torch.device, n: int) -> float:
    """Seconds per step of ``n`` steps of the hand-written eager loop (as :func:`_graph_hand`)
    fed by the pinned DataLoader of :func:`_make_loader`, each batch copied to the device
    (``non_blocking``), a new epoch's iterator at each epoch's end."""
    from lab import tiny_mlp

    model, _ = _graph_model(which, device)
    loader, model = _make_loader(which, device, "dataloader", model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def batches() -> Any:
        while True:
            for b in loader:
                yield [t.to(device, non_blocking=True) for t in b]

    data = batches()
    _sync(device)
    t0 = time.perf_counter()
    tiny_mlp.hand_loop(model, opt, data, n)
    _sync(device)
    return (time.perf_counter() - t0) / n


def _loader_part(n: int, repeats: int, iters: int, tmpdir: str,
                 device: torch.device) -> Dict[str, Any]:  # fmt: skip
    """Per model, in interleaved rounds in one process: the hand-written eager loop fed by
    pre-made device batches (``hand``) and by the pinned DataLoader (``hand-dl``), the
    hand-made 1-step graph with static batches (``bare-1``), and CUDAGraphTrainer + default
    stack fed by the pinned DataLoader (``graph-dl``) and by DeviceResidentLoader (its batch
    made in the graph: ``graph-res``); each one's steps/s over ``hand-dl``'s and ``graph-res``'s
    over ``bare-1``'s, per round. Then CUDAGraphTrainer + default stack + DeviceResidentLoader's
    synchronizations per iteration, and issue 44's goals (:func:`_loader_goals`)."""
    from lab import overhead

    rows = []
    for which in ("mlp", "cnn"):
        setups: Dict[str, List[float]] = {"dataloader": [], "resident": []}

        def graphed(which: str = which, loader: str = "resident",
                    setups: Dict[str, List[float]] = setups) -> float:  # fmt: skip
            return _graph_time(which, device, n, tmpdir, "stack", setups[loader], loader)

        variants: Dict[str, Callable[[], float]] = {
            "hand": lambda which=which: _graph_hand(which, device, n),
            "hand-dl": lambda which=which: _hand_dataloader(which, device, n),
            "bare-1": lambda which=which: _graph_bare(which, device, n, 1),
            "graph-dl": functools.partial(graphed, loader="dataloader"),
            "graph-res": functools.partial(graphed, loader="resident"),
        }
        for f in variants.values():
            f()  # untimed: first calls allocate, pick kernels, fill caches
        for v in setups.values():
            v.clear()
        res = overhead._interleaved(variants, repeats)  # seconds per step
        row: Dict[str, Any] = {"model": which, "n": n, "repeats": repeats}
        row["steps_per_s"] = {k: 1 / statistics.median(v) for k, v in res.items()}
        for key in ("hand", "graph-dl", "graph-res"):
            ratios = [h / t for h, t in zip(res["hand-dl"], res[key])]
            row[f"{key}-over-hand-dl-per-round"] = ratios
            row[f"{key}-over-hand-dl"] = _figure(ratios)
        ratios = [b / t for b, t in zip(res["bare-1"], res["graph-res"])]
        row["graph-res-of-bare-per-round"] = ratios
        row["graph-res-of-bare"] = _figure(ratios)
        row["setup_s"] = {k: statistics.median(v) for k, v in setups.items()}
        rows.append(row)
    syncs = [_graph_syncs(which, device, iters, tmpdir, "resident") for which in ("mlp", "cnn")]
    clean = all(r["syncs_after_capture_non_write"] == 0 for r in syncs)
    return {"loader": rows, "loader_syncs": syncs, "loader_clean": clean,
            "goals": _loader_goals(rows, syncs)}  # fmt: skip


def _loader_goals(rows: Sequence[Dict[str, Any]],
                  syncs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:  # fmt: skip
    """Issue 44's Done-when goals on the GPU, each with the median it got and whether it is
    met: CUDAGraphTrainer + default stack + DeviceResidentLoader at >= LOADER_GOALS x the
    steps/s of the hand eager loop fed by the pinned DataLoader, and >= LOADER_OF_BARE of the
    hand-made 1-step graph's, per model; no synchronization on an iteration after the capture
    that writes nothing."""
    goals = []
    for r in rows:
        what = f"CUDAGraphTrainer + default stack + DeviceResidentLoader on the {r['model']}"
        got = r["graph-res-over-hand-dl"]["median"]
        goals.append({"goal": f"{what}: >= {LOADER_GOALS[r['model']]}x the steps/s of the hand "
                      "eager loop fed by the pinned DataLoader", "kind": "speed", "got": got,
                      "want": LOADER_GOALS[r["model"]],
                      "met": got >= LOADER_GOALS[r["model"]]})  # fmt: skip
        got = r["graph-res-of-bare"]["median"]
        goals.append({"goal": f"{what}: >= {LOADER_OF_BARE}x the steps/s of the hand-made "
                      "1-step graph with static batches", "kind": "speed", "got": got,
                      "want": LOADER_OF_BARE, "met": got >= LOADER_OF_BARE})  # fmt: skip
    for r in syncs:
        got = r["syncs_after_capture_non_write"]
        goals.append({"goal": f"{r['what']}: no synchronization on the "
                      f"{r['non_write_iterations_after_capture']} iterations after the capture "
                      "that write nothing", "kind": "syncs", "got": got, "want": 0,
                      "met": got == 0})  # fmt: skip
    return goals


def _print_loader(part: Dict[str, Any], device: Any, dry_run: bool) -> None:
    rows, syncs = part.get("loader", []), part.get("loader_syncs", [])
    if rows:
        print(f"## Loaders on {device}: steps/s over the hand eager loop fed by the pinned "
              "DataLoader (median (best) of the rounds, after the capture)")  # fmt: skip
        print()
        print("| model | steps | hand loop + DataLoader steps/s | hand loop, device batches "
              "| CUDAGraphTrainer + stack + DataLoader | CUDAGraphTrainer + stack + "
              "DeviceResidentLoader | + DeviceResidentLoader ÷ hand-made graph (1) "
              "| steps/s (hand, bare-1, graph-dl, graph-res) | trainer's setup s "
              "(DataLoader, resident) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            sps, setup = r["steps_per_s"], r["setup_s"]
            cells = " | ".join(_fmt(r[f"{k}-over-hand-dl"]) for k in ("hand", "graph-dl",
                                                                       "graph-res"))  # fmt: skip
            print(f"| {r['model']} | {r['n']} | {sps['hand-dl']:,.1f} | {cells} "
                  f"| {_fmt(r['graph-res-of-bare'])} | "
                  + ", ".join(f"{sps[k]:,.1f}" for k in ("hand", "bare-1", "graph-dl",
                                                          "graph-res"))
                  + f" | {setup['dataloader']:.3f}, {setup['resident']:.3f} |")  # fmt: skip
        print()
        print("Per round, + DeviceResidentLoader over the hand loop + DataLoader: " + "; ".join(
            f"{r['model']}: " + ", ".join(f"{x:.2f}" for x in r["graph-res-over-hand-dl-per-round"])
            for r in rows))  # fmt: skip
        print()
    if syncs:
        print("## CUDAGraphTrainer + default stack + DeviceResidentLoader: synchronizations per "
              "iteration")  # fmt: skip
        print()
        print("| run | iterations | before_train | warm-up + capture | writes (syncs) "
              "| other iterations after the capture (syncs) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for r in syncs:
            print(f"| {r['what']} | {r['iterations']} | {r['before_train']} "
                  f"| {r['warmup_and_capture']} | {r['write_iterations']} ({r['syncs_on_writes']}) "
                  f"| {r['non_write_iterations_after_capture']} "
                  f"({r['syncs_after_capture_non_write']}) |")  # fmt: skip
        print()
    goals = part.get("goals", [])
    if goals:
        print("## Issue 44's Done-when goals on the GPU")
        print()
        for g in goals:
            if dry_run and g["kind"] == "speed":
                verdict = "not judged (--cpu-dry-run)"
            else:
                verdict = "met" if g["met"] else "MISSED"
            got = f"{g['got']:.2f}x" if g["kind"] == "speed" else f"{g['got']} syncs"
            print(f"- {g['goal']}: {got}: {verdict}")
        print()


def _write_json(path: str, data: Dict[str, Any]) -> None:
    """Writes ``data`` to ``path`` whole or not at all (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _run_part(part: str, args: argparse.Namespace, device: torch.device, tmpdir: str,
              save: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:  # fmt: skip
    """Runs one part; ``save`` keeps what it has so far (the speed part's rows)."""
    if part == "syncs":
        clean, rows = _sync_checks(args.iters, tmpdir, device)
        return {"clean": clean, "syncs": rows}
    if part == "reads":
        return {"reads": _reads(args.iters, tmpdir, device)}
    if part == "graph":
        return _graph_part(args.graph_n, args.repeats, args.iters, tmpdir, device)
    if part == "loader":
        return _loader_part(args.loader_n, args.repeats, args.iters, tmpdir, device)
    if part == "speed":
        return {"speed": _speed(args.n, args.repeats, tmpdir, device,
                                lambda rows: save({"speed": rows, "partial": True}))}  # fmt: skip
    if part == "profile":
        return {"profile": _profile(args.profile_steps, args.profile, tmpdir, device)}
    raise ValueError(f"unknown part {part!r}")


def _child(part: str, result: str, args: argparse.Namespace, device: torch.device) -> int:
    """``--part``: one part in this process, its results written to ``result`` (JSON), also
    when it raises (then with the traceback). The parent's timeout bounds it; on SIGUSR1 (the
    parent's, before it kills a child at its timeout or for not exiting) faulthandler dumps
    every thread's stack to stderr: where it hung."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    tmpdir = tempfile.mkdtemp(prefix=f"hookloop-gpu-check-{part}-")

    def save(data: Dict[str, Any]) -> None:
        _write_json(result, {"part": part, **data})

    try:
        from lab import overhead

        with overhead.printer_logging():
            data = _run_part(part, args, device, tmpdir, save)
        save({"ok": True, **data})
        code = 0
    except Exception:
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        save({"ok": False, "error": text.strip().splitlines()[-1], "traceback": text})
        code = 1
    sys.stdout.flush()
    return code


# Set on SIGTERM to the parent (the ``timeout`` of scripts/gpu_check.sh, which sends SIGKILL
# 5 s later): the part running is ended, no other starts, and the summary is still written.
_stopped: List[int] = []


def _stop(signum: int, frame: Any) -> None:
    _stopped.append(signum)


def _spawn(part: str, timeout: float, argv: Sequence[str], tmpdir: str) -> Dict[str, Any]:
    """Runs ``part`` in a child process under ``timeout``; returns its results (what it
    wrote, when it was killed) with ``status`` ("ok", "failed", "timeout", "no exit",
    "stopped") and ``seconds``."""
    result = os.path.join(tmpdir, f"{part}.json")
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--part", part, "--result", result]
    print(f"### gpu_check part {part} (timeout {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd)
    written: Optional[float] = None
    status = None
    while child.poll() is None:
        now = time.perf_counter()
        if written is None and os.path.exists(result):
            try:
                with open(result, encoding="utf-8") as f:
                    finished = "ok" in json.load(f)
            except (OSError, ValueError):
                finished = False
            written = now if finished else None
        if _stopped:
            status = "stopped"
        elif now - t0 > timeout:
            status = "timeout"
        elif written is not None and now - written > EXIT_GRACE:
            status = "no exit"
        if status is not None:
            child.send_signal(signal.SIGUSR1)  # the child's stacks, to its stderr
            try:
                child.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
            child.kill()
            child.wait()
            break
        time.sleep(0.1)
    seconds = time.perf_counter() - t0
    data: Dict[str, Any] = {}
    try:
        with open(result, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        pass
    if status is None:
        status = "ok" if child.returncode == 0 and data.get("ok") else "failed"
    if status == "timeout":
        data["error"] = f"killed at its timeout ({timeout:.0f} s)"
    elif status == "stopped":
        data["error"] = "the check was stopped (SIGTERM: the caller's timeout)"
    elif status == "no exit":
        data["error"] = f"wrote its results but did not exit within {EXIT_GRACE:.0f} s (killed)"
    elif status == "failed" and "error" not in data:
        data["error"] = f"exit status {child.returncode}, no results written"
    data.update(status=status, seconds=round(seconds, 1))
    print(f"### gpu_check part {part}: {status} in {seconds:.1f} s", flush=True)
    return data


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200, help="iterations of each sync check")
    p.add_argument("--n", type=int, default=2000, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    p.add_argument("--graph-n", type=int, default=300,
                   help="steps per timed run of the graph part")  # fmt: skip
    p.add_argument("--loader-n", type=int, default=300,
                   help="steps per timed run of the loader part")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--parts",
        default="syncs,graph,loader,reads,speed",
        help=f"comma-separated, of {', '.join(PARTS)} (profile: with --profile)",
    )
    p.add_argument("--profile", metavar="PATH", help="run the host profile; its report to PATH")
    p.add_argument("--profile-steps", type=int, default=500, help="steps profiled per loop")
    p.add_argument("--timeout-scale", type=float, default=1.0,
                   help="multiplies each part's timeout (" +
                   ", ".join(f"{k} {v:.0f} s" for k, v in TIMEOUTS.items()) + ")")  # fmt: skip
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="the whole check's seconds: a part's timeout is cut to leave "
                   f"{RESERVE:.0f} s to each part after it")  # fmt: skip
    p.add_argument("--in-process", action="store_true",
                   help="run the parts in this process, without timeouts")  # fmt: skip
    # the whole script on the CPU with a stand-in for the sync debug mode (for the tests)
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    # internal: one part in this process, its results to --result (the parent's child)
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    wanted = [x for x in args.parts.split(",") if x] + (["profile"] if args.profile else [])
    for x in wanted:
        if x not in PARTS:
            p.error(f"--parts: unknown part {x!r} (known: {', '.join(PARTS)})")
    args.part_list = [x for x in PARTS if x in wanted]
    if "profile" in args.part_list and not args.profile:
        p.error("--parts profile needs --profile PATH")
    return args


def _misses(parts: Dict[str, Dict[str, Any]], iters: int, dry_run: bool) -> List[str]:
    misses = []
    for name, r in parts.items():
        if r["status"] != "ok":
            misses.append(f"part {name}: {r['status']}: {r.get('error', '')}")
    graph = parts.get("graph")
    if graph is not None and graph["status"] == "ok" and not graph.get("graph_clean"):
        misses.append("graph: CUDAGraphTrainer synchronized on an iteration after the capture "
                      "that wrote nothing")  # fmt: skip
    if graph is not None and graph["status"] == "ok" and not dry_run:
        for r in graph.get("graph", []):
            got, goal = r["graph-stack-speedup"]["median"], GRAPH_GOALS[r["model"]]
            if got < goal:
                what = f"CUDAGraphTrainer + default stack on the {r['model']}"
                misses.append(f"graph: {what} ran {got:.2f}x the hand loop's steps/s; the "
                              f"goal is {goal}x")  # fmt: skip
    loader = parts.get("loader")
    if loader is not None and loader["status"] == "ok":
        for g in loader.get("goals", []):
            if not g["met"] and (g["kind"] == "syncs" or not dry_run):
                misses.append(f"loader: {g['goal']}: got {g['got']:.4g}")
    syncs = parts.get("syncs")
    if syncs is not None and syncs["status"] == "ok" and not syncs.get("clean"):
        misses.append("syncs: hookloop synchronized on an iteration that wrote nothing")
    reads = parts.get("reads")
    if reads is not None and reads["status"] == "ok" and not dry_run:
        for r in reads["reads"]:
            if r["syncs_counted"] > r["reads"]:
                misses.append(f"reads: {r['what']}: {r['syncs_counted']} synchronizations for "
                              f"{r['reads']} reads of the losses")  # fmt: skip
    return misses


def main(argv: Optional[Sequence[str]] = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _parse(raw)
    global set_mode, get_mode
    if args.cpu_dry_run:
        device = torch.device("cpu")
        set_mode = dry_run_modes.append
        get_mode = lambda: dry_run_modes[-1] if dry_run_modes else "default"  # noqa: E731
    elif not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    else:
        device = torch.device("cuda")
        set_mode = torch.cuda.set_sync_debug_mode
        get_mode = torch.cuda.get_sync_debug_mode

    import hookloop
    from lab import overhead

    if hookloop.BUILD_PROFILE != "release":
        print(f"gpu_check: hookloop._core is a {hookloop.BUILD_PROFILE!r} build; rebuild with "
              "`pip install -e .`", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(1)
    if args.part is not None:
        return _child(args.part, args.result, args, device)
    if not args.in_process:
        signal.signal(signal.SIGTERM, _stop)
    info = overhead.machine_info(["benches/gpu_check.py", *raw])
    info["hookloop_path"] = os.path.dirname(hookloop.__file__)
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    for k, v in info.items():
        print(f"{k}: {v}")
    print(flush=True)
    t0 = time.perf_counter()
    parts: Dict[str, Dict[str, Any]] = {}
    tmpdir = tempfile.mkdtemp(prefix="hookloop-gpu-check-")
    # the child's arguments: this one's, less what only the parent does
    child_argv = [a for a in raw if a != "--in-process"]
    if args.json:
        i = child_argv.index("--json") if "--json" in child_argv else -1
        child_argv = child_argv[:i] + child_argv[i + 2 :] if i >= 0 else child_argv
    for k, part in enumerate(args.part_list):
        timeout = TIMEOUTS[part] * args.timeout_scale
        if args.budget is not None:
            left = args.budget - (time.perf_counter() - t0)
            timeout = min(timeout, left - RESERVE * (len(args.part_list) - k - 1))
            if timeout < 5.0:
                print(f"### gpu_check part {part}: not run ({left:.0f} s of --budget left)")
                break
        if args.in_process:
            t1 = time.perf_counter()
            with overhead.printer_logging():
                data = _run_part(part, args, device, tmpdir, lambda data: None)
            data.update(status="ok", seconds=round(time.perf_counter() - t1, 1))
        else:
            data = _spawn(part, timeout, child_argv, tmpdir)
        parts[part] = data
        if _stopped:
            break
    for part in args.part_list:
        why = "stopped before it" if _stopped else "no time left of --budget"
        parts.setdefault(part, {"status": "not run", "seconds": 0, "error": why})
    syncs_part = parts.get("syncs", {})
    clean: Optional[bool] = bool(syncs_part.get("clean")) and syncs_part["status"] == "ok"
    if "syncs" not in parts or args.cpu_dry_run:
        clean = None
    _print_report(clean, syncs_part.get("syncs", []), parts.get("speed", {}).get("speed", []),
                  args.n, device, parts.get("reads", {}).get("reads", ()))  # fmt: skip
    if parts.get("graph", {}).get("graph"):
        _print_graph(parts["graph"], device)
    if parts.get("loader", {}).get("loader"):
        _print_loader(parts["loader"], device, args.cpu_dry_run)
    if "profile" in parts and parts["profile"]["status"] == "ok":
        p = parts["profile"]["profile"]
        print(f"\n## host profile: {p['path']} (steps/s unprofiled: "
              + ", ".join(f"{k} {v:,.1f}" for k, v in p["steps_per_s"].items()) + ")")  # fmt: skip
    misses = _misses(parts, args.iters, args.cpu_dry_run)
    print(f"\ntotal: {time.perf_counter() - t0:.1f} s")
    print("parts: " + ", ".join(f"{k} {v['status']} ({v['seconds']} s)" for k, v in parts.items()))
    for m in misses:
        print(f"MISS: {m}")
    if args.json:
        _write_json(args.json, {"machine": info, "clean": clean, "misses": misses,
                                "parts": parts})  # fmt: skip
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
