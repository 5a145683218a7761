"""What a tracker writer's ``write()`` costs the training thread: 20 scalars put per
iteration, ``write()`` timed alone at every iteration (period 1), for JSONWriter (the
reference), MLflowWriter (a local sqlite store, and a server that is not there) and WandbWriter
(offline). The sender threads run meanwhile, as in training.

    python benches/bench_tracker_write.py             # ~1 min
    python benches/bench_tracker_write.py --iters 300 # a quick look
    python benches/bench_tracker_write.py --rows JSON,sqlite  # the rows named (substrings)

Two builds side by side: run it once per build, alternating, with ``PYTHONPATH`` pointing at
each build's ``python/`` (docs/performance.md, "Trackers").

Prints the median and the 90th percentile per write() in microseconds, all measured in one run.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import hookloop
from hookloop.utils.events import EventStorage, JSONWriter

NAMES = [f"loss/{i:02d}" for i in range(20)]
QUIET = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "1",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
}


def _time_writes(make: Callable[[], Any], iters: int) -> List[float]:
    writer = make()
    out = []
    with EventStorage() as storage:
        for i in range(iters):
            storage.iter = i
            storage.put_scalars(**{n: 1.0 / (i + k + 1) for k, n in enumerate(NAMES)})
            t = time.perf_counter_ns()
            writer.write()
            out.append((time.perf_counter_ns() - t) / 1e3)
    writer.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Any = None) -> Dict[str, Dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument(
        "--rows", default="", help="comma-separated substrings of the rows to run (all if empty)"
    )
    args = parser.parse_args(argv)
    if hookloop.BUILD_PROFILE != "release":
        parser.error("hookloop._core is a debug build: pip install -e . first")
    quiet = logging.getLogger("hookloop")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the unreachable row's warnings
    try:
        return _rows(args)
    finally:
        quiet.setLevel(level)


def _rows(args: Any) -> Dict[str, Dict[str, float]]:
    for name, value in QUIET.items():  # the clients' retries, short; their output, off
        os.environ.setdefault(name, value)
    rows: Dict[str, Callable[[str], Any]] = {"JSONWriter": lambda d: JSONWriter(f"{d}/m.json")}
    try:
        from hookloop.utils.events import MLflowWriter

        rows["MLflowWriter, sqlite"] = lambda d: MLflowWriter(f"sqlite:///{d}/mlflow.db")
        rows["MLflowWriter, no server"] = lambda d: MLflowWriter(
            f"http://127.0.0.1:{_free_port()}", close_timeout=0.5
        )
    except ImportError:
        print("mlflow is not installed: its rows are skipped")
    try:
        from hookloop.utils.events import WandbWriter

        rows["WandbWriter, offline"] = lambda d: WandbWriter(mode="offline", dir=d)
    except ImportError:
        print("wandb is not installed: its row is skipped")
    wanted = [w for w in args.rows.split(",") if w]
    rows = {k: v for k, v in rows.items() if not wanted or any(w in k for w in wanted)}
    print(f"# write() with {len(NAMES)} scalars, every iteration, {args.iters} iterations")
    print(f"python {' '.join(sys.argv)}  (hookloop {hookloop.__version__})\n")
    print("| writer | median µs | p90 µs |\n|---|---|---|")
    results = {}
    for name, make in rows.items():
        with tempfile.TemporaryDirectory() as d:
            times = _time_writes(lambda make=make, d=d: make(d), args.iters)
        times = times[len(times) // 10 :]  # the first writes start threads, open stores
        median = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        results[name] = {"median_us": median, "p90_us": p90}
        print(f"| {name} | {median:.1f} | {p90:.1f} |")
    return results


if __name__ == "__main__":
    main()
