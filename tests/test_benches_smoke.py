"""The benchmark code in benches/ runs, and its detectron2-style baseline writes what hookloop
writes. Sizes are tiny and no timing is asserted."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any, List, Tuple

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def _bench_module(name: str) -> Any:
    """A script of benches/ imported as a module (benches/ is on the tests' path, as the
    directory of the scripts is on theirs; it is not a package)."""
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def bench() -> Any:
    return _bench_module("bench_overhead")


def _lines(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_reference_metrics_json_is_byte_identical_to_hookloop(bench: Any, tmp_path: Path) -> None:
    hl_text, ref_text = bench.json_parity_run(str(tmp_path), n_iter=45, period=7)
    assert hl_text == ref_text
    lines = [json.loads(line) for line in hl_text.splitlines()]
    iterations = [line["iteration"] for line in lines]
    # every 7th iteration and the last, plus the separate lines of the late metric
    assert {6, 13, 20, 27, 34, 41, 44} <= set(iterations)
    assert any(set(line) == {"iteration", "late"} for line in lines)
    full = next(line for line in lines if line["iteration"] == 6)
    assert {"total_loss", "loss_a", "loss_d", "data_time", "rank_data_time", "lr"} <= set(full)


def _structure(path: Path) -> List[Tuple[int, List[str]]]:
    return [(line["iteration"], sorted(line)) for line in _lines(path)]


def test_default_stack_writes_the_same_files(bench: Any, tmp_path: Path) -> None:
    # Times differ between runs, so compare what is written, not the values.
    n, period = 23, 5
    for impl in ("hl", "ref"):
        d = tmp_path / impl
        d.mkdir()
        bench.make_stack_trainer(impl, period, n, str(d)).train(0, n)
    hl, ref = (
        _structure(tmp_path / "hl" / "metrics.json"),
        _structure(tmp_path / "ref" / "metrics.json"),
    )
    assert hl == ref
    assert [it for it, _ in hl] == [4, 9, 14, 19, 22]
    assert "time" in hl[-1][1] and "lr" in hl[-1][1] and "loss_cls" in hl[-1][1]
    for impl in ("hl", "ref"):
        events = list((tmp_path / impl).glob("events.out.tfevents.*"))
        assert len(events) == 1 and events[0].stat().st_size > 0


def test_every_benchmark_runs(bench: Any, tmp_path: Path) -> None:
    rows = bench.run_all(bench.Config.tiny(), str(tmp_path))
    assert {r.section for r in rows} == {"1", "2", "3", "3b", "4", "5", "6", "6b"}
    for r in rows:
        assert r.hookloop is not None
        for stat in (r.hookloop, r.reference):
            if stat is not None:
                assert math.isfinite(stat.median) and math.isfinite(stat.min)
    table = bench.format_table(rows)
    assert len(table.splitlines()) == len(rows) + 2
    assert all(r.met is not None for r in rows if r.target)


def test_main_refuses_a_debug_build(bench: Any, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setattr(bench.hookloop, "BUILD_PROFILE", "debug")
    assert bench.main(["--quick"]) == 2
    assert "debug" in capsys.readouterr().err


def test_only_runs_the_sections_named(bench: Any, tmp_path: Path) -> None:
    rows = bench.run_all(bench.Config.tiny(), str(tmp_path), only=["idle_hooks"])
    assert {r.section for r in rows} == {"3b"} and len(rows) == 5
    assert all(r.met is not None for r in rows if r.target)
    with pytest.raises(ValueError, match="unknown sections"):
        bench.run_all(bench.Config.tiny(), str(tmp_path), only=["nope"])


def test_native_schedule_gives_multistep_lrs(tmp_path: Path) -> None:
    """The native-schedule loops compare like with like: every trained iteration gets the LR
    torch's MultiStepLR gives it, for hookloop's schedule classes and the reference's."""
    import torch
    from lab import tiny_mlp

    n = 45

    def lrs(sched: Any, opt: torch.optim.Optimizer) -> List[float]:
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    _, opt, sched = tiny_mlp.build()
    expected = lrs(sched, opt)
    for impl in ("hl", "ref"):
        _, opt, _ = tiny_mlp.build()
        assert lrs(tiny_mlp.native_scheduler(impl, opt, n), opt) == expected, impl
    assert tiny_mlp.native_available("hl") and tiny_mlp.native_available("ref")
    # and the trainer built with it puts those LRs
    t = tiny_mlp.make_trainer("hl", torch.device("cpu"), tiny_mlp.make_batches(count=4), n,
                              str(tmp_path), "native")  # fmt: skip
    t.train(0, n)
    assert [v for v, _ in t.storage.history("lr").values()] == expected


