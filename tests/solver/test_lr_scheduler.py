"""hookloop.solver.lr_scheduler: LRMultiplier over native and Python schedules, its state,
and detectron2's legacy schedulers, against plain Python computations."""

from __future__ import annotations

import io
import math
import warnings
from bisect import bisect_right

import pytest
import torch
from compat import d2
from hookloop.solver import LRMultiplier, WarmupCosineLR, WarmupMultiStepLR, WarmupParamScheduler
from hookloop.solver.param_scheduler import (
    CosineParamScheduler,
    MultiStepParamScheduler,
    ParamScheduler,
)

MAX_ITER = 1000
BASE_LRS = (0.1, 0.02, 3)  # an int LR too: base_lr * multiplier is a float all the same


def make_optimizer(lrs=BASE_LRS, tensor_lr=False):
    groups = [
        {
            "params": [torch.nn.Parameter(torch.zeros(2))],
            "lr": torch.tensor(lr) if tensor_lr else lr,
        }
        for lr in lrs
    ]
    return torch.optim.SGD(groups, lr=1.0)


def multiplier():
    inner = MultiStepParamScheduler([1, 0.1, 0.01], milestones=[600, 800], num_updates=MAX_ITER)
    return WarmupParamScheduler(inner, 0.001, 100 / MAX_ITER)


def reference_multiplier():
    inner = d2.MultiStepParamScheduler([1, 0.1, 0.01], milestones=[600, 800], num_updates=MAX_ITER)
    return d2.WarmupParamScheduler(inner, 0.001, 100 / MAX_ITER)


def expected_lrs(ref, it, base_lrs=BASE_LRS):
    """detectron2's LRMultiplier.get_lr, computed in plain Python."""
    m = ref(it / MAX_ITER)
    return [base_lr * m for base_lr in base_lrs]


def lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def bits(values):
    return [float(v).hex() for v in values]


class Halving(ParamScheduler):
    """A Python schedule (evaluated at Python cost)."""

    def __call__(self, where: float) -> float:
        return 0.5 ** int(where * 10)


@pytest.mark.parametrize("python_multiplier", [False, True])
def test_full_run_equals_detectron2(python_multiplier):
    opt = make_optimizer()
    mult = Halving() if python_multiplier else multiplier()
    ref = Halving() if python_multiplier else reference_multiplier()
    sched = LRMultiplier(opt, mult, max_iter=MAX_ITER)
    # detectron2's LRMultiplier (compat.d2) on its own optimizer, side by side.
    d2_opt = make_optimizer()
    d2_sched = d2.LRMultiplier(d2_opt, ref, max_iter=MAX_ITER)
    assert (sched._native is None) == python_multiplier
    assert sched._fast == (not python_multiplier)
    assert bits(lrs(opt)) == bits(expected_lrs(ref, 0)) == bits(lrs(d2_opt))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch call-order warning on the usual loop
        for it in range(MAX_ITER):
            opt.step()
            sched.step()
            d2_opt.step()
            d2_sched.step()
            assert sched.last_epoch == it + 1
            assert bits(lrs(opt)) == bits(expected_lrs(ref, it + 1)), it
            assert bits(lrs(opt)) == bits(lrs(d2_opt)), it
            assert bits(sched.get_last_lr()) == bits(lrs(opt))
            assert all(type(lr) is float for lr in lrs(opt))
    # The loop's last step is at where == 1.0; one more is past the schedule.
    with pytest.raises(ValueError, match="iteration 1001 .*max_iter=1000"):
        sched.step()


def test_a_step_past_max_iter_changes_nothing():
    opt = make_optimizer()
    sched = LRMultiplier(opt, multiplier(), MAX_ITER)
    for _ in range(MAX_ITER):
        opt.step()
        sched.step()
    before = sched.state_dict()
    with pytest.raises(ValueError, match="iteration 1001"):
        sched.step()
    assert sched.state_dict() == before
    assert bits(lrs(opt)) == bits(sched.get_last_lr())


def test_tensor_lrs_take_torchs_path():
    opt = make_optimizer(lrs=(0.1, 0.02), tensor_lr=True)
    sched = LRMultiplier(opt, multiplier(), MAX_ITER)
    assert not sched._fast
    ref = reference_multiplier()
    for it in range(250):
        opt.step()
        sched.step()
        assert all(isinstance(lr, torch.Tensor) for lr in lrs(opt))
        want = [torch.tensor(b) * ref((it + 1) / MAX_ITER) for b in (0.1, 0.02)]
        assert [float(x) for x in lrs(opt)] == [float(x) for x in want]


