"""Runs that go on from a checkpoint in ways other than an exact resume:

- "raise MAX_ITER and resume": a finished run resumed with a larger ``max_iter`` and a new
  ``LRMultiplier`` over the new length continues with detectron2's LRs (its schedule
  evaluated over the new length from the saved ``last_epoch``), with one warning;
- fine-tuning from a loaded trainer state (``train(0, N)`` after ``checkpointer.load``)
  starts with an empty metric history, as in detectron2; only the run that resumes the
  checkpoint (it starts at the iteration after it) gets the saved history back;
- ``train(start_iter, max_iter)`` with ``start_iter > max_iter`` runs no iteration but
  ``before_train``/``after_train`` (the final evaluation, the writers' last write), as
  detectron2 does, with one warning.

Each scenario is a pattern run on hookloop and on the tests' model of detectron2 (and on
detectron2's own engine when ``HOOKLOOP_D2_SRC`` names its source tree), compared with the
usage corpus's harness; hookloop's one warning is checked, then left out of the comparison.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List

import pytest
import torch
from compat.backends import d2src_dir
from compat.corpus._common import TinyDetector, batches
from compat.harness import Observation, Pattern, observe
from compat.test_corpus import first_difference

ENGINES = ["reference"] + (["d2src"] if d2src_dir() else [])

EXTEND_WARNING = "LRMultiplier: the checkpoint was saved with max_iter="
PAST_WARNING = "is past max_iter"


class _Notices(logging.Handler):
    """hookloop's log records, as emitted (the harness masks its run-length notices)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[Any] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelname, record.getMessage()))


def _run(func, engine: str, tmp_path) -> Observation:
    out = os.path.join(str(tmp_path), engine)
    os.makedirs(out)
    notices = _Notices()
    logging.getLogger("hookloop").addHandler(notices)
    try:
        obs = observe(Pattern(func, "hookloop", "tests/engine/test_run_extension.py"), engine, out)
    finally:
        logging.getLogger("hookloop").removeHandler(notices)
    obs.notices = notices.records  # type: ignore[attr-defined]
    return obs


def _without(obs: Observation, text: str) -> List[Any]:
    """hookloop's log records that hold ``text``; the harness leaves them out of ``obs``
    (harness.ADDITIONS), so the comparison with detectron2 is on everything else."""
    assert not [r for r in obs.logs if text in r[2]], "the harness does not mask it"
    return [r for r in obs.notices if text in r[2]]  # type: ignore[attr-defined]


def _same(a: Observation, b: Observation) -> None:
    diff = first_difference(a.as_dict(), b.as_dict())
    assert not diff, diff[0]


# --- raising max_iter and resuming --------------------------------------------------------------


