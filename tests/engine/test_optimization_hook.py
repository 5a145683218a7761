"""OptimizationHook: gradient accumulation, clipping after unscaling, (scaled) stepping, with
SimpleTrainer/AMPTrainer (which run the backward) and with a forward-only trainer."""

from __future__ import annotations

import functools

import pytest
import torch
from hookloop.engine import AMPTrainer, HookBase, OptimizationHook, SimpleTrainer, TrainerBase
from torch import nn

torch.set_num_threads(1)

B = 4


def _data(n_batches, batch_size):
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n_batches * batch_size, 3, generator=g)
    ys = xs @ torch.tensor([1.0, -2.0, 0.5]) + 0.3
    return [(xs[i : i + batch_size], ys[i : i + batch_size]) for i in range(0, len(xs), batch_size)]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, batch):
        x, y = batch
        return ((self.lin(x).squeeze(1) - y) ** 2).mean()


class ForwardOnly(TrainerBase):
    """A runner-style trainer: run_step runs the forward and leaves the loss for the hook."""

    def __init__(self, model, data, optimizer, autocast=None):
        super().__init__()
        self.model, self.optimizer, self._data = model, optimizer, iter(data)
        self.step_outputs = {}
        self.autocast = autocast

    def run_step(self):
        batch = next(self._data)
        if self.autocast is None:
            loss = self.model(batch)
        else:
            with torch.autocast("cpu", dtype=self.autocast):
                loss = self.model(batch)
        self.step_outputs["loss_for_backward"] = loss


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _reference(steps, accumulate):
    """Plain SimpleTrainer steps on batches of accumulate * B."""
    model = Model()
    trainer = SimpleTrainer(model, _data(steps, accumulate * B), _sgd(model))
    trainer.train(0, steps)
    return model


def _assert_close(a, b):
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("kind", ["simple", "forward_only"])
def test_accumulating_4_steps_of_b_equals_one_step_of_4b(kind):
    model = Model()
    data = _data(12, B)
    if kind == "simple":
        trainer = SimpleTrainer(model, data, _sgd(model))
    else:
        trainer = ForwardOnly(model, data, _sgd(model))
    hook = OptimizationHook(accumulate_grad_steps=4)
    trainer.register_hooks([hook])
    trainer.train(0, 12)
    _assert_close(model, _reference(3, 4))
    if kind == "simple":
        assert trainer.step_optimizer  # restored after training


class CountingSGD(torch.optim.SGD):
    def __init__(self, params, trainer_iter, **kw):
        super().__init__(params, **kw)
        self.calls = []
        self._iter = trainer_iter

    def step(self, closure=None):
        self.calls.append(("step", self._iter()))
        return super().step(closure)

    def zero_grad(self, set_to_none=True):
        self.calls.append(("zero_grad", self._iter()))
        super().zero_grad(set_to_none)


@pytest.mark.parametrize("kind", ["simple", "amp", "forward_only"])
def test_the_optimizer_is_called_only_on_stepping_iterations(kind):
    model = Model()
    holder = {}
    opt = CountingSGD(model.parameters(), lambda: holder["t"].iter, lr=0.1)
    data = _data(10, B)
    trainer = {
        "simple": lambda: SimpleTrainer(model, data, opt),
        "amp": lambda: AMPTrainer(model, data, opt),
        "forward_only": lambda: ForwardOnly(model, data, opt),
    }[kind]()
    holder["t"] = trainer
    trainer.register_hooks([OptimizationHook(accumulate_grad_steps=3)])
    trainer._hookloop.dispatcher.timing = True
    trainer.train(0, 10)
    # Steps at 2, 5, 8 and the last iteration; zeroed once before training and after each.
    steps = [2, 5, 8, 9]
    assert opt.calls == [("zero_grad", 0)] + [(c, i) for i in steps for c in ("step", "zero_grad")]
    (after_step_calls,) = [
        calls for _h, stage, calls, *_rest in trainer.hook_stats() if stage == "after_step"
    ]
    # With a trainer that runs the backward, the dispatcher skips the hook between steps.
    assert after_step_calls == (4 if kind != "forward_only" else 10)


def test_clipping_happens_after_unscaling_and_bounds_the_update():
    model = Model()
    seen = []

    def clipper(params):
        params = list(params)
        seen.append(torch.nn.utils.clip_grad_norm_(params, max_norm=0.01).item())

    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # A scaler that really scales on the CPU: the clipper must see unscaled gradients.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer = AMPTrainer(model, _data(2, B), opt, grad_scaler=scaler, precision=torch.bfloat16)
    trainer.register_hooks([OptimizationHook(accumulate_grad_steps=2, grad_clipper=clipper)])
    trainer.train(0, 2)
    assert len(seen) == 1
    # The unscaled norm of the mean gradient: recomputed without scaling or clipping.
    ref = Model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [ref(b) for b in _data(2, B)]
    (sum(losses) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm=1e9).item()
    assert seen[0] == pytest.approx(norm, rel=1e-3)
    assert norm > 0.01
    update = torch.sqrt(
        sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before))
    )
    assert update.item() == pytest.approx(0.01, rel=1e-3)


