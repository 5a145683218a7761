"""``hookloop bench`` and ``benches/gpu_check.py``: they run, print their table and JSON, measure
a user's hook, and turn mistakes into one-line usage errors. The runs are ``--quick`` ones and
no timing is asserted."""

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
    """Counts after_step calls and appends the count at after_train."""

    def __init__(self, out="steps.jsonl"):
        self.out, self.calls = out, 0

    def after_step(self):
        self.calls += 1

    def after_train(self):
        with open(self.out, "a") as f:
            f.write(json.dumps({"calls": self.calls, "max_iter": self.trainer.max_iter}) + "\\n")


class NeedsArg(HookBase):
    def __init__(self, required):
        self.required = required


NOT_A_CLASS = 3
'''

HEADER = (
    "| measurement | unit | floor | hookloop | detectron2 | hookloop ÷ floor "
    "| detectron2 ÷ hookloop | n × repeats |"
)


def _finite(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x)


LOADER_HEADER = (
    "| loader (batch 16 of 50,000 × 32) | data µs/batch | µs/step | steps/s | data ÷ DataLoader's "
    "| steps/s ÷ DataLoader's | n × repeats |"
)


def _tables(out: str) -> List[List[str]]:
    """Each markdown table's lines (runs of lines starting with "|")."""
    tables: List[List[str]] = []
    last = False
    for line in out.splitlines():
        table = line.startswith("|")
        if table and not last:
            tables.append([])
        if table:
            tables[-1].append(line)
        last = table
    return tables


def _table(out: str, header: str = HEADER, columns: int = 8) -> List[List[str]]:
    """The rows of the table with ``header`` (the first table: the main one), as lists of
    cells."""
    lines = next(t for t in _tables(out) if t[0] == header)
    assert lines[1] == "|---" * columns + "|"
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def _check_loader_rows(stdout: str, data: Any) -> None:
    """The loader table (DataLoader, then DeviceResidentLoader) and its rows in the JSON."""
    assert [t[0] for t in _tables(stdout)] == [HEADER, LOADER_HEADER]
    cells = _table(stdout, LOADER_HEADER, 7)
    assert [r[0] for r in cells] == [
        "tiny MLP: SimpleTrainer + default stack, fed by DataLoader(TensorDataset, shuffle=True)",
        "tiny MLP: SimpleTrainer + default stack, fed by DeviceResidentLoader",
    ]
    assert cells[0][4] == cells[0][5] == "1.00×"  # the DataLoader over itself
    sizes, rows = data["sizes"], data["loader_rows"]
    assert sizes["loader_dataset"] == [50_000, 32] and sizes["loader_batch"] == 16
    assert [r["loader"] for r in rows] == ["DataLoader", "DeviceResidentLoader"]
    for row, line in zip(rows, cells):
        assert line[0] == row["what"] and line[-1] == row["n"]
        for key in ("data_us", "step_us", "steps_per_s", "data_of_dataloader",
                    "steps_per_s_over_dataloader"):  # fmt: skip
            assert _finite(row[key]) and row[key] > 0, (key, row)
        assert row["step_us"] > row["data_us"]  # a step includes its batch's next()
        runs = row["runs"]
        assert len(runs["data_us"]) == len(runs["step_us"]) == sizes["repeats"]


def test_python_m_hookloop_bench_is_the_command() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "hookloop", "bench", "--help"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for option in ("--quick", "--json", "--hook"):
        assert option in proc.stdout


def test_bench_quick_prints_a_table_and_json_and_measures_a_hook(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    import importlib.machinery

    # without detectron2 (where it is installed too): its column is left out
    find_spec = importlib.machinery.PathFinder.find_spec
    monkeypatch.setattr(
        importlib.machinery.PathFinder, "find_spec",
        lambda name, *a: None if name == "detectron2" else find_spec(name, *a),
    )  # fmt: skip
    (tmp_path / "user_hooks.py").write_text(HOOK_MODULE, encoding="utf-8")
    out = tmp_path / "bench.json"
    # run from the hook's directory, as a user would: the command finds modules in the cwd
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "user_hooks", raising=False)
    assert main(["bench", "--quick", "--json", str(out), "--hook", "user_hooks:CountSteps"]) == 0
    stdout = capsys.readouterr().out
    for line in ("command: hookloop bench --quick --json", "build_profile: release", "torch: ",
                 "detectron2: None", "detectron2 is not importable here"):  # fmt: skip
        assert line in stdout
    rows = _table(stdout)
    assert all(r[4] == "—" and r[6] == "—" for r in rows)
    stack = "tiny MLP: SimpleTrainer + IterationTimer + LRScheduler + PeriodicWriter(printer"
    assert [r[0].split(",")[0] for r in rows] == [
        "TrainerBase.train", "TrainerBase.train", "tiny MLP: SimpleTrainer", stack, stack,
        "tiny MLP: SimpleTrainer + user_hooks:CountSteps",
    ]  # fmt: skip
    # the seeds' stack: the default stack, then the every-step writers at window_size 1
    assert rows[4][0] == rows[3][0].replace(
        ", over", " + PeriodicWriter(JSON, TensorBoard; window_size 1, period 1), over"
    )
    assert [r[1] for r in rows] == ["ns/iter"] * 2 + ["µs/step"] * 4

    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["machine"]["build_profile"] == "release"
    assert data["machine"]["command"].startswith("hookloop bench --quick --json ")
    assert data["engines"] == ["hookloop"]
    sizes = data["sizes"]
    assert sizes["everystep_writers"] == [w for w in sizes["writers"] if w != "printer"]
    assert len(data["rows"]) == len(rows)
    for row, cells in zip(data["rows"], rows):
        assert cells[0] == row["what"] and cells[-1] == row["n"]
        assert _finite(row["floor"]) and _finite(row["hookloop"])
        assert _finite(row["hookloop_over_floor"]) and row["hookloop_over_floor"] > 0
        # per repetition, every figure the row's medians come from
        assert all(len(v) == sizes["repeats"] for v in row["runs"].values())
        assert row["detectron2"] is None and row["detectron2_over_hookloop"] is None
    _check_loader_rows(stdout, data)
    hook_row = data["rows"][-1]
    assert set(hook_row["runs"]) == {"floor", "hookloop"} and hook_row["detectron2"] is None
    # one untimed warm-up run and the timed repetitions, each a whole train() with the hook
    runs = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(runs) == 1 + sizes["repeats"]
    assert all(r["calls"] == r["max_iter"] == sizes["mlp_n"] for r in runs)


def _usage_error(capsys: Any, argv: List[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("hookloop bench: error: ")
    return errors[0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("user_hooks.CountSteps", "expected MODULE:CLASS"),
        ("no_such_module_here:Hook", "cannot import 'no_such_module_here'"),
        ("user_hooks:Missing", "'Missing' in 'user_hooks' is not found"),
        ("user_hooks:NOT_A_CLASS", "a int, not a HookBase subclass"),
        ("json:JSONDecoder", "a type, not a HookBase subclass"),
        ("user_hooks:NeedsArg", "NeedsArg() failed: TypeError"),
    ],
)
def test_a_bad_hook_is_a_one_line_usage_error(
    tmp_path: Path, monkeypatch: Any, capsys: Any, spec: str, message: str
) -> None:
    (tmp_path / "user_hooks.py").write_text(HOOK_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_hooks", raising=False)
    assert message in _usage_error(capsys, ["bench", "--hook", spec])


def test_a_debug_build_is_refused(monkeypatch: Any, capsys: Any) -> None:
    import hookloop

    monkeypatch.setattr(hookloop, "BUILD_PROFILE", "debug")
    assert "refusing to benchmark" in _usage_error(capsys, ["bench", "--quick"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_cuda_graph_without_cuda_is_a_usage_error(capsys: Any) -> None:
    assert "--cuda-graph needs a CUDA device" in _usage_error(capsys, ["bench", "--cuda-graph"])


def test_the_steady_clock_leaves_out_the_warm_up_and_the_capture() -> None:
    # --cuda-graph's rate: the steps after the capture iteration, between two stamps (here a
    # counting clock: each stamp one more).
    from hookloop import bench
    from hookloop.engine import CUDAGraphTrainer

    model = bench.TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=True)
    trainer = CUDAGraphTrainer(model, bench.make_batches(count=4), opt, graph="eager")
    stamps = iter(range(100))
    clock = bench.steady_clock("cpu", 3, clock=lambda: float(next(stamps)))
    trainer.register_hooks([clock])
    trainer.train(5, 15)
    # before_train at 0, the end of the capture iteration (8) at 1, of the last (14) at 2
    assert clock.setup() == 1.0
    assert clock.per_step() == pytest.approx(1 / 6)
    trainer.train(0, 4)  # the capture at iteration 3 is the last: no steady step
    with pytest.raises(ValueError, match="no steady steps"):
        clock.per_step()


def test_demo_cuda_graph_needs_a_cuda_device(capsys: Any, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--cuda-graph", "--device", "cpu", "--output", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "hookloop demo: error: --cuda-graph needs a CUDA device" in err


# A detectron2 that is the tests' reference engine under detectron2's module names: enough to
# run the detectron2 column's code path here, where detectron2 is not installed.
FAKE_DETECTRON2 = {
    "__init__.py": "__version__ = 'fake'\n",
    "engine/__init__.py": "",
    "engine/train_loop.py": "from compat.reference_engine import HookBase, SimpleTrainer, "
    "TrainerBase\n",
    "engine/hooks.py": "from compat.reference_engine import IterationTimer, LRScheduler, "
    "PeriodicWriter\n",
    "utils/__init__.py": "",
    "utils/events.py": "from compat.reference_engine import CommonMetricPrinter, JSONWriter, "
    "TensorboardXWriter\n",
}


@pytest.fixture
def fake_detectron2(tmp_path: Path, monkeypatch: Any) -> Iterator[None]:
    for name, text in FAKE_DETECTRON2.items():
        path = tmp_path / "fake" / "detectron2" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))

    def ours(name: str) -> bool:
        return name.split(".")[0] == "detectron2"

    # detectron2 modules imported before (its source, by tests/compat with HOOKLOOP_D2_SRC)
    # step aside for the fake, and come back after.
    before = {name: sys.modules.pop(name) for name in [m for m in sys.modules if ours(m)]}
    try:
        yield
    finally:
        for name in [m for m in sys.modules if ours(m)]:
            del sys.modules[name]
        sys.modules.update(before)


@pytest.mark.usefixtures("fake_detectron2")
def test_detectron2_gets_a_column_and_tensorboard_is_optional(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    """With detectron2 importable, its column and its ratio to hookloop; without the
    tensorboard package (detectron2's TensorBoard writer needs it), every engine's stack runs
    without TensorBoard."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
        find_spec(name, *a)
    )  # fmt: skip
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "detectron2: fake" in stdout and "detectron2 is not importable" not in stdout
    assert "PeriodicWriter(printer, JSON; period 20)" in stdout
    assert "+ PeriodicWriter(JSON; window_size 1, period 1), over" in stdout
    assert "tensorboard is not installed" in stdout
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["engines"] == ["hookloop", "detectron2"]
    assert data["sizes"]["writers"] == ["printer", "json"]
    assert data["sizes"]["everystep_writers"] == ["json"]
    for row in data["rows"]:
        assert _finite(row["detectron2"]), row
        ratio = row["detectron2_over_hookloop"]
        assert ratio is None or _finite(ratio)  # none when a repetition's hookloop cost was <= 0
    assert all(len(r) == 8 and r[4] != "—" for r in _table(stdout))
    _check_loader_rows(stdout, data)  # hookloop's own: no detectron2 column


@pytest.fixture
def gpu_check() -> Any:
    import gpu_check  # benches/ is on the tests' path

    return gpu_check


def test_gpu_check_exits_cleanly_without_cuda(
    gpu_check: Any, monkeypatch: Any, capsys: Any
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == gpu_check.NO_CUDA


def test_gpu_check_runs_through_on_the_cpu(
    gpu_check: Any, monkeypatch: Any, capsys: Any, tmp_path: Path
) -> None:
    # the sync debug mode is a stand-in that records what the guard hook sets
    monkeypatch.setattr(gpu_check, "dry_run_modes", [])
    argv = ["--cpu-dry-run", "--in-process", "--iters", "45", "--n", "20", "--repeats", "1",
            "--graph-n", "10", "--loader-n", "10",
            "--json", str(tmp_path / "gpu.json")]  # fmt: skip
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    assert "| hookloop SimpleTrainer + default stack | 42 of 45 | 0 | 0 | finished |" in out
    assert "| hookloop AMPTrainer + default stack | 42 of 45 | 0 | 0 | finished |" in out
    assert "not checked (--cpu-dry-run" in out
    assert "| bfloat16 |" in out
    assert "| bookkeeping hand loop |" in out and "hookloop + stack, × the bookkeeping loop" in out
    # armed on the 42 iterations of 45 where PeriodicWriter(period 20) writes nothing, in
    # each trainer's "warn" and "error" runs (the hand-written loops arm "warn" once each)
    # the default stack (3 writes in 45 iterations) and the seeds' stack (a read every
    # iteration), in "warn" from before_train to the last iteration
    assert "| hookloop SimpleTrainer + default stack (writes every 20) | 45 | 3 | 0 |" in out
    assert (
        "| hookloop SimpleTrainer + the seeds' stack (every iteration read) | 45 | 45 | 0 |" in out
    )
    assert "| hookloop + seeds' stack |" in out
    # CUDAGraphTrainer (the seam's eager implementation here) over the hand-written loop, and
    # its syncs per iteration: 45 iterations, 3 writes, 38 others after the capture (iter 3)
    assert "## CUDA graphs on cpu, over the hand-written eager loop" in out
    assert "| hand-made graph, 4 steps per replay |" in out
    assert "| mlp | 10 |" in out and "| cnn | 10 |" in out
    assert "| CUDAGraphTrainer + default stack, mlp | 45 | 0 | 0 | 3 (0) | 38 (0) |" in out
    assert "| CUDAGraphTrainer + default stack, cnn | 45 | 0 | 0 | 3 (0) | 38 (0) |" in out
    # issue 44's loaders: the hand loop and CUDAGraphTrainer fed by the pinned DataLoader and
    # by DeviceResidentLoader (the CNN's run crosses epochs: 16 batches of 8 each), the
    # resident runs' syncs per iteration, and each goal (the speed ones unjudged on the CPU)
    assert "## Loaders on cpu: steps/s over the hand eager loop fed by the pinned DataLoader" in out
    assert "| mlp | 10 |" in out and "| cnn | 10 |" in out
    for model in ("mlp", "cnn"):
        row = f"| CUDAGraphTrainer + default stack, {model}, DeviceResidentLoader | 45 | 0 | 0 |"
        assert row + " 3 (0) | 38 (0) |" in out
        assert f"DeviceResidentLoader on the {model}: >= 0.9x the steps/s of the hand-made" in out
    assert (
        "on the mlp: >= 20.0x the steps/s of the hand eager loop fed by the pinned DataLoader"
        in out
    )
    assert (
        "on the cnn: >= 3.0x the steps/s of the hand eager loop fed by the pinned DataLoader" in out
    )
    assert out.count("not judged (--cpu-dry-run)") == 4
    assert out.count("that write nothing: 0 syncs: met") == 2
    data = json.loads((tmp_path / "gpu.json").read_text(encoding="utf-8"))
    loader = data["parts"]["loader"]
    assert loader["status"] == "ok" and loader["loader_clean"] is True
    assert [r["model"] for r in loader["loader"]] == ["mlp", "cnn"]
    for r in loader["loader"]:
        assert set(r["steps_per_s"]) == set(gpu_check.LOADER_VARIANTS)
        assert all(_finite(v) and v > 0 for v in r["steps_per_s"].values())
        for key in ("hand", "graph-dl", "graph-res"):
            assert len(r[f"{key}-over-hand-dl-per-round"]) == 1
            assert _finite(r[f"{key}-over-hand-dl"]["median"])
        assert _finite(r["graph-res-of-bare"]["median"])
    assert [g["kind"] for g in loader["goals"]] == ["speed"] * 4 + ["syncs"] * 2
    assert data["misses"] == []
    modes = gpu_check.dry_run_modes
    assert modes.count("error") == 2 * 42
    # "warn": the sync part's runs, the hand loops, the reads part's two, the graph part's two
    # sync runs and the loader part's two
    assert modes.count("warn") == 2 * 42 + 2 + 2 + 2 + 2


def test_gpu_check_misses_below_the_graph_goals_on_cuda_only(gpu_check: Any) -> None:
    def row(model: str, median: float) -> Any:
        return {"model": model, "graph-stack-speedup": {"median": median, "best": median}}

    graph = {"status": "ok", "graph_clean": True, "graph": [row("mlp", 14.2), row("cnn", 3.1)]}
    misses = gpu_check._misses({"graph": graph}, 45, dry_run=False)
    assert misses == [
        "graph: CUDAGraphTrainer + default stack on the mlp ran 14.20x the hand loop's "
        "steps/s; the goal is 15.0x"
    ]
    assert gpu_check._misses({"graph": graph}, 45, dry_run=True) == []


def test_gpu_check_misses_the_loader_goals_it_does_not_meet(gpu_check: Any) -> None:
    rows = [{"model": m, "graph-res-over-hand-dl": {"median": x, "best": x},
             "graph-res-of-bare": {"median": b, "best": b}}
            for m, x, b in (("mlp", 25.0, 0.85), ("cnn", 2.5, 0.95))]  # fmt: skip
    syncs = [{"what": "CUDAGraphTrainer + default stack, mlp, DeviceResidentLoader",
              "non_write_iterations_after_capture": 38,
              "syncs_after_capture_non_write": 2}]  # fmt: skip
    goals = gpu_check._loader_goals(rows, syncs)
    assert [g["met"] for g in goals] == [True, False, False, True, False]
    loader = {"status": "ok", "goals": goals}
    misses = gpu_check._misses({"loader": loader}, 45, dry_run=False)
    assert len(misses) == 3 and all(m.startswith("loader: CUDAGraphTrainer") for m in misses)
    assert "0.9x the steps/s of the hand-made 1-step graph" in misses[0]
    assert ">= 3.0x the steps/s of the hand eager loop" in misses[1] and "got 2.5" in misses[1]
    assert "no synchronization on the 38 iterations" in misses[2]
    # on the CPU the speed goals are not judged; the synchronizations still are
    assert gpu_check._misses({"loader": loader}, 45, dry_run=True) == misses[2:]


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


def _frame(path: str, line: int) -> Any:
    import traceback

    return traceback.FrameSummary(path, line, "f", lookup_line=False)


def test_gpu_check_attributes_a_synchronization_by_its_stack(gpu_check: Any) -> None:
    import hookloop

    hl = os.path.dirname(hookloop.__file__)
    th = os.path.dirname(torch.__file__)
    bench = _frame("/x/benches/lab/tiny_mlp.py", 7)
    step = _frame(os.path.join(hl, "engine", "train_loop.py"), 976)
    scaler = _frame(os.path.join(th, "amp", "grad_scaler.py"), 461)
    tensor = _frame(os.path.join(th, "_tensor.py"), 30)
    # torch's GradScaler, called by hookloop's AMPTrainer: GradScaler's, not counted
    where = gpu_check._attribute([bench, step, scaler])
    assert where == "torch/amp/grad_scaler.py:461" and gpu_check._inherent(where)
    # a synchronization in torch code that hookloop called: hookloop's, counted
    where = gpu_check._attribute([bench, step, tensor])
    in_torch = gpu_check._where(tensor.filename, 30)  # .../torch/_tensor.py:30
    assert where == f"hookloop/engine/train_loop.py:976 (in {in_torch})"
    assert not gpu_check._inherent(where)
    # neither on the stack: the innermost frame outside torch (a hand-written loop's line)
    where = gpu_check._attribute([bench, tensor])
    assert where == f"benches/lab/tiny_mlp.py:7 (in {in_torch})"
    assert gpu_check._attribute([]) == "?"


def test_gpu_check_counts_only_the_sync_debug_modes_warnings(
    gpu_check: Any, monkeypatch: Any
) -> None:
    import warnings

    monkeypatch.setattr(gpu_check, "set_mode", lambda mode: None)

    def run() -> None:
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        # torch's one-time notice when the mode is first set: not a synchronization
        warnings.warn(
            "Synchronization debug mode is a prototype feature", UserWarning, stacklevel=1
        )

    with pytest.warns(UserWarning, match="prototype feature"):
        count, where = gpu_check._count_syncs(run)
    assert count == 2 and len(where) == 1
    assert "tests/test_bench_command.py:" in next(iter(where))


def test_gpu_check_runs_the_grad_scaler_and_after_train_unchecked(
    gpu_check: Any, monkeypatch: Any
) -> None:
    from hookloop.engine import HookBase, SimpleTrainer

    modes: List[Any] = []
    monkeypatch.setattr(gpu_check, "set_mode", modes.append)
    monkeypatch.setattr(gpu_check, "get_mode", lambda: modes[-1] if modes else "default")
    # _unchecked: the default mode inside, the mode before restored after
    seen = []
    gpu_check._unchecked(lambda: seen.append(gpu_check.get_mode()))()
    assert seen == ["default"]
    modes.clear()
    gpu_check.set_mode("error")
    gpu_check._unchecked(lambda: None)()
    assert modes == ["error", "default", "error"]

    # a step that raises in "error" mode: the mode is back to default before any after_train
    # (a writer's final write reads the losses)
    class Writer(HookBase):  # registered before the guard, as PeriodicWriter is
        def after_train(self) -> None:
            seen.append(gpu_check.get_mode())

    class Raises(HookBase):
        def after_step(self) -> None:
            if self.trainer.iter == 5:
                raise RuntimeError("called a synchronizing CUDA operation")

    model = torch.nn.Linear(2, 1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = model

        def forward(self, x: Any) -> Any:
            return {"loss": self.linear(x).sum()}

    m = Model()
    data = iter(lambda: torch.ones(1, 2), None)
    trainer = SimpleTrainer(m, data, torch.optim.SGD(m.parameters(), lr=0.0))
    trainer.register_hooks([Writer(), gpu_check._guard(20, "error"), Raises()])
    modes.clear()
    seen.clear()
    with pytest.raises(RuntimeError, match="synchronizing"):
        trainer.train(0, 50)
    # set for iteration 6, then on_exception, then the guard's own after_train
    assert modes[-3:] == ["error", "default", "default"] and seen == ["default"]


def test_gpu_check_ends_each_part_in_bounded_time_and_writes_its_summary(
    gpu_check: Any, tmp_path: Path, capsys: Any
) -> None:
    # a part killed at its timeout (here at once, before its child even starts): reported as
    # a miss, the summary written all the same
    out = tmp_path / "summary.json"
    argv = ["--cpu-dry-run", "--parts", "reads", "--iters", "5", "--timeout-scale", "0.001"]
    assert gpu_check.main([*argv, "--json", str(out)]) == 1
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["parts"]["reads"]["status"] == "timeout"
    assert data["misses"] == ["part reads: timeout: killed at its timeout (0 s)"]
    assert "MISS: part reads: timeout" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_check_runs_a_part_in_a_child_process(
    gpu_check: Any, tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "summary.json"
    argv = ["--cpu-dry-run", "--parts", "reads", "--iters", "5", "--json", str(out)]
    assert gpu_check.main(argv) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["misses"] == [] and data["parts"]["reads"]["status"] == "ok"
    assert [r["reads"] for r in data["parts"]["reads"]["reads"]] == [1, 5]  # stack, seeds
    assert "parts: reads ok" in capsys.readouterr().out
