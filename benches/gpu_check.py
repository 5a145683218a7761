#!/usr/bin/env python
"""The GPU check of issue 11: host-device synchronizations and steps/s on CUDA.

    python benches/gpu_check.py [--iters 200] [--n 2000] [--repeats 5] [--json out.json]

Without CUDA it says so and exits 0 (CI has no GPU). With CUDA, on the tiny MLP of
``lab.tiny_mlp`` (Linear 32→64, ReLU, Linear 64→1, batch 16, SGD momentum,
4 losses, data already on the device):

1. **Synchronizations.** hookloop's ``SimpleTrainer`` and ``AMPTrainer`` with IterationTimer +
   LRScheduler(MultiStepLR) + PeriodicWriter([printer, JSON, TensorBoard], 20), and a hook
   that puts a CUDA scalar tensor at every iteration (``put_scalar``, as model code puts
   accuracies from inside ``forward``), train with
   ``torch.cuda.set_sync_debug_mode`` on every iteration where nothing is written (from the
   end of the iteration before to the end of that one; write iterations run in the default
   mode). A first run in ``"warn"`` mode counts the synchronizations and where they come from;
   a second in ``"error"`` mode must finish without ``RuntimeError`` (the first one's
   iteration and place are reported). The hand-written loop is counted the same way, for
   comparison: torch's GradScaler synchronizes in ``step()`` by itself, so synchronizations
   made in ``torch/amp/grad_scaler.py`` are listed but not counted against hookloop.
2. **One transfer per read iteration.** The seeds' stack (the default stack plus
   ``PeriodicWriter([JSON, TensorBoard], 1)`` with ``window_size=1``) reads the losses at every
   iteration. On CUDA they stay deferred (the direct path of ``LossMetrics.read_every_step`` is
   for CPU losses) and are read in one batched copy per read: with the sync debug mode in
   ``"warn"`` from ``before_train`` to ``after_train``, exactly one synchronization per
   iteration must be counted (each is the loss copy; where they come from is listed).
3. **Speed.** steps/s of hookloop's trainer, the pure-Python detectron2-semantics reference's
   and a hand-written loop making the same model calls, with and without AMP (float16 with a
   GradScaler): medians over interleaved repetitions (``lab.overhead``'s) of the ratio to
   the hand-written loop, formed within each repetition. The default stack is also given as a
   fraction of a hand-written loop that does its own bookkeeping
   (``tiny_mlp.hand_loop_bookkeeping``: ``scheduler.step()`` every step, the losses read with
   one ``.item()`` and one line logged every 20 steps), as ``bench_mlp_paired.py`` does.

Exit status: 0 when hookloop's non-write iterations made no synchronization and the seeds'
stack made one per iteration, 1 otherwise (the report says where), 2 for a debug build.
Under a minute on one GPU.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

NO_CUDA = "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check."

PERIOD = 20

# torch.cuda.set_sync_debug_mode, or (--cpu-dry-run) a stand-in that records the modes set
set_mode: Any = torch.cuda.set_sync_debug_mode
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

        def after_train(self) -> None:
            set_mode("default")

    return SyncGuard()


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


def _count_syncs(fn: Any) -> Tuple[int, collections.Counter]:
    """Runs ``fn()`` recording the sync debug mode's warnings: their number and where."""
    where: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        finally:
            set_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where[_where(w.filename, w.lineno)] += 1
    return sum(where.values()), where


# torch's GradScaler reads found_inf with .item() in step() (unless the optimizer is fused):
# the hand-written AMP loop makes those synchronizations too, so they are listed, not counted
# against hookloop
INHERENT = ("torch/amp/grad_scaler.py",)


def _inherent(where: str) -> bool:
    return any(part in where for part in INHERENT)


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
            frames = traceback.extract_tb(x.__traceback__)
            where = _where(frames[-1].filename, frames[-1].lineno or 0) if frames else "?"
            return str(x).splitlines()[0], where
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