def test_seeds_stack_writes_every_step_to_files_of_its_own(tmp_path: Path) -> None:
    """The seeds' loop (cvpods' and xmodaler's hooks): the default stack's files at period 20,
    and beside them a metrics file and an event directory of the every-step writers with a
    line and an event per iteration, unsmoothed (window_size=1), for hookloop and for the
    reference."""
    import torch
    from lab import overhead, tiny_mlp
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    n = 45
    for impl in ("hl", "ref"):
        out = tmp_path / impl
        out.mkdir()
        t = tiny_mlp.make_trainer(impl, torch.device("cpu"), tiny_mlp.make_batches(count=4), n,
                                  str(out), "seeds")  # fmt: skip
        with overhead.printer_logging():
            t.train(0, n)
        (d,) = out.iterdir()
        assert [line["iteration"] for line in _lines(d / "metrics.json")] == [19, 39, 44], impl
        assert len(list(d.glob("events.out.tfevents.*"))) == 1, impl
        every = _lines(d / overhead.EVERYSTEP_JSON)
        assert [line["iteration"] for line in every] == list(range(n)), impl
        # window_size 1: each line holds its own iteration's losses
        totals = [v for v, _ in t.storage.history("total_loss").values()]
        assert [line["total_loss"] for line in every] == totals, impl
        acc = EventAccumulator(str(d / overhead.EVERYSTEP_TB_DIR), size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("total_loss")] == list(range(n)), impl
    with pytest.raises(ValueError, match="hooks must be"):
        tiny_mlp.make_trainer("hl", torch.device("cpu"), [], 1, str(tmp_path), "seed")


def test_bookkeeping_loop_reads_and_logs_every_20_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    import torch
    from lab import tiny_mlp

    log = tiny_mlp.hand_logger()
    assert not log.propagate and log.isEnabledFor(logging.INFO)
    assert any(isinstance(h, logging.NullHandler) for h in log.handlers)
    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log.addHandler(handler)
    reads: List[int] = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or item(self))
    try:
        model, opt, sched = tiny_mlp.build()
        data = iter(tiny_mlp.make_batches(count=45))
        tiny_mlp.hand_loop_bookkeeping(model, opt, sched, data, 45)
    finally:
        log.removeHandler(handler)
    assert [r.getMessage().split()[:2] for r in records] == [["iter:", "19"], ["iter:", "39"]]
    assert "total_loss:" in records[0].getMessage() and "lr: 0.001" in records[0].getMessage()
    assert len(reads) == 2
    assert sched.last_epoch == 45  # stepped every step


def test_mlp_paired_runs_every_variant_and_names_the_goals(tmp_path: Path) -> None:
    bench_mlp_paired = _bench_module("bench_mlp_paired")
    out = tmp_path / "paired.json"
    assert bench_mlp_paired.main(["--rounds", "3", "--window", "4", "--warmup", "1",
                                  "--replicas", "2", "--json", str(out)]) == 0  # fmt: skip
    res = json.loads(out.read_text(encoding="utf-8"))
    assert set(res["variants"]) == set(bench_mlp_paired.VARIANTS)
    hand = res["variants"]["hand-written loop (model calls only)"]
    assert hand["x_hand"]["median"] == 1.0 and hand["x_hand"]["ci95"] == [1.0, 1.0]
    stack = res["variants"]["default stack (MultiStepLR)"]
    assert stack["x_hand"]["goal"] == 0.97 and stack["x_bookkeeping"]["goal"] == 0.99
    seeds = res["variants"][next(k for k, v in bench_mlp_paired.VARIANTS.items()
                                 if v.hooks == "seeds")]  # fmt: skip
    assert seeds["x_hand"]["goal"] is None  # issue 11's goals are for its loops only
    lo, hi = res["seeds_x_stack"]["ci95"]
    assert res["seeds_x_stack"]["median"] > 0 and lo <= hi
    assert res["replicas"] == 2
    for row in res["variants"].values():
        assert row["us_per_step"] > 0 and len(row["us_per_step_by_process"]) == 2
        lo, hi = row["x_hand"]["ci95"]
        assert lo <= hi
    for bad in (["--rounds", "0"], ["--replicas", "0"]):
        with pytest.raises(SystemExit):
            bench_mlp_paired.main(bad)


