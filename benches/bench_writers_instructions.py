"""What each writer's ``write()`` costs the training thread per write, in CPU instructions:
the period-1 breakdown of the default stack, free of the machine's noise.

    python benches/bench_writers_instructions.py          # ~2 min (no torch: nothing to import)

A storage gets the scalars of the tiny MLP's default stack every iteration (what
``write_metrics``, IterationTimer and LRScheduler put: ``data_time``, ``rank_data_time``,
``total_loss`` and four losses, ``time``, ``lr``), and the three writers write after each one,
as ``PeriodicWriter(period=1)`` calls them. Each piece runs inside ``operator.call``, the only
thing valgrind's callgrind counts, in a process of its own, for ``--short`` and ``--long``
iterations; the difference of the two counts over the iterations between is the piece's
instructions per write. The pieces: the puts, all three writes, ``CommonMetricPrinter.write``
and three of its parts (the native formatting of the line, ``Logger.makeRecord``,
``Logger.handle`` with a ``NullHandler``), ``JSONWriter.write``, ``TensorboardXWriter.write``.
Only the training thread is counted: the writers' threads, which turn rows into lines and
events and write the files, are not.

The losses here are floats: reading tensors (the deferred losses' settle, which the first
writer of an iteration triggers) is counted by ``bench_mlp_instructions.py``'s period-1 loops.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, Optional, Sequence

# The callgrind plumbing of the tiny MLP's instruction bench, beside this script (no torch).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mlp_instructions import TOGGLE, callgrind_or_exit, parse_counts  # noqa: E402

PIECES = {
    "put": "the iteration's puts (9 scalars, 3 calls)",
    "all": "the three writers' write()",
    "printer": "CommonMetricPrinter.write()",
    "format": "… its native formatting of the line",
    "record": "… logging's makeRecord",
    "handle": "… logging's handle (a NullHandler)",
    "json": "JSONWriter.write()",
    "tb": "TensorboardXWriter.write()",
}


def child(piece: str, n: int) -> None:
    """``n`` iterations of puts and period-1 writes, ``piece`` inside ``operator.call``."""
    import hookloop.utils.events as events

    log = logging.getLogger(events.__name__)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(logging.NullHandler())
    out = tempfile.mkdtemp(prefix="hookloop-writers-instr-")
    # As on a machine without CUDA (no max_mem read), and without importing torch to ask.
    events._cuda_available = lambda: False
    printer = events.CommonMetricPrinter(max_iter=10 * n)
    json_writer = events.JSONWriter(os.path.join(out, "metrics.json"))
    tb_writer = events.TensorboardXWriter(out)

    calls = 0

    def counted(f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            return operator.call(f, *a, **k)

        return call

    native = printer._native

    class Native:  # the native printer, its format() counted
        format = staticmethod(counted(native.format))

    wrap: Dict[str, Callable[[], None]] = {
        "printer": lambda: setattr(printer, "write", counted(printer.write)),
        "json": lambda: setattr(json_writer, "write", counted(json_writer.write)),
        "tb": lambda: setattr(tb_writer, "write", counted(tb_writer.write)),
        "format": lambda: setattr(printer, "_native", Native()),
        "record": lambda: setattr(log, "makeRecord", counted(log.makeRecord)),
        "handle": lambda: setattr(log, "handle", counted(log.handle)),
    }
    if piece in wrap:
        wrap[piece]()

    def write() -> None:
        printer.write()
        json_writer.write()
        tb_writer.write()

    def put(storage: Any, i: int) -> None:
        storage.put_scalars(
            data_time=0.001 + (i % 3) * 1e-5, rank_data_time=0.001, total_loss=1.0 / (i + 3),
            loss_mse=0.5 / (i + 7), loss_l1=0.3 / (i + 11), loss_huber=0.2 / (i + 13),
            loss_reg=1e-4 / (i + 1),
        )  # fmt: skip
        storage.put_scalar("time", 0.00035 + (i % 11) * 1e-6)
        storage.put_scalar("lr", 0.001, smoothing_hint=False)

    gc.collect()
    gc.disable()
    try:
        with events.EventStorage(0) as storage:
            for i in range(n):
                storage.iter = i
                counted(put)(storage, i) if piece == "put" else put(storage, i)
                counted(write)() if piece == "all" else write()
    finally:
        gc.enable()
        json_writer.close()
        tb_writer.close()
        shutil.rmtree(out, ignore_errors=True)
    if calls != n:  # a piece the writers no longer call would count nothing
        raise SystemExit(f"{piece!r} ran {calls} times in {n} iterations, not once each")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--pieces", default=",".join(PIECES), help="of " + ",".join(PIECES))
    p.add_argument("--short", type=int, default=200)
    p.add_argument("--long", type=int, default=1000)
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--child", metavar="PIECE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.long)
        return 0
    if not 0 < args.short < args.long:
        p.error("--short and --long must be positive, --short below --long")
    pieces = args.pieces.split(",")
    bad = [x for x in pieces if x not in PIECES]
    if bad:
        p.error(f"unknown piece(s) {bad}: choose from {', '.join(PIECES)}")
    valgrind = callgrind_or_exit(p)

    out_dir = tempfile.mkdtemp(prefix="hookloop-callgrind-")
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # dict and set probing repeat from run to run
    per_write: Dict[str, float] = {}
    try:
        for piece in pieces:
            counts = []
            for n in (args.short, args.long):
                dump = os.path.join(out_dir, f"{piece}.{n}")
                cmd = [
                    valgrind, "--tool=callgrind", "--collect-atstart=no",
                    f"--toggle-collect={TOGGLE}", f"--callgrind-out-file={dump}",
                    sys.executable, os.path.abspath(__file__), "--child", piece, "--long", str(n),
                ]  # fmt: skip
                done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, env=env)  # fmt: skip
                if done.returncode != 0:
                    sys.stderr.write(done.stderr[-4000:])
                    raise SystemExit(f"the counted run of {piece!r} failed ({done.returncode})")
                counts.append(parse_counts(dump)["Ir"])
            per_write[piece] = (counts[1] - counts[0]) / (args.long - args.short)
            print(f"{piece} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    print("| piece | Ir per write |\n|---|---|")
    for piece, ir in per_write.items():
        print(f"| {PIECES[piece]} | {ir:,.0f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"per_write": per_write, "lengths": [args.short, args.long]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