def resumed_run(stop_at, state_transform=lambda s: s):
    """Trains to `stop_at`, saves, rebuilds everything and resumes to the end."""
    opt = make_optimizer()
    sched = LRMultiplier(opt, multiplier(), MAX_ITER)
    for _ in range(stop_at):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # plain data only: no pickled schedules

    opt2 = make_optimizer()
    sched2 = LRMultiplier(opt2, multiplier(), MAX_ITER)
    opt2.load_state_dict(ckpt["optimizer"])
    sched2.load_state_dict(state_transform(ckpt["scheduler"]))
    history = []
    for _ in range(stop_at, MAX_ITER):
        opt2.step()
        sched2.step()
        history.append(bits(lrs(opt2)))
    return sched, sched2, history


def test_state_round_trip_resumes_exactly():
    ref = reference_multiplier()
    sched, sched2, history = resumed_run(333)
    assert set(sched.state_dict()) >= {"base_lrs", "last_epoch", "_step_count", "_last_lr"}
    assert sched.state_dict()["_max_iter"] == MAX_ITER
    assert history == [bits(expected_lrs(ref, it + 1)) for it in range(333, MAX_ITER)]
    assert sched2.last_epoch == MAX_ITER
    assert sched2._fast


def test_detectron2_state_loads():
    # detectron2's LRMultiplier.state_dict() has only these two keys.
    ref = reference_multiplier()

    def to_d2(state):
        return {"base_lrs": state["base_lrs"], "last_epoch": state["last_epoch"]}

    _, _, history = resumed_run(700, to_d2)
    assert history == [bits(expected_lrs(ref, it + 1)) for it in range(700, MAX_ITER)]


def test_changed_max_iter_continues_over_the_new_length_with_one_warning(caplog):
    # detectron2 evaluates the rest of the schedule over the new length (raising MAX_ITER and
    # resuming); hookloop does the same and says so once. The whole resume is in
    # tests/engine/test_run_extension.py.
    opt = make_optimizer()
    sched = LRMultiplier(opt, multiplier(), MAX_ITER)
    for _ in range(10):
        opt.step()
        sched.step()
    state = sched.state_dict()
    longer = LRMultiplier(make_optimizer(), multiplier(), 2 * MAX_ITER)
    with caplog.at_level("WARNING", logger="hookloop.solver.lr_scheduler"):
        longer.load_state_dict(state)
    (record,) = caplog.records
    msg = record.getMessage()
    assert "max_iter=1000" in msg and "max_iter=2000" in msg and "iteration 10" in msg
    assert longer.last_epoch == 10 and longer._max_iter == 2 * MAX_ITER
    assert bits(longer.get_lr()) == bits(expected_lrs(reference_multiplier(), 10 / 2))


def test_resume_past_max_iter_names_the_iteration():
    # A detectron2 checkpoint (no max_iter saved) at iteration 1000, resumed with a schedule
    # built for 500 iterations.
    opt = make_optimizer()
    sched = LRMultiplier(opt, multiplier(), 500)
    sched.load_state_dict({"base_lrs": list(BASE_LRS), "last_epoch": 1000})
    opt.step()
    with pytest.raises(ValueError, match="iteration 1001 is outside .*max_iter=500"):
        sched.step()


def test_last_iter_resumes_from_optimizer_state():
    opt = make_optimizer()
    LRMultiplier(opt, multiplier(), MAX_ITER)  # sets initial_lr
    sched = LRMultiplier(opt, multiplier(), MAX_ITER, last_iter=649)
    assert sched.last_epoch == 650
    assert bits(lrs(opt)) == bits(expected_lrs(reference_multiplier(), 650))