def test_mlp_paired_period_1_times_each_writer_alone_without_goals(tmp_path: Path) -> None:
    bench_mlp_paired = _bench_module("bench_mlp_paired")
    out = tmp_path / "paired.json"
    assert bench_mlp_paired.main(["--period-1", "--rounds", "2", "--window", "3", "--warmup", "0",
                                  "--replicas", "1", "--json", str(out)]) == 0  # fmt: skip
    res = json.loads(out.read_text(encoding="utf-8"))
    assert set(res["variants"]) == set(bench_mlp_paired.PERIOD_1)
    writers = {v.writers for v in bench_mlp_paired.PERIOD_1.values() if v.impl == "hl"}
    assert writers == {(), ("printer",), ("json",), ("tb",)}
    for name, row in res["variants"].items():
        # issue 11's goals are for the default period and writers, not these loops
        assert row["x_hand"]["goal"] is None and row["x_bookkeeping"]["goal"] is None, name


@pytest.mark.skipif(not Path("/proc/thread-self/status").exists(), reason="needs Linux /proc")
def test_runtime_bench_reports_every_figure_for_each_loop(tmp_path: Path) -> None:
    runtime = _bench_module("bench_mlp_runtime")
    out = tmp_path / "runtime.json"
    argv = ["--loops", "hand,stack1", "--rounds", "1", "--steps", "30", "--json", str(out)]
    assert runtime.main(argv) == 0
    res = json.loads(out.read_text(encoding="utf-8"))
    assert set(res["runs"]) == {"hand", "stack1"}
    keys = {"wall_us", "user_us", "sys_us", "other_threads_us", "other_threads_err_us",
            "minor_faults", "voluntary_switches", "involuntary_switches", "gc_collections",
            "gc_us"}  # fmt: skip
    for loop in ("hand", "stack1"):
        (run,) = res["runs"][loop]
        assert set(run) == keys
        assert run["wall_us"] > 0
        assert all(v >= 0 for k, v in run.items() if k != "other_threads_us")
        # The other threads' time is never negative, and the figure is within its stated
        # error of it: a loop with no other thread may come out below zero by that much (a
        # fixed bound failed on a loaded machine, where the clock reads are slow).
        assert run["other_threads_us"] >= -run["other_threads_err_us"]
    for bad in (["--loops", "nope"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            runtime.main(bad)


@pytest.fixture(scope="module")
def instructions() -> Any:
    return _bench_module("bench_mlp_instructions")


def test_instruction_bench_child_runs_every_loop_for_each_length(
    instructions: Any, capsys: pytest.CaptureFixture
) -> None:
    # natively (no valgrind): what callgrind would count, in the order the dumps come
    instructions.child(list(instructions.LOOPS), (2, 3))
    done = [line for line in capsys.readouterr().err.splitlines() if line.endswith(" done")]
    assert done == [f"{loop} {n} done" for loop in instructions.LOOPS for n in (2, 3)]


def test_instruction_bench_child_hands_every_printer_line_to_its_handler(
    instructions: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # the counted loops include logging's record and handler for each line, as the timed
    # benches do (a child that disabled INFO logging once left them out of every count)
    import logging

    records: List[logging.LogRecord] = []
    monkeypatch.setattr(logging.NullHandler, "handle", lambda self, r: records.append(r))
    root = logging.getLogger("hookloop")
    saved = root.level
    try:
        code = instructions.main(["--child", "--loops", "stack1", "--short", "2", "--long", "3"])
    finally:
        root.setLevel(saved)  # the child sets it; setLevel also clears loggers' cached levels
    assert code == 0
    lines = [r.getMessage() for r in records if r.name == "hookloop.utils.events"]
    # period 1: a line per iteration, of a 5-step warm-up and the counted run for each length
    assert len(lines) == (5 + 2) + (5 + 3) and all(" iter: " in line for line in lines)
    assert not [r for r in records if r.name == "hookloop.engine.train_loop"]
    capsys.readouterr()


def test_instruction_bench_per_step_is_the_difference_over_the_steps_between(
    instructions: Any, tmp_path: Path
) -> None:
    dumps = []
    for i, (ir, miss) in enumerate([(1_000, 10), (6_000, 60), (2_000, 0), (12_000, 5)]):
        f = tmp_path / f"cg.out.{i + 1}"
        f.write_text(f"version: 1\ncmd: x\nevents: Ir I1mr\nsummary: {ir} {miss}\n")
        dumps.append(instructions.parse_counts(str(f)))
    assert dumps[0] == {"Ir": 1_000, "I1mr": 10}
    steps = instructions.per_step(dumps, ["hand", "stack"], (100, 600))
    assert steps == {"hand": {"Ir": 10.0, "I1mr": 0.1}, "stack": {"Ir": 20.0, "I1mr": 0.01}}
    with pytest.raises(ValueError, match="3 callgrind dumps for 2 loops"):
        instructions.per_step(dumps[:3], ["hand", "stack"], (100, 600))
    bad = tmp_path / "not-callgrind"
    bad.write_text("hello\n")
    with pytest.raises(ValueError, match="not a callgrind output file"):
        instructions.parse_counts(str(bad))
    with pytest.raises(SystemExit):
        instructions.main(["--loops", "bogus"])
    with pytest.raises(SystemExit):
        instructions.main(["--short", "5", "--long", "5"])


def test_writers_instruction_bench_child_counts_each_piece_once_per_iteration() -> None:
    # natively (no valgrind), each piece in a process of its own as the bench runs it; the
    # child exits non-zero when the piece it wraps was not called once per iteration
    import subprocess

    script = str(BENCHES / "bench_writers_instructions.py")
    writers = _bench_module("bench_writers_instructions")
    for piece in writers.PIECES:
        done = subprocess.run(
            [sys.executable, script, "--child", piece, "--long", "5"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (piece, done.stderr[-2000:])
    for bad in (["--pieces", "bogus"], ["--short", "5", "--long", "5"]):
        with pytest.raises(SystemExit):
            writers.main(bad)


def test_compare_builds_child_runs_both_loops_on_its_own_copy_of_the_tiny_mlp(
    capsys: pytest.CaptureFixture,
) -> None:
    import torch
    from lab import tiny_mlp

    builds = _bench_module("bench_compare_builds")
    # the child's own copy of the model and data (for builds that lack hookloop.bench)
    model_cls, batches = builds.tiny_mlp()
    ours = tiny_mlp.make_batches()
    assert all(
        torch.equal(a, b) for (x, y), (u, v) in zip(batches, ours) for a, b in ((x, u), (y, v))
    )
    torch.manual_seed(0)
    theirs = model_cls()
    mine, _, _ = tiny_mlp.build()
    got, want = theirs(batches[0]), mine(batches[0])
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    # natively (no valgrind): both loops for each length, in the order the dumps come
    import logging

    events_log = logging.getLogger("hookloop.utils.events")
    before = (logging.getLogger("hookloop").level, events_log.level, list(events_log.handlers))
    assert builds.main(["--child", "--period", "1", "--short", "2", "--long", "3"]) == 0
    # and leaves logging as it found it
    after = (logging.getLogger("hookloop").level, events_log.level, list(events_log.handlers))
    assert after == before
    err = capsys.readouterr().err
    assert "hookloop from " in err
    done = [line for line in err.splitlines() if line.endswith(" done")]
    assert done == ["hand 2 done", "hand 3 done", "stack 2 done", "stack 3 done"]
    for bad in (["--period", "0"], ["--against", "/nonexistent"]):
        with pytest.raises(SystemExit):
            builds.main(bad)


def test_compare_builds_timed_takes_turns_with_another_build(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hookloop

    builds = _bench_module("bench_compare_builds")
    monkeypatch.syspath_prepend(str(BENCHES))  # the spawned children import the bench
    python_dir = str(Path(hookloop.__file__).resolve().parents[1])
    argv = ["--timed", "--period", "1", "--against", python_dir, "--rounds", "2",
            "--window", "2", "--replicas", "1", "--warmup", "0"]  # fmt: skip
    assert builds.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1].startswith("| this build |") and rows[1].endswith("| 1 |")  # rows[0]: header
    assert rows[2].startswith(f"| {python_dir} |") and len(rows) == 3
    for bad in (["--timed", "--rounds", "0"], ["--timed", "--replicas", "0"]):
        with pytest.raises(SystemExit):
            builds.main(bad)


def test_compare_builds_timed_child_refuses_a_build_it_did_not_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lab import paired

    builds = _bench_module("bench_compare_builds")
    monkeypatch.syspath_prepend(str(BENCHES))
    v = paired.Variant("elsewhere")

    def spawn(variant: Any, conn: Any, steps: int, tmp: str) -> Tuple[Any, Tuple[Any, ...]]:
        # no hookloop under tmp_path: the child finds the installed one, and must say so
        return builds.timed_child, (conn, str(tmp_path), "stack", 1, 2, steps, tmp)

    with pytest.raises(RuntimeError, match="imported hookloop from .*, not from"):
        paired.run([v], window=2, rounds=1, warmup=0, spawn=spawn)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_tracker_write_bench_times_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    trackers = _bench_module("bench_tracker_write")
    for name, value in trackers.QUIET.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_MODE", "offline")
    res = trackers.main(["--iters", "40"])
    assert "JSONWriter" in res
    for row in res.values():
        assert 0 < row["median_us"] <= row["p90_us"]
