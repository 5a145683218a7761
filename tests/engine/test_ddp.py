"""DistributedDataParallel training end to end on two gloo ranks spawned by ``launch`` on
127.0.0.1: identical weights, rank 0's metrics the mean of the ranks' own losses, files from
rank 0 only, a stop or a SIGTERM on one rank stopping both at the same iteration with one
checkpoint, exact resume on two ranks, and the hooks under DDP (no_sync between accumulation
steps, the eval barrier, PreciseBN per rank, the checkpointers saving once)."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import ddp_helpers
import pytest
import torch.distributed as dist
from hookloop.engine import Preempted, launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

# The process-group timeout: every collective, and so every run, is bounded by it (a rank
# that never joins fails the others within it, and launch then stops and reports them).
TIMEOUT = timedelta(seconds=60)
MAX_ITER = 12
PERIOD = 3  # gather_metric_period: metric collectives at iterations 2, 5, 8, 11
OPTS = {"max_iter": MAX_ITER, "period": PERIOD}


@pytest.fixture(scope="module", autouse=True)
def cpu_workers():
    """Workers see no GPU (gloo), also on a machine with GPUs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


def run(func, out: Path, *args, raises=None) -> list:
    results = out.parent / (out.name + "-results")
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    args = (str(out), str(results), *args)
    if raises is None:
        launch(func, 2, dist_url="auto", args=args, timeout=TIMEOUT)
    else:
        with pytest.raises(raises):
            launch(func, 2, dist_url="auto", args=args, timeout=TIMEOUT)
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]


def train(out: Path, raises=None, **opts) -> list:
    return run(ddp_helpers.train, out, {**OPTS, **opts}, raises=raises)


def metrics(out: Path) -> list:
    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ddp_helpers.TIMING} for r in rows]


def files(out: Path) -> set:
    return {p.name for p in out.iterdir() if not p.name.startswith("events.out.tfevents")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted two-rank run."""
    out = tmp_path_factory.mktemp("ddp") / "straight"
    return out, train(out)


def test_weights_equal_and_rank0_records_the_mean_of_the_ranks_losses(straight):
    out, (r0, r1) = straight
    for r in (r0, r1):
        assert (r["start"], r["iter"], r["stopped_early"], r["preempted"]) == (
            0,
            MAX_ITER,
            False,
            None,
        )
    assert r0["weights"] == r1["weights"]
    # Each rank saw its own data (TrainingSampler shards the stream).
    assert r0["losses"]["0"] != r1["losses"]["0"]
    rows = {row["iteration"]: row for row in metrics(out) if "total_loss" in row}
    assert sorted(rows) == [2, 5, 8, 11]  # every gather_metric_period iterations
    for it, row in rows.items():
        own = [r["losses"][str(it)] for r in (r0, r1)]
        for name in own[0]:
            assert row[name] == pytest.approx((own[0][name] + own[1][name]) / 2, rel=1e-12)
        totals = [sum(o.values()) for o in own]
        assert row["total_loss"] == pytest.approx(sum(totals) / 2, rel=1e-12)
    # One packed collective per metric period on each rank; one barrier per evaluation,
    # which runs on every rank (at iterations 3, 7 and after the last one).
    for r in (r0, r1):
        assert r["gathers"] == 4
        assert r["evals"] == [3, 7, MAX_ITER]
        assert r["barriers"] == 3
    # Every rank reads its own storage; the losses are put on the main process.
    assert "total_loss" in r0["storage"] and "total_loss" not in r1["storage"]
    assert "rank_data_time" in r1["storage"] and "val/mse" in r1["storage"]


def test_only_rank0_wrote_files(straight):
    out, (r0, r1) = straight
    assert r1["written"] == []
    renamed = [w.split(" ", 1)[1] for w in r0["written"] if w.startswith("rename ")]
    # Each checkpoint once (model_best at each of its improvements).
    assert [n for n in renamed if n != "model_best.pth"] == [
        "model_0000004.pth",
        "last_checkpoint",
        "model_0000009.pth",
        "last_checkpoint",
        "model_final.pth",
        "last_checkpoint",
    ]
    assert files(out) == {
        "metrics.json",
        "last_checkpoint",
        "model_0000004.pth",
        "model_0000009.pth",
        "model_final.pth",
        "model_best.pth",
    }
    assert len(list(out.glob("events.out.tfevents*"))) == 1


def _check_stopped_together(out: Path, results: list, at: int, preempted) -> None:
    for r in results:
        assert (r["iter"], r["stopped_early"], r["preempted"]) == (at, True, preempted)
    assert results[0]["weights"] == results[1]["weights"]
    assert results[1]["written"] == []
    assert (out / "last_checkpoint").read_text() == f"model_{at:07d}.pth"
    assert "model_final.pth" not in files(out)


def _check_resumed_exactly(out: Path, straight, at: int) -> None:
    ref_out, ref = straight
    resumed = train(out)
    for r, expected in zip(resumed, ref):
        assert (r["start"], r["iter"], r["stopped_early"]) == (at + 1, MAX_ITER, False)
        assert r["weights"] == expected["weights"]
        assert r["losses"] == {k: v for k, v in expected["losses"].items() if int(k) > at}
    assert resumed[1]["written"] == []
    assert metrics(out) == metrics(ref_out)
    # The stop's checkpoint besides the uninterrupted run's files.
    assert files(out) == files(ref_out) | {f"model_{at:07d}.pth"}


def test_request_stop_on_one_rank_stops_both_with_async_metric_writes(tmp_path):
    out = tmp_path / "stop"
    # Rank 1 asks after iteration 3. With asynchronous writes, the request goes out in the
    # collective of iteration 5 (on the writer thread, in a group of its own beside DDP's
    # all-reduces) and every rank takes it at the next period boundary, iteration 8. (The
    # resume from such a stop is checked after the SIGTERM below: the same checkpoint.)
    results = train(out, interrupt=["stop", 1, 3], **{"async": True})
    _check_stopped_together(out, results, 8, None)


def test_sigterm_on_one_rank_preempts_both_at_the_same_iteration(tmp_path, straight):
    out = tmp_path / "sigterm"
    # SIGTERM to rank 1 in iteration 6: its PreemptionHandler asks at the end of iteration 6
    # (or 7, if the handler runs late); either way the next collective is at iteration 8.
    # Both ranks raise Preempted (which the workers let out), and so does launch().
    results = train(out, raises=Preempted, interrupt=["sigterm", 1, 6])
    _check_stopped_together(out, results, 8, 143)
    _check_resumed_exactly(out, straight, 8)


def test_accumulation_reduces_gradients_only_when_stepping_and_precise_bn_per_rank(tmp_path):
    r0, r1 = run(ddp_helpers.accumulate, tmp_path / "acc", 2, 6)
    for r in (r0, r1):
        # OptimizationHook steps at iterations 1, 3, 5; between them, no_sync().
        assert r["reduced_at"] == [1, 3, 5]
        # PreciseBN ran on every rank over its own data, as detectron2's does.
        assert r["bn_mean"] == pytest.approx(r["bn_expected"], rel=1e-5, abs=1e-6)
    assert r0["weights"] == r1["weights"]
    assert r0["bn_mean"] != pytest.approx(r1["bn_mean"])