def test_bad_arguments():
    opt = make_optimizer()
    with pytest.raises(ValueError, match="must be an instance of fvcore ParamScheduler"):
        LRMultiplier(opt, lambda w: 1.0, MAX_ITER)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_iter must be a positive integer, got 0"):
        LRMultiplier(opt, multiplier(), 0)
    with pytest.raises(TypeError, match="max_iter must be an int, got float"):
        LRMultiplier(opt, multiplier(), 10.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_iter must be an int, got bool"):
        LRMultiplier(opt, multiplier(), True)


def test_step_lrs_refuses_bad_input_without_writing():
    sched = LRMultiplier(make_optimizer(), multiplier(), MAX_ITER)._native
    assert sched is not None
    groups = [{"lr": 1.0}, {"lr": 1.0}]
    with pytest.raises(
        ValueError, match="base_lrs has 1 entries but the optimizer has 2 param groups"
    ):
        sched.step_lrs(groups, [0.1], 1, MAX_ITER)
    with pytest.raises(TypeError, match="base_lrs\\[1\\] must be a float, got Tensor"):
        sched.step_lrs(groups, [0.1, torch.tensor(0.1)], 1, MAX_ITER)
    with pytest.raises(TypeError, match="param_groups\\[0\\] must be a dict"):
        sched.step_lrs([("lr", 1.0)], [0.1], 1, MAX_ITER)
    with pytest.raises(TypeError, match="param_groups must be a list"):
        sched.step_lrs(None, [0.1], 1, MAX_ITER)
    with pytest.raises(ValueError, match="iteration -1"):
        sched.step_lrs(groups, [0.1, 0.1], -1, MAX_ITER)
    assert groups == [{"lr": 1.0}, {"lr": 1.0}]


# --- detectron2's legacy schedulers -------------------------------------------------------


def warmup_factor(method, it, warmup_iters, factor):
    if it >= warmup_iters:
        return 1.0
    if method == "constant":
        return factor
    alpha = it / warmup_iters
    return factor * (1 - alpha) + alpha


@pytest.mark.parametrize("method", ["linear", "constant"])
def test_warmup_multi_step_lr(method):
    opt = make_optimizer()
    sched = WarmupMultiStepLR(opt, [300, 700], gamma=0.1, warmup_iters=50, warmup_method=method)
    for it in range(1, 900):
        opt.step()
        sched.step()
        f = warmup_factor(method, it, 50, 0.001)
        want = [b * f * 0.1 ** bisect_right([300, 700], it) for b in BASE_LRS]
        assert bits(lrs(opt)) == bits(want)


def test_warmup_cosine_lr():
    opt = make_optimizer()
    sched = WarmupCosineLR(opt, max_iters=900, warmup_iters=50)
    for it in range(1, 900):
        opt.step()
        sched.step()
        f = warmup_factor("linear", it, 50, 0.001)
        want = [b * f * 0.5 * (1.0 + math.cos(math.pi * it / 900)) for b in BASE_LRS]
        assert bits(lrs(opt)) == bits(want)


def test_legacy_bad_arguments():
    with pytest.raises(ValueError, match="increasing integers"):
        WarmupMultiStepLR(make_optimizer(), [700, 300])
    with pytest.raises(ValueError, match="Unknown warmup method: exp"):
        WarmupCosineLR(make_optimizer(), 100, warmup_method="exp")


def test_cosine_multiplier_end_to_end():
    opt = make_optimizer(lrs=(0.5,))
    sched = LRMultiplier(opt, CosineParamScheduler(1.0, 0.0), 100)
    seen = []
    for _ in range(100):
        opt.step()
        sched.step()
        seen.append(lrs(opt)[0])
    assert seen[-1] == 0.0 and seen[49] == 0.5 * (
        0.0 + 0.5 * (1.0 - 0.0) * (1 + math.cos(math.pi * 0.5))
    )


def test_fvcore_param_scheduler_is_accepted_in_python():
    # A codebase may still build fvcore's schedulers: they run at Python cost.
    FvParamScheduler = type("ParamScheduler", (), {"__module__": "fvcore.common.param_scheduler"})

    class FvConstant(FvParamScheduler):  # type: ignore[misc, valid-type]
        def __call__(self, where: float) -> float:
            return 0.5

    opt = make_optimizer()
    sched = LRMultiplier(opt, FvConstant(), MAX_ITER)  # type: ignore[arg-type]
    assert sched._native is None
    opt.step()
    sched.step()
    assert lrs(opt) == [b * 0.5 for b in BASE_LRS]


@pytest.mark.parametrize("max_iters, exc", [(0, ValueError), (-5, ValueError), ("10", TypeError)])
def test_warmup_cosine_bad_max_iters_names_it(max_iters, exc):
    with pytest.raises(exc, match="WarmupCosineLR max_iters"):
        WarmupCosineLR(make_optimizer(), max_iters)