def test_bf16_mixed_precision_on_cpu_forward_only():
    model = Model()
    trainer = ForwardOnly(model, _data(8, B), _sgd(model), autocast=torch.bfloat16)
    hook = OptimizationHook(
        accumulate_grad_steps=2,
        mixed_precision=True,
        grad_clipper=functools.partial(torch.nn.utils.clip_grad_norm_, max_norm=10.0),
    )
    trainer.register_hooks([hook])
    trainer.train(0, 8)
    ref = ForwardOnly(Model(), _data(8, B), None)
    assert hook.grad_scaler is not None and not hook.grad_scaler.is_enabled()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(model.lin.weight, ref.model.lin.weight)
    # bf16 forward, float32 gradients and parameters: close to the float32 run.
    _assert_close_loose(model, _reference(4, 2))
    assert "grad_scaler" in hook.state_dict()


def _assert_close_loose(a, b):
    for v, w in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=0.05, atol=0.05)


def test_bf16_amp_trainer_accumulates():
    model = Model()
    trainer = AMPTrainer(model, _data(8, B), _sgd(model), precision=torch.bfloat16)
    trainer.register_hooks([OptimizationHook(accumulate_grad_steps=4, mixed_precision=True)])
    trainer.train(0, 8)
    _assert_close_loose(model, _reference(2, 4))


def test_ddp_no_sync_on_iterations_that_do_not_step(tmp_path):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        model = Model()
        ddp = nn.parallel.DistributedDataParallel(model)
        synced = []

        class Probe(HookBase):
            def before_step(self):
                synced.append(ddp.require_backward_grad_sync)

        trainer = SimpleTrainer(ddp, _data(8, B), _sgd(ddp))
        trainer.register_hooks([Probe(), OptimizationHook(accumulate_grad_steps=4)])
        trainer.train(0, 8)
        assert synced == [False, False, False, True] * 2
        assert ddp.require_backward_grad_sync
        _assert_close(model, _reference(2, 4))
    finally:
        dist.destroy_process_group()


def test_errors():
    for kwargs, error, name in [
        ({"accumulate_grad_steps": 0}, ValueError, "accumulate_grad_steps"),
        ({"accumulate_grad_steps": "2"}, TypeError, "accumulate_grad_steps"),
        ({"accumulate_grad_steps": True}, TypeError, "accumulate_grad_steps"),
        ({"grad_clipper": 1.0}, TypeError, "grad_clipper"),
        ({"mixed_precision": "yes"}, TypeError, "mixed_precision"),
    ]:
        with pytest.raises(error, match=name):
            OptimizationHook(**kwargs)

    model = Model()
    trainer = SimpleTrainer(model, _data(2, B), _sgd(model))
    trainer.register_hooks([OptimizationHook(mixed_precision=True)])
    with pytest.raises(ValueError, match="AMPTrainer"):
        trainer.train(0, 2)

    class NoLoss(ForwardOnly):
        def run_step(self):
            pass

    trainer = NoLoss(model, _data(2, B), _sgd(model))
    trainer.register_hooks([OptimizationHook()])
    with pytest.raises(KeyError, match="loss_for_backward"):
        trainer.train(0, 2)

    class NoOptimizer(TrainerBase):
        def run_step(self):
            pass

    trainer = NoOptimizer()
    trainer.register_hooks([OptimizationHook()])
    with pytest.raises(TypeError, match="optimizer"):
        trainer.train(0, 2)


def test_a_wrapped_simple_trainer_is_used_as_in_default_trainer():
    class Wrapper(TrainerBase):
        def __init__(self, inner):
            super().__init__()
            self._trainer = inner

        def run_step(self):
            self._trainer.iter = self.iter
            self._trainer.run_step()

    model = Model()
    inner = SimpleTrainer(model, _data(12, B), _sgd(model))
    trainer = Wrapper(inner)
    trainer.register_hooks([OptimizationHook(accumulate_grad_steps=4)])
    trainer.train(0, 12)
    _assert_close(model, _reference(3, 4))
    assert inner.step_optimizer


def test_a_step_with_no_gradients_at_all_is_a_plain_step():
    # Nothing ran a backward (a frozen model, a step that skipped its loss): the step finds no
    # gradient to divide and steps nothing, as optimizer.step() would.
    class NoBackward(SimpleTrainer):
        def run_step(self):
            pass

    model = Model()
    before = model.lin.weight.detach().clone()
    trainer = NoBackward(model, _data(1, B), torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.register_hooks([OptimizationHook(accumulate_grad_steps=2)])
    trainer.train(0, 4)
    assert torch.equal(model.lin.weight, before)


def test_a_simple_trainer_subclass_whose_run_step_runs_only_the_forward():
    """cvpods' runners subclass their SimpleTrainer and override run_step with the forward
    alone: the hook sees the loss in step_outputs and runs the backward itself."""

    class Runner(SimpleTrainer):
        def run_step(self):
            try:
                batch = next(self._data_loader_iter)
            except StopIteration:
                batch = self._hookloop.data.next_epoch(self)
            self.step_outputs = {"loss_for_backward": self.model(batch)}

    model = Model()
    trainer = Runner(model, _data(4, B), _sgd(model))  # 2 epochs of 4 batches
    trainer.register_hooks([OptimizationHook(accumulate_grad_steps=4)])
    trainer.train(0, 8)
    assert trainer.epoch == 1
    _assert_close(model, _two_steps_of_4b_twice())
    assert trainer.step_optimizer is True  # restored after training


def _two_steps_of_4b_twice():
    # 8 iterations of batch B, accumulating 4: one step per epoch over the same 4 batches, as
    # two plain steps of batch 4B over those batches.
    model = Model()
    batches = _data(4, B)
    big = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    trainer = SimpleTrainer(model, [big, big], _sgd(model))
    trainer.train(0, 2)
    return model
