"""benches/bench_schedules.py runs (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[2] / "benches"


def test_bench_schedules_runs_every_variant() -> None:
    sys.path.insert(0, str(BENCHES))
    try:
        import bench_schedules
    finally:
        sys.path.remove(str(BENCHES))
    results = bench_schedules.run(repeats=1, iters=5, groups_list=[1, 3], collect=False)
    assert set(results) == {(g, v) for g in (1, 3) for v in bench_schedules.VARIANTS}
    text = bench_schedules.table(results, [1, 3])
    assert "LRScheduler hook, native" in text and "torch MultiStepLR.step()" in text
