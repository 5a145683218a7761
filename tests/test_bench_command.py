"""``hookloop bench`` and ``benches/gpu_check.py``: they run, print their table and JSON, measure
a user's hook, and turn mistakes into one-line usage errors. Sizes are tiny (the hidden
``--smoke``) and no timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import torch
from hookloop.__main__ import main

ROOT = Path(__file__).resolve().parents[1]

HOOK_MODULE = '''
import json
from hookloop.engine.train_loop import HookBase


class CountSteps(HookBase):
    """Counts after_step calls (times ``scale``) and appends the count at after_train."""

    def __init__(self, out="steps.jsonl", scale=1):
        self.out, self.scale, self.calls = out, scale, 0

    def after_step(self):
        self.calls += self.scale

    def after_train(self):
        with open(self.out, "a") as f:
            f.write(json.dumps({"calls": self.calls, "max_iter": self.trainer.max_iter}) + "\\n")


class NeedsArg(HookBase):
    def __init__(self, required):
        self.required = required


NOT_A_CLASS = 3
'''


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return env


def _finite(fig: Any) -> bool:
    return fig is not None and math.isfinite(fig["median"]) and math.isfinite(fig["best"])


def test_python_m_hookloop_bench_is_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hookloop", "bench", "--help"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for option in ("--quick", "--json", "--device", "--hook", "--hook-args", "--only"):
        assert option in proc.stdout
    assert "--smoke" not in proc.stdout


def test_bench_quick_prints_a_table_and_json_and_measures_a_hook(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    (tmp_path / "user_hooks.py").write_text(HOOK_MODULE, encoding="utf-8")
    out = tmp_path / "bench.json"
    # run from the hook's directory, as a user would: the command finds modules in the cwd
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "user_hooks", raising=False)
    argv = ["bench", "--quick", "--smoke", "--json", str(out)]
    argv += ["--hook", "user_hooks:CountSteps", "--hook-args", '{"scale": 2}']
    assert main(argv) == 0
    proc = capsys.readouterr()
    table = [line for line in proc.out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| section | measurement | unit | bare loop | hookloop | reference")
    assert table[0].endswith("| n × repeats | target | met |")
    sections = {line.split("|")[1].strip() for line in table[2:]}
    assert sections == {"dispatch", "stack", "mlp", "storage", "hook"}
    assert "build_profile: release" in proc.out
    assert "%" in proc.err  # the progress bar (tqdm, or the plain line without it)

    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["machine"]["build_profile"] == "release"
    assert data["machine"]["command"].startswith("hookloop bench --quick --smoke")
    assert data["engines"][:2] == ["hookloop", "reference"]
    assert len(data["rows"]) == len(table) - 2
    for row in data["rows"]:
        assert {"section", "what", "unit", "n", "bare", "hookloop", "reference", "detectron2",
                "reference_over_hookloop", "higher_is_better"} <= set(row)  # fmt: skip
        assert _finite(row["hookloop"]), row
    by_section: dict = {}
    for r in data["rows"]:
        by_section.setdefault(r["section"], r)  # each section's first row
    assert _finite(by_section["dispatch"]["reference"]) and _finite(by_section["dispatch"]["bare"])
    assert by_section["mlp"]["higher_is_better"] and _finite(by_section["mlp"]["reference"])
    _check_mlp_rows(data["rows"], table)
    hook_rows = [r for r in data["rows"] if r["section"] == "hook"]
    assert len(hook_rows) == 2 and "user_hooks:CountSteps" in hook_rows[0]["what"]
    # one untimed warm-up run and the timed repetitions, each a full train() with the hook
    runs = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(runs) == 1 + data["sizes"]["hook_repeats"]
    assert all(r["calls"] == 2 * r["max_iter"] == 2 * data["sizes"]["hook_n"] for r in runs)


MLP_ROWS = [
    # (what the row names, its unit, its target)
    ("SimpleTrainer, no hooks", "× hand loop's steps/s", 0.99),
    ("LRScheduler(MultiStepLR)", "× hand loop's steps/s", 0.97),
    ("the user's own bookkeeping", "× bookkeeping hand loop's steps/s", 0.99),
    ("LRScheduler(LRMultiplier(WarmupParamScheduler(MultiStepParamScheduler))",
     "× hand loop's steps/s", 0.98),
]  # fmt: skip


def _check_mlp_rows(rows: List[dict], table: List[str]) -> None:
    """The mlp section's four rows, in order, each with its goal; met is hookloop's median
    against it (no timing is asserted: only that the verdict follows from the figures)."""
    mlp = [r for r in rows if r["section"] == "mlp"]
    assert len(mlp) == len(MLP_ROWS)
    for row, (what, unit, target) in zip(mlp, MLP_ROWS):
        assert what in row["what"] and row["unit"] == unit, row
        assert row["higher_is_better"] and row["target_value"] == target
        assert row["target"] == f"≥ {target:g}"
        assert row["met"] == (row["hookloop"]["median"] >= target)
        assert _finite(row["hookloop"]) and _finite(row["reference"]), row
        lo, hi = row["hookloop"]["ci95"]
        assert lo <= hi and row["settled"] == (not lo < target < hi)
    # the two floors: the hand-written loops' steps/s
    assert _finite(mlp[0]["bare"]) and _finite(mlp[2]["bare"])
    lines = [line for line in table if line.startswith("| mlp |")]
    for line, row in zip(lines, mlp):
        cells = [c.strip() for c in line.strip("|").split("|")]
        verdict = ("yes" if row["met"] else "**no**") + (
            "" if row["settled"] else ", interval spans it"
        )
        assert cells[-2:] == [row["target"], verdict]
        lo, hi = row["hookloop"]["ci95"]
        assert f"({lo:.3f}–{hi:.3f})" in line


def test_native_schedule_gives_multistep_lrs(tmp_path: Path) -> None:
    """The native-schedule rows compare like with like: every trained iteration gets the LR
    torch's MultiStepLR gives it, for hookloop's schedule classes and the reference's."""
    from hookloop.bench import tiny_mlp

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