def _seeds_transfers(iters: int, tmpdir: str, device: torch.device) -> Dict[str, Any]:
    """The seeds' stack on ``device`` with the sync debug mode in "warn" over the whole loop:
    the synchronizations it made, per iteration (one each: the losses' one copy)."""
    from hookloop.engine.train_loop import HookBase
    from lab import tiny_mlp

    class Warn(HookBase):  # registered last: from before_train to the last iteration's end
        def before_train(self) -> None:
            set_mode("warn")

        def after_step(self) -> None:
            if self.trainer.iter == self.trainer.max_iter - 1:
                set_mode("default")  # after_train's closes are not counted

    batches = tiny_mlp.make_batches(device)
    t = tiny_mlp.make_trainer("hl", device, batches, iters, tmpdir, "seeds", extra=[Warn])
    count, where = _count_syncs(lambda: t.train(0, iters))
    counted = sum(v for k, v in where.items() if not _inherent(k))
    return {"what": "hookloop SimpleTrainer + the seeds' stack (every iteration read)",
            "iterations": iters, "syncs": count, "syncs_counted": counted,
            "per_iteration": counted / iters, "where": dict(where)}  # fmt: skip


@dataclass
class Figure:
    """The median over the repetitions and the best one (the highest steps/s or ratio)."""

    median: float
    best: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Figure:
        return cls(statistics.median(values), max(values))


def _speed(n: int, repeats: int, tmpdir: str, device: torch.device) -> List[Dict[str, Any]]:
    from lab import overhead, tiny_mlp

    batches = tiny_mlp.make_batches(device)
    rows = []
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
        row: Dict[str, Any] = {"amp": amp, "hand_steps_per_s": Figure.of([n / h for h in hand])}
        for key in variants:
            if key != "hand":
                row[key] = Figure.of([h / t for h, t in zip(hand, res[key])])
        for impl in ("hl", "ref"):
            runs = zip(res["hand-bk"], res[f"{impl}-stack"])
            row[f"{impl}-stack-over-bk"] = Figure.of([h / t for h, t in runs])
        rows.append(row)
    return rows


def _print_report(
    clean: Optional[bool],
    syncs: Sequence[Dict[str, Any]],
    speed: Sequence[Dict[str, Any]],
    n: int,
    device: torch.device,
    seeds: Optional[Dict[str, Any]] = None,
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
        False: "some: FAIL (see 'where')",
        None: "not checked (--cpu-dry-run: the sync debug mode is a stand-in on the CPU)",
    }[clean]
    print(f"hookloop's non-write iterations synchronized with the device: {verdict}")
    print()
    if seeds is not None:
        where = "; ".join(f"{k} ({v})" for k, v in sorted(seeds["where"].items()))
        print(f"## {seeds['what']}: {seeds['syncs_counted']} synchronizations in "
              f"{seeds['iterations']} iterations ({seeds['per_iteration']:.3f} per iteration, "
              f"1 expected); where: {where or '—'}")  # fmt: skip
        print()
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
        cells = [r[k] for k in keys]
        text = " | ".join(f"{c.median:,.3f} ({c.best:,.3f})" for c in cells)
        amp = ("float16" if device.type == "cuda" else "bfloat16") if r["amp"] else "no"
        print(f"| {amp} | {text} |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200, help="iterations of each sync check")
    p.add_argument("--n", type=int, default=2000, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    # the whole script on the CPU with a stand-in for the sync debug mode (for the tests)
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    global set_mode
    if args.cpu_dry_run:
        device = torch.device("cpu")
        set_mode = dry_run_modes.append
    elif not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    else:
        device = torch.device("cuda")
        set_mode = torch.cuda.set_sync_debug_mode

    import hookloop
    from lab import overhead

    if hookloop.BUILD_PROFILE != "release":
        print(f"gpu_check: hookloop._core is a {hookloop.BUILD_PROFILE!r} build; rebuild with "
              "`pip install -e .`", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(1)
    info = overhead.machine_info(["benches/gpu_check.py", *(argv or sys.argv[1:])])
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    for k, v in info.items():
        print(f"{k}: {v}")
    print(flush=True)
    t0 = time.perf_counter()
    tmpdir = tempfile.mkdtemp(prefix="hookloop-gpu-check-")
    with overhead.printer_logging():
        clean, syncs = _sync_checks(args.iters, tmpdir, device)
        seeds = _seeds_transfers(args.iters, tmpdir, device)
        speed = _speed(args.n, args.repeats, tmpdir, device)
    if not args.cpu_dry_run:  # (the stand-in counts no synchronization)
        clean = clean and seeds["syncs_counted"] == args.iters
    _print_report(None if args.cpu_dry_run else clean, syncs, speed, args.n, device, seeds)
    print(f"\ntotal: {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "clean": clean, "syncs": syncs, "seeds": seeds,
                       "speed": speed}, f,
                      indent=1, default=lambda o: getattr(o, "__dict__", str(o)))  # fmt: skip
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