def _multiplier(S, n, kind):
    """The schedule a config gives for a run of ``n`` iterations."""
    if kind == "multistep":
        inner = S.MultiStepParamScheduler([1.0, 0.1], milestones=[n * 3 // 4], num_updates=n)
    else:
        inner = S.CosineParamScheduler(1.0, 0.0)
    return S.WarmupParamScheduler(inner, 0.01, 2 / n)


def _extend(kind, first, second):
    def extend_a_finished_run(E, R):
        """A run of ``first`` iterations, then a new trainer with ``max_iter = second`` and
        an LRMultiplier over ``second`` iterations, resumed from the run's last checkpoint
        (``resume_or_load``), trains to ``second``."""
        lrs = []

        class LrTrace(E.HookBase):
            def after_step(self):
                lrs.append((self.trainer.iter, self.trainer.optimizer.param_groups[0]["lr"]))

        for max_iter in (first, second):
            torch.manual_seed(0)
            model = TinyDetector()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            scheduler = E.solver.LRMultiplier(
                optimizer, _multiplier(E.solver, max_iter, kind), max_iter
            )
            trainer = E.SimpleTrainer(model, batches(seed=max_iter), optimizer)
            checkpointer = E.Checkpointer(model, R.out, trainer=trainer)
            trainer.register_hooks(
                [
                    E.hooks.IterationTimer(),
                    LrTrace(),  # before LRScheduler: the LR each iteration trains with
                    E.hooks.LRScheduler(optimizer, scheduler),
                    E.hooks.PeriodicCheckpointer(checkpointer, period=5),
                    # window 1: a resumed hookloop run smooths over the restored history too
                    # (docs/resume.md), detectron2's over the new run's values only
                    E.hooks.PeriodicWriter(
                        [E.JSONWriter(R.path("metrics.json"), window_size=1)], period=4
                    ),
                ]
            )
            checkpointer.resume_or_load("", resume=True)
            start = trainer.iter + 1 if checkpointer.has_checkpoint() else 0
            R.rec("start", start, max_iter)
            trainer.train(start, max_iter)
            R.rec("end", trainer.iter, scheduler.last_epoch)
        R.rec("lrs", lrs)
        return lrs

    return extend_a_finished_run


@pytest.mark.parametrize("kind", ["multistep", "cosine"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_finished_run_extended_continues_as_detectron2(kind, engine, tmp_path):
    pattern = _extend(kind, 12, 24)
    ours = _run(pattern, "hookloop", tmp_path)
    assert ours.error is None, ours.error
    (warning,) = _without(ours, EXTEND_WARNING)
    assert warning[1] == "WARNING"
    msg = warning[2]
    assert "max_iter=12" in msg and "max_iter=24" in msg and "iteration 12" in msg
    if kind == "multistep":
        # at iteration 12 the old schedule is past its milestone (9), the new one is not (18)
        assert "was 0.01 and is 0.1 under the new length" in msg, msg
    _same(ours, _run(pattern, engine, tmp_path))


@pytest.mark.parametrize("kind", ["multistep", "cosine"])
def test_the_extended_lrs_are_fvcores_schedule_over_the_new_length(kind, tmp_path):
    """The LRs against detectron2's LRMultiplier rule (``base_lr * multiplier(last_epoch /
    max_iter)``) over fvcore's own schedulers: the first run's LRs at iterations 0..12 (the
    optimizer state brings iteration 12's into the resumed run), the new length's after."""
    fv = pytest.importorskip("fvcore.common.param_scheduler")
    from compat.backends import backend

    lrs = _extend(kind, 12, 24)(backend("hookloop"), _Rec(str(tmp_path)))
    old, new = _fvcore_multiplier(fv, 12, kind), _fvcore_multiplier(fv, 24, kind)
    want = [(i, 0.1 * old(i / 12)) for i in range(12)]
    want += [(12, 0.1 * old(12 / 12))] + [(i, 0.1 * new(i / 24)) for i in range(13, 24)]
    assert lrs == want


def _fvcore_multiplier(fv, n, kind):
    """:func:`_multiplier` from fvcore's schedulers, with detectron2's warmup written out
    (``WarmupParamScheduler``: a linear ramp from ``factor * inner(0)`` to
    ``inner(warmup_length)``, then ``inner`` on its own, fixed, interval)."""
    if kind == "multistep":
        inner = fv.MultiStepParamScheduler([1.0, 0.1], milestones=[n * 3 // 4], num_updates=n)
    else:
        inner = fv.CosineParamScheduler(1.0, 0.0)
    length = 2 / n
    ramp = fv.LinearParamScheduler(0.01 * inner(0.0), inner(length))
    return fv.CompositeParamScheduler(
        [ramp, inner], lengths=[length, 1 - length], interval_scaling=["rescaled", "fixed"]
    )


class _Rec:
    def __init__(self, out):
        self.out = out

    def rec(self, *a):
        pass

    def path(self, *parts):
        return os.path.join(self.out, *parts)


def test_a_max_iter_below_the_saved_iteration_loads_and_refuses_to_step(tmp_path, caplog):
    """Relaunching a finished run with a lower ``max_iter`` loads (detectron2's
    ``train()`` then runs no iteration: levan92/det2_clearml's relaunch in the corpus); the
    schedule has no LR there, so a step raises."""
    from compat.backends import backend

    E = backend("hookloop")
    _extend("multistep", 12, 12)(E, _Rec(str(tmp_path)))
    model = TinyDetector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = E.solver.LRMultiplier(optimizer, _multiplier(E.solver, 10, "multistep"), 10)
    trainer = E.SimpleTrainer(model, batches(), optimizer)
    trainer.register_hooks([E.hooks.LRScheduler(optimizer, scheduler)])
    checkpointer = E.Checkpointer(model, str(tmp_path), trainer=trainer)
    with caplog.at_level(logging.WARNING, logger="hookloop.solver.lr_scheduler"):
        checkpointer.resume_or_load("", resume=True)
    (record,) = [r for r in caplog.records if r.name == "hookloop.solver.lr_scheduler"]
    assert "max_iter=12 at iteration 12 (last_epoch), past this scheduler's max_iter=10" in (
        record.getMessage()
    )
    assert scheduler.last_epoch == 12
    with pytest.raises(ValueError, match="iteration 13 is outside .*max_iter=10"):
        scheduler.step()


# --- fine-tuning from a loaded trainer state ------------------------------------------------------


def _trained(E, out, n=6):
    torch.manual_seed(0)
    model = TinyDetector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = E.SimpleTrainer(model, batches(), optimizer)
    checkpointer = E.Checkpointer(model, out, trainer=trainer)
    trainer.register_hooks([E.hooks.PeriodicCheckpointer(checkpointer, period=n)])
    trainer.train(0, n)
    return os.path.join(out, "model_final.pth")


def _loaded(E, path):
    model = TinyDetector()
    trainer = E.SimpleTrainer(model, batches(seed=2), torch.optim.SGD(model.parameters(), lr=0.01))
    E.Checkpointer(model, os.path.dirname(path), trainer=trainer).load(path)
    return trainer


def _iterations(trainer, name="total_loss"):
    return [it for _, it in trainer.storage.history(name).values()]


@pytest.mark.parametrize("start", [0, 3, 7])
def test_a_run_that_does_not_resume_the_checkpoint_starts_with_an_empty_history(start, tmp_path):
    from compat.backends import backend

    E = backend("hookloop")
    trainer = _loaded(E, _trained(E, str(tmp_path)))  # saved at iteration 5
    assert trainer.iter == 5  # the iteration is restored whatever the run, as in detectron2
    trainer.train(start, start + 4)
    assert _iterations(trainer) == list(range(start, start + 4))
    # a second train() of the same trainer starts empty too: the saved history is gone
    trainer.train(start + 4, start + 6)
    assert _iterations(trainer) == [start + 4, start + 5]


def test_the_run_that_resumes_the_checkpoint_gets_its_history(tmp_path):
    from compat.backends import backend

    E = backend("hookloop")
    trainer = _loaded(E, _trained(E, str(tmp_path)))
    trainer.train(trainer.iter + 1, 9)
    assert _iterations(trainer) == list(range(9))


def _fine_tune(E, R):
    """Weights and trainer state loaded from a finished run's file, then a new run from
    iteration 0 (detectron2's storage is new at every train())."""
    os.makedirs(R.path("first"))
    path = _trained(E, R.path("first"))
    trainer = _loaded(E, path)
    R.rec("iter after load", trainer.iter)
    trainer.register_hooks([E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], 2)])
    trainer.train(0, 4)
    R.storage(trainer.storage)


@pytest.mark.parametrize("engine", ENGINES)
def test_fine_tuning_from_a_loaded_state_is_detectron2s(engine, tmp_path):
    _same(_run(_fine_tune, "hookloop", tmp_path), _run(_fine_tune, engine, tmp_path))


# --- start_iter past max_iter ------------------------------------------------------------------


def _past(start, max_iter, with_checkpoint):
    def start_past_max_iter(E, R):
        """A trainer told to train from ``start`` to ``max_iter``: what real scripts reach by
        resuming a finished run with a lower ``max_iter`` (``with_checkpoint``: a run to
        ``start`` first, then a new trainer resumed from its last checkpoint)."""
        torch.manual_seed(0)
        evals = []

        def build(phase):
            model = TinyDetector()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            trainer = E.SimpleTrainer(model, batches(), optimizer)

            def evaluate():
                evals.append(trainer.iter)
                return {"acc": 0.5}

            checkpointer = E.Checkpointer(model, R.out, trainer=trainer)
            trainer.register_hooks(
                [
                    E.hooks.IterationTimer(),
                    E.hooks.EvalHook(5, evaluate),
                    E.hooks.PeriodicCheckpointer(checkpointer, period=5),
                    E.hooks.PeriodicWriter(
                        # a file per run: hookloop's resumed run would drop the first run's
                        # line of its final evaluation, at iteration `start` (docs/resume.md)
                        [E.CommonMetricPrinter(max_iter), E.JSONWriter(R.path(phase + ".jsonl"))],
                        period=5,
                    ),
                ]
            )
            return trainer, checkpointer

        trainer, checkpointer = build("first")
        if with_checkpoint:
            trainer.train(0, start)
            trainer, checkpointer = build("resumed")
            checkpointer.resume_or_load("", resume=True)
            R.rec("resumed at", trainer.iter)
        trainer.train(start, max_iter)
        R.rec("iter", trainer.iter, "start_iter", trainer.start_iter, "evals", evals)
        R.storage(trainer.storage)

    return start_past_max_iter


@pytest.mark.parametrize("start, max_iter", [(15, 12), (13, 12)])
@pytest.mark.parametrize("engine", ENGINES)
def test_start_iter_past_max_iter_runs_no_iteration_as_detectron2(
    start, max_iter, engine, tmp_path
):
    pattern = _past(start, max_iter, with_checkpoint=False)
    ours = _run(pattern, "hookloop", tmp_path)
    assert ours.error is None, ours.error
    ((_, level, msg),) = _without(ours, PAST_WARNING)
    assert level == "WARNING"
    assert f"start_iter ({start})" in msg and f"max_iter ({max_iter})" in msg
    # detectron2's empty loop, then `self.iter += 1`; the final evaluation ran, once
    assert ours.records[0] == ["iter", start + 1, "start_iter", start, "evals", [start + 1]]
    assert not [f for f in ours.files if f.endswith(".pth")]  # no checkpoint saved
    _same(ours, _run(pattern, engine, tmp_path))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_finished_run_resumed_with_a_lower_max_iter(engine, tmp_path):
    pattern = _past(10, 8, with_checkpoint=True)
    ours = _run(pattern, "hookloop", tmp_path)
    assert ours.error is None, ours.error
    assert len(_without(ours, PAST_WARNING)) == 1
    _same(ours, _run(pattern, engine, tmp_path))


def test_check_iters_warns_once_and_keeps_both(caplog):
    from hookloop.engine.parts import check_iters

    with caplog.at_level(logging.WARNING, logger="hookloop.engine.train_loop"):
        assert check_iters(7, 3) == (7, 3)
        assert check_iters(3, 7) == (3, 7)
    assert len(caplog.records) == 1