def test_bookkeeping_loop_reads_and_logs_every_20_steps(monkeypatch: Any) -> None:
    import logging

    from hookloop.bench import tiny_mlp

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


def _usage_error(capsys: Any, argv: List[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("hookloop bench: error: ")
    return errors[0]


def test_device_cuda_without_cuda_is_a_usage_error(monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA is not available" in _usage_error(capsys, ["bench", "--device", "cuda"])
    assert "must be cpu or cuda" in _usage_error(capsys, ["bench", "--device", "meta"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hook", "user_hooks.CountSteps"], "expected MODULE:CLASS"),
        (["--hook", "no_such_module_here:Hook"], "cannot import 'no_such_module_here'"),
        (["--hook", "user_hooks:Missing"], "'Missing' in 'user_hooks' is not found"),
        (["--hook", "user_hooks:NOT_A_CLASS"], "a int, not a HookBase subclass"),
        (["--hook", "json:JSONDecoder"], "a type, not a HookBase subclass"),
        (["--hook", "user_hooks:NeedsArg"], "NeedsArg() failed: TypeError"),
        (["--hook", "user_hooks:CountSteps", "--hook-args", "{bad"], "not valid JSON"),
        (["--hook", "user_hooks:CountSteps", "--hook-args", "3"], "JSON object"),
        (["--hook-args", "{}"], "--hook-args needs --hook"),
        (["--only", "dispatch,nope"], "sections are dispatch, stack"),
        (["--only", "hook"], "--only hook needs --hook"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(
    tmp_path: Path, monkeypatch: Any, capsys: Any, args: List[str], message: str
) -> None:
    (tmp_path / "user_hooks.py").write_text(HOOK_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_hooks", raising=False)
    assert message in _usage_error(capsys, ["bench", *args])


def test_a_debug_build_is_refused(monkeypatch: Any, capsys: Any) -> None:
    import hookloop

    monkeypatch.setattr(hookloop, "BUILD_PROFILE", "debug")
    assert "refusing to benchmark" in _usage_error(capsys, ["bench", "--smoke"])


FAKE_DETECTRON2 = {
    "__init__.py": "__version__ = 'fake'\n",
    "engine/__init__.py": "from .train_loop import HookBase, SimpleTrainer, TrainerBase\n",
    "engine/train_loop.py": "from hookloop._d2_reference import HookBase, SimpleTrainer, "
    "TrainerBase\n",
    "engine/hooks.py": "from hookloop._d2_reference import IterationTimer, LRScheduler, "
    "PeriodicWriter\n",
    "utils/__init__.py": "",
    "utils/events.py": "from hookloop._d2_reference import CommonMetricPrinter, EventStorage, "
    "JSONWriter, TensorboardXWriter\n",
    "solver/__init__.py": "from hookloop._d2_reference import LRMultiplier, WarmupParamScheduler\n",
}
# detectron2's schedules come from fvcore
FAKE_FVCORE = {
    "__init__.py": "",
    "common/__init__.py": "",
    "common/param_scheduler.py": "from hookloop._d2_reference import MultiStepParamScheduler\n",
}


@pytest.fixture
def fake_detectron2(tmp_path: Path, monkeypatch: Any) -> Iterator[None]:
    """A ``detectron2`` package that re-exports the reference engine: enough to run the
    detectron2 column's code path here, where detectron2 is not installed."""
    from hookloop.bench import overhead, tiny_mlp

    for package, files in (("detectron2", FAKE_DETECTRON2), ("fvcore", FAKE_FVCORE)):
        for name, text in files.items():
            path = tmp_path / "fake" / package / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))

    def ours(name: str) -> bool:
        return name.split(".")[0] in ("detectron2", "fvcore")

    # Modules of these names imported before (fvcore by its own tests, detectron2's source by
    # tests/compat with HOOKLOOP_D2_SRC) step aside for the fakes, and come back after.
    before = {name: sys.modules.pop(name) for name in [m for m in sys.modules if ours(m)]}
    overhead.engine.cache_clear()
    tiny_mlp.native_available.cache_clear()
    try:
        yield
    finally:
        for name in [m for m in sys.modules if ours(m)]:
            del sys.modules[name]
        sys.modules.update(before)
        overhead.engine.cache_clear()
        tiny_mlp.native_available.cache_clear()
        tiny_mlp._TIMED.clear()


@pytest.mark.usefixtures("fake_detectron2")
def test_detectron2_gets_a_column_when_importable(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--smoke", "--no-progress", "--only", "dispatch,mlp", "--json", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "| hookloop | reference | detectron2 |" in stdout
    assert "detectron2: fake" in stdout
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["engines"] == ["hookloop", "reference", "detectron2"]
    assert {r["section"] for r in data["rows"]} == {"dispatch", "mlp"}
    # every row, the native-schedule one too (detectron2.solver's and fvcore's classes)
    assert all(_finite(r["detectron2"]) for r in data["rows"])


@pytest.fixture
def gpu_check(monkeypatch: Any) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benches"))
    import gpu_check

    return gpu_check


def test_gpu_check_exits_cleanly_without_cuda(
    gpu_check: Any, monkeypatch: Any, capsys: Any
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == gpu_check.NO_CUDA


def test_gpu_check_runs_through_on_the_cpu(gpu_check: Any, monkeypatch: Any, capsys: Any) -> None:
    # the sync debug mode is a stand-in that records what the guard hook sets
    monkeypatch.setattr(gpu_check, "dry_run_modes", [])
    argv = ["--cpu-dry-run", "--iters", "45", "--n", "20", "--repeats", "1"]
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    assert "| hookloop SimpleTrainer + default stack | 42 of 45 | 0 | 0 | finished |" in out
    assert "| hookloop AMPTrainer + default stack | 42 of 45 | 0 | 0 | finished |" in out
    assert "not checked (--cpu-dry-run" in out
    assert "| bfloat16 |" in out
    assert "| bookkeeping hand loop |" in out and "hookloop + stack, × the bookkeeping loop" in out
    # armed on the 42 iterations of 45 where PeriodicWriter(period 20) writes nothing, in
    # each trainer's "warn" and "error" runs (the hand-written loops arm "warn" once each)
    modes = gpu_check.dry_run_modes
    assert modes.count("error") == 2 * 42
    assert modes.count("warn") == 2 * 42 + 2


def test_progress_is_a_plain_line_without_tqdm(monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["bench", "--smoke", "--only", "dispatch"]) == 0
    err = capsys.readouterr().err
    assert "\rhookloop bench: dispatch" in err and "100%" in err  # redrawn in place


def test_progress_into_a_log_is_whole_lines(capsys: Any) -> None:
    """stderr that is not a terminal (a log, CI) gets a line per section and per tenth done,
    not a bar redrawn with carriage returns."""
    assert main(["bench", "--smoke", "--only", "dispatch,stack"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("hookloop bench:")]
    assert lines[0].split() == ["hookloop", "bench:", "dispatch", "0%"]
    assert lines[-1].split() == ["hookloop", "bench:", "stack", "100%"]
    assert len(lines) == len(set(lines)) <= 2 * 11


def test_gpu_check_reports_the_first_sync_error_of_a_chain(gpu_check: Any) -> None:
    def sync() -> None:
        raise RuntimeError("called a synchronizing CUDA operation")

    try:
        try:
            sync()
        finally:
            sync()  # after_train, still in "error" mode
    except RuntimeError as e:
        message, where = gpu_check._first_sync_error(e)
    assert message == "called a synchronizing CUDA operation"
    assert "tests/test_bench_command.py:" in where
    assert gpu_check._inherent("torch/amp/grad_scaler.py:461")


def test_without_tensorboard_every_engine_drops_the_tensorboard_writer(
    monkeypatch: Any, capsys: Any
) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
        find_spec(name, *a)
    )  # fmt: skip
    assert main(["bench", "--smoke", "--no-progress", "--only", "stack"]) == 0
    out = capsys.readouterr().out
    assert "PeriodicWriter(printer, JSON; period 20)" in out
    assert "tensorboard is not installed" in out
