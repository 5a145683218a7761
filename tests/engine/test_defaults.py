"""DefaultTrainer and TrainConfig (hookloop.engine.defaults): the config's loaders and checks,
each build_* override point, detectron2's default hook list, a run's output files, and a
resume that ends with the weights of an uninterrupted run."""

from __future__ import annotations

import gc
import json
import logging
import math
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from hookloop.data import TrainingSampler
from hookloop.engine import (
    AMPTrainer,
    DefaultTrainer,
    HookBase,
    SimpleTrainer,
    TrainConfig,
    defaults,
    hooks,
)
from hookloop.solver import LRMultiplier
from hookloop.utils.events import EventWriter, get_event_storage
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DIM = 4


# DefaultTrainer would otherwise set hookloop's logger up (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("hookloop_logs_info")


class Toy(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 8), nn.BatchNorm1d(8) if bn else nn.Identity())
        self.head = nn.Linear(8, 1)

    def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
        x, y = batch
        out = self.head(torch.relu(self.body(x)))
        return {"loss_mse": ((out - y) ** 2).mean(), "loss_l1": 0.1 * (out - y).abs().mean()}


def make_loader(seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(123)
    xs = torch.randn(64, DIM, generator=g)
    ys = xs.sum(1, keepdim=True)
    return DataLoader(TensorDataset(xs, ys), batch_size=8, sampler=TrainingSampler(64, seed=seed))


class ToyTrainer(DefaultTrainer):
    bn = False

    @classmethod
    def build_model(cls, cfg: TrainConfig) -> nn.Module:
        return Toy(cls.bn)

    @classmethod
    def build_train_loader(cls, cfg: TrainConfig) -> Any:
        return make_loader()


class BNTrainer(ToyTrainer):
    bn = True


def config(tmp_path: Path, **kw: Any) -> TrainConfig:
    base: Dict[str, Any] = dict(
        max_iter=20,
        output_dir=str(tmp_path),
        checkpoint_period=10,
        log_period=5,
        base_lr=0.05,
        warmup_iters=4,
        seed=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def hook_types(trainer: DefaultTrainer) -> List[type]:
    return [type(h) for h in trainer._hooks]


# ----------------------------------------------------------------------------------------------
# TrainConfig


def test_config_from_dict_keeps_defaults_and_normalizes():
    cfg = TrainConfig.from_dict({"max_iter": 100, "lr_steps": [30, 60], "base_lr": 1})
    assert cfg.max_iter == 100 and cfg.lr_steps == (30, 60)
    assert cfg.base_lr == 1.0 and isinstance(cfg.base_lr, float)
    assert cfg.checkpoint_period == 5000 and cfg.eval_period == 0 and cfg.amp is False
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_config_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match=r"no field 'max_itr'; did you mean 'max_iter'"):
        TrainConfig.from_dict({"max_itr": 10})
    with pytest.raises(TypeError, match="mapping"):
        TrainConfig.from_dict([("max_iter", 10)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_iter", "10"),
        ("max_iter", 10.0),
        ("amp", 1),
        ("base_lr", "0.1"),
        ("lr_steps", [1.5]),
        ("lr_steps", 10),
        ("output_dir", None),
        ("max_to_keep", "3"),
    ],
)
def test_config_wrong_type_names_the_key(key, value):
    with pytest.raises(TypeError, match=rf"TrainConfig\.{key} must be"):
        TrainConfig.from_dict({key: value})


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_iter", 0),
        ("checkpoint_period", 0),
        ("log_period", -1),
        ("eval_period", -5),
        ("window_size", 0),
        ("base_lr", 0.0),
        ("lr_gamma", 0.0),
        ("max_to_keep", 0),
        ("base_lr_end", 1.0),
        ("warmup_method", "cubic"),
        ("best_mode", "up"),
        ("lr_steps", [20, 10]),
        ("lr_steps", [0, 10]),
        ("seed", 2**32),
        ("max_iter", 2**53 + 1),
        ("lr_steps", [10, 2**60]),
        ("window_size", 2**64),
    ],
)
def test_config_bad_value_names_the_key(key, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{key} "):
        TrainConfig.from_dict({key: value})


@pytest.mark.parametrize(
    "key, value",
    [
        ("seed", 2**70),  # was accepted, then training failed: "Overflow when unpacking long long"
        *[(key, math.nan) for key in ("base_lr", "momentum", "warmup_factor", "lr_gamma")],
        *[(key, math.inf) for key in ("base_lr", "momentum", "warmup_factor", "lr_gamma")],
        ("base_lr_end", -math.inf),
        ("weight_decay", math.nan),
        ("weight_decay_norm", math.inf),
    ],
)
def test_config_refuses_at_construction_what_training_would_fail_on(key, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{key} must be (finite|below 2\*\*32)"):
        TrainConfig(**{key: value})
    with pytest.raises(ValueError, match=rf"TrainConfig\.{key} must be"):
        TrainConfig.from_dict({key: value})  # as YAML's .nan and .inf read


def test_config_seed_takes_what_the_generators_take(tmp_path):
    assert TrainConfig(seed=2**32 - 1).seed == 2**32 - 1
    assert TrainConfig(seed=-(2**70)).seed == -(2**70)  # negative: drawn from the OS


def test_config_checked_again_by_the_trainer(tmp_path):
    cfg = config(tmp_path)
    cfg.max_iter = "20"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="max_iter"):
        ToyTrainer(cfg)


def test_config_from_yaml(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("max_iter: 50\nlr_steps: [10, 20]\noutput_dir: out\namp: true\n")
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.max_iter, cfg.lr_steps, cfg.output_dir, cfg.amp) == (50, (10, 20), "out", True)

    # YAML 1.1 reads 1e-3 as a string; a float field takes it as the number.
    path.write_text("base_lr: 1e-3\nweight_decay: 5.0e-4\n")
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.base_lr, cfg.weight_decay) == (1e-3, 5e-4)
    path.write_text("base_lr: fast\n")
    with pytest.raises(TypeError, match="base_lr"):
        TrainConfig.from_yaml(path)

    path.write_text("max_iter: fifty\n")
    with pytest.raises(TypeError, match="max_iter"):
        TrainConfig.from_yaml(path)
    path.write_text("- max_iter\n")
    with pytest.raises(ValueError, match="mapping"):
        TrainConfig.from_yaml(path)
    path.write_text("")
    assert TrainConfig.from_yaml(path) == TrainConfig()


def test_config_from_yaml_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ImportError, match=r"hookloop\[yaml\]"):
        TrainConfig.from_yaml(tmp_path / "train.yaml")


def test_config_merge_overrides():
    cfg = TrainConfig().merge_overrides(
        [
            "max_iter=100",
            "lr_steps=[10,20]",
            "output_dir=/tmp/run 1",
            "amp=true",
            "nesterov=True",
            "best_metric=val/accuracy",
            "max_to_keep=None",
            "weights='w.pth'",
            "base_lr=2",
        ]
    )
    assert cfg.max_iter == 100 and cfg.lr_steps == (10, 20)
    assert cfg.amp is True and cfg.nesterov is True
    assert cfg.output_dir == "/tmp/run 1" and cfg.best_metric == "val/accuracy"
    assert cfg.max_to_keep is None and cfg.weights == "w.pth" and cfg.base_lr == 2.0
    # The original is unchanged.
    assert TrainConfig().max_iter == 40000


@pytest.mark.parametrize(
    "override, error, match",
    [
        ("max_iter", ValueError, "key=value"),
        ("=3", ValueError, "key=value"),
        ("nope=1", ValueError, "no field 'nope'"),
        ("max_iter=abc", ValueError, "max_iter"),
        ("max_iter=1.5", TypeError, "max_iter"),
        ("lr_steps=[10,", ValueError, "lr_steps"),
        ("max_iter=0", ValueError, "max_iter"),
        ("amp=yes", ValueError, "amp"),
        ("amp=1", TypeError, "amp"),
    ],
)
def test_config_bad_override_names_the_key(override, error, match):
    with pytest.raises(error, match=match):
        TrainConfig().merge_overrides([override])


def test_config_subclass_fields_are_loaded():
    @dataclass
    class MyConfig(TrainConfig):
        hidden: int = 8

    cfg = MyConfig.from_dict({"hidden": 16}).merge_overrides(["max_iter=5"])
    assert isinstance(cfg, MyConfig) and (cfg.hidden, cfg.max_iter) == (16, 5)
    with pytest.raises(TypeError, match=r"MyConfig\.hidden"):
        MyConfig.from_dict({"hidden": "16"})


# ----------------------------------------------------------------------------------------------
# Construction and the default hooks


def test_build_model_and_loader_must_be_overridden(tmp_path):
    with pytest.raises(NotImplementedError, match="overwrite build_model"):
        DefaultTrainer(config(tmp_path))

    class NoLoader(DefaultTrainer):
        @classmethod
        def build_model(cls, cfg):
            return Toy()

    with pytest.raises(NotImplementedError, match="overwrite build_train_loader"):
        NoLoader(config(tmp_path))
    with pytest.raises(TypeError, match="TrainConfig"):
        ToyTrainer({"max_iter": 10})  # type: ignore[arg-type]


def test_wraps_simple_trainer_and_forwards_its_attributes(tmp_path):
    trainer = ToyTrainer(config(tmp_path))
    assert type(trainer._trainer) is SimpleTrainer
    assert trainer.model is trainer._trainer.model
    assert trainer.optimizer is trainer._trainer.optimizer
    assert trainer.data_loader is trainer._trainer.data_loader
    loader = make_loader(seed=1)
    trainer.data_loader = loader
    assert trainer._trainer.data_loader is loader
    assert (trainer.start_iter, trainer.max_iter, trainer.iter) == (0, 20, 0)
    assert isinstance(trainer.scheduler, LRMultiplier)
    assert trainer.checkpointer.save_dir == str(tmp_path)


class PendingWatch(HookBase):
    """Records, after each step, how many iterations' losses wait unread in the storage's
    pending queue (not reading them: ``_pending_counts`` does not settle)."""

    def __init__(self) -> None:
        self.pending: List[int] = []

    def after_step(self) -> None:
        self.pending.append(self.trainer.storage._pending_counts()[0])


@pytest.mark.parametrize("amp", [False, True])
def test_the_wrapped_trainers_losses_are_read_in_batches(tmp_path, amp):
    """The wrapped SimpleTrainer (AMPTrainer) is set up for the run as its own before_train
    would: its losses wait in the storage's pending queue and are read in one batch when the
    writers (every log_period = 5 iterations) need them, not once per step. The values
    written are those of a run that reads them at every step."""
    runs = {}
    for name, every_step in (("batched", False), ("every", True)):
        trainer = ToyTrainer(config(tmp_path / name, amp=amp))
        trainer._trainer.check_finite_every_step = every_step
        watch = PendingWatch()
        trainer.register_hooks([watch])
        trainer.train()
        with open(tmp_path / name / "metrics.json") as f:
            rows = [json.loads(line) for line in f]
        losses = [{k: v for k, v in r.items() if "loss" in k or k == "iteration"} for r in rows]
        runs[name] = (watch.pending, losses)
    batched, every = runs["batched"], runs["every"]
    assert max(batched[0]) >= 4, batched[0]  # up to a period's losses wait unread
    assert max(every[0]) == 0
    assert batched[1] == every[1] and len(batched[1]) == 4


def test_amp_wraps_amp_trainer(tmp_path):
    trainer = ToyTrainer(config(tmp_path, amp=True, max_iter=3, warmup_iters=0))
    assert type(trainer._trainer) is AMPTrainer
    trainer.train()
    assert trainer.iter == 3


def test_default_hooks_in_detectron2_order(tmp_path):
    assert hook_types(ToyTrainer(config(tmp_path))) == [
        hooks.IterationTimer,
        hooks.LRScheduler,
        hooks.PeriodicCheckpointer,
        hooks.EvalHook,
        hooks.PeriodicWriter,
    ]
    cfg = config(tmp_path, precise_bn=True, precise_bn_iters=3, best_metric="val/acc")
    assert hook_types(BNTrainer(cfg)) == [
        hooks.IterationTimer,
        hooks.LRScheduler,
        hooks.PreciseBN,
        hooks.PeriodicCheckpointer,
        hooks.EvalHook,
        hooks.BestCheckpointer,
        hooks.PeriodicWriter,
    ]
    # PreciseBN only for a model with BN layers.
    assert hooks.PreciseBN not in hook_types(ToyTrainer(cfg))


def test_other_processes_get_no_checkpointer_or_writers(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults.comm, "is_main_process", lambda: False)
    trainer = ToyTrainer(config(tmp_path / "rank1", best_metric="val/acc"))
    assert hook_types(trainer) == [hooks.IterationTimer, hooks.LRScheduler, hooks.EvalHook]
    assert trainer.checkpointer.save_to_disk is False
    assert not (tmp_path / "rank1").exists()


def test_sets_up_the_logger_when_info_would_be_dropped(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(defaults, "setup_logger", lambda: calls.append(1))
    logging.getLogger("hookloop").setLevel(logging.WARNING)
    ToyTrainer(config(tmp_path))
    assert calls == [1]


def test_seed_makes_the_model_deterministic(tmp_path):
    a = ToyTrainer(config(tmp_path / "a", seed=7)).model.state_dict()
    b = ToyTrainer(config(tmp_path / "b", seed=7)).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------
# The schedule


def lrs(trainer: DefaultTrainer, n: int) -> List[float]:
    out = []
    for _ in range(n):
        out.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.scheduler.step()
    return out


def test_multistep_schedule_with_warmup(tmp_path):
    cfg = config(tmp_path, max_iter=20, lr_steps=[10, 15, 20], warmup_iters=4, base_lr=0.5)
    got = lrs(ToyTrainer(cfg), 20)
    for it, lr in enumerate(got):
        if it < 4:
            alpha = it / 4
            want = 0.5 * (0.001 * (1 - alpha) + alpha)
        else:
            want = 0.5 * 0.1 ** sum(it >= s for s in (10, 15))
        assert lr == pytest.approx(want, rel=1e-12), it


def test_cosine_schedule_without_steps(tmp_path):
    cfg = config(tmp_path, max_iter=20, warmup_iters=0, base_lr=0.5, base_lr_end=0.1)
    got = lrs(ToyTrainer(cfg), 20)
    for it, lr in enumerate(got):
        want = 0.5 * (0.2 + 0.5 * (1 - 0.2) * (1 + math.cos(math.pi * it / 20)))
        assert lr == pytest.approx(want, rel=1e-12), it


def test_optimizer_gives_norm_layers_their_weight_decay(tmp_path):
    trainer = BNTrainer(config(tmp_path, weight_decay=1e-4, weight_decay_norm=0.0))
    groups = trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]
    assert len(groups[1]["params"]) == 2  # the BN layer's weight and bias
    assert groups[0]["momentum"] == 0.9 and groups[0]["lr"] == pytest.approx(0.05 * 0.001)


# ----------------------------------------------------------------------------------------------
# Running


def test_short_run_writes_metrics_events_and_checkpoints(tmp_path):
    trainer = ToyTrainer(config(tmp_path))
    trainer.resume_or_load(resume=True)  # nothing to resume: starts at 0
    assert trainer.start_iter == 0
    assert trainer.train() == {}  # the default test() evaluates nothing
    assert trainer.iter == 20

    rows = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [4, 9, 14, 19]
    assert {"total_loss", "loss_mse", "loss_l1", "lr", "time", "data_time"} <= set(rows[-1])

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("total_loss")] == [4, 9, 14, 19]

    names = sorted(p.name for p in tmp_path.glob("*.pth"))
    assert names == ["model_0000009.pth", "model_0000019.pth", "model_final.pth"]
    assert (tmp_path / "last_checkpoint").read_text() == "model_final.pth"
    state = torch.load(tmp_path / "model_final.pth", map_location="cpu", weights_only=False)
    assert state["iteration"] == 19 and state["trainer"]["_trainer"]["iteration"] == 19


def test_a_finite_loader_runs_epochs_named_in_checkpoints_and_log_lines(tmp_path, caplog):
    class EpochTrainer(ToyTrainer):
        @classmethod
        def build_train_loader(cls, cfg: TrainConfig) -> Any:
            g = torch.Generator().manual_seed(123)
            xs = torch.randn(64, DIM, generator=g)
            return DataLoader(TensorDataset(xs, xs.sum(1, keepdim=True)), batch_size=8)

    caplog.set_level(logging.INFO, logger="hookloop")
    trainer = EpochTrainer(config(tmp_path))  # 20 iterations of 8 batches: 3 epochs
    assert (trainer.iters_per_epoch, trainer.epoch) == (8, 0)
    trainer.train()
    assert trainer.epoch == 2
    names = sorted(p.name for p in tmp_path.glob("*.pth"))
    assert names == [
        "model_Epoch_00001_Iter_0000009.pth",
        "model_Epoch_00002_Iter_0000019.pth",
        "model_final.pth",
    ]
    lines = [r.getMessage() for r in caplog.records if r.name == "hookloop.utils.events"]
    assert [line.split("  iter: ")[1].split("  total_loss")[0] for line in lines] == [
        "4  epoch: 1/3",
        "9  epoch: 2/3",
        "14  epoch: 2/3",
        "19  epoch: 3/3",
    ]


class StopAt(HookBase):
    """Fails the run at the start of iteration `at` (a crash after a checkpoint)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def before_step(self) -> None:
        if self.trainer.iter == self.at:
            raise RuntimeError(f"stopped at {self.at}")


def final_state(trainer: DefaultTrainer) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("amp", [False, True])
def test_resume_continues_and_matches_an_uninterrupted_run(tmp_path, amp):
    straight = ToyTrainer(config(tmp_path / "straight", lr_steps=[12], amp=amp))
    straight.resume_or_load()
    straight.train()
    want = final_state(straight)

    out = tmp_path / "resumed"
    first = ToyTrainer(config(out, lr_steps=[12], amp=amp))
    first.register_hooks([StopAt(13)])
    first.resume_or_load()
    with pytest.raises(RuntimeError, match="stopped at 13"):
        first.train()
    assert (out / "last_checkpoint").read_text() == "model_0000009.pth"
    del first

    # Anything to move the RNGs: the checkpoint restores them.
    torch.manual_seed(99)
    second = ToyTrainer(config(out, lr_steps=[12], amp=amp))
    second.resume_or_load(resume=True)
    assert second.start_iter == 10 and second.iter == 9
    second.train()
    assert second.iter == 20
    got = final_state(second)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert second.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    # The resumed run's lines continue the first run's in metrics.json.
    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["iteration"] >= 10] == [14, 19]


def test_without_resume_loads_weights_and_starts_at_zero(tmp_path):
    trained = ToyTrainer(config(tmp_path / "a", max_iter=5))
    trained.train()
    weights = tmp_path / "a" / "model_final.pth"

    out = tmp_path / "b"
    trainer = ToyTrainer(config(out, max_iter=5, seed=3, weights=str(weights)))
    trainer.resume_or_load(resume=False)
    assert trainer.start_iter == 0
    got, want = final_state(trainer), final_state(trained)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # resume=True with no checkpoint in output_dir: the weights too.
    again = ToyTrainer(config(tmp_path / "c", max_iter=5, seed=3, weights=str(weights)))
    again.resume_or_load(resume=True)
    assert again.start_iter == 0
    assert all(torch.equal(final_state(again)[k], want[k]) for k in want)


class _RunsCode:
    """Unpickled, it makes the directory ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        import os

        return (os.mkdir, (self.marker,))


def test_resume_or_load_refuses_code_in_weights_unless_told_to_trust_them(tmp_path):
    """``cfg.weights`` loads with ``weights_only=True``: a file holding code is refused naming
    it and the opt-in, and runs nothing; ``resume_or_load(weights_only=False)`` trusts it."""
    marker = tmp_path / "code_ran"
    weights = tmp_path / "weights.pth"
    torch.save({"model": Toy().state_dict(), "x": _RunsCode(str(marker))}, weights)
    trainer = ToyTrainer(config(tmp_path / "out", weights=str(weights)))
    with pytest.raises(ValueError, match=rf"{weights}.*weights_only=False"):
        trainer.resume_or_load(resume=False)
    assert not marker.exists()
    trainer.resume_or_load(resume=False, weights_only=False)
    assert marker.is_dir()


def test_load_state_dict_needs_a_default_trainer_state(tmp_path):
    trainer = ToyTrainer(config(tmp_path))
    with pytest.raises(ValueError, match="_trainer"):
        trainer.load_state_dict({"iteration": 3})


# ----------------------------------------------------------------------------------------------
# The override points


class Recorder(EventWriter):
    def __init__(self) -> None:
        self.iters: List[int] = []

    def write(self) -> None:
        self.iters.append(get_event_storage().iter)


class Marker(HookBase):
    def __init__(self) -> None:
        self.backwards = 0

    def after_backward(self) -> None:
        self.backwards += 1


def test_each_build_method_can_be_overridden(tmp_path):
    calls: List[str] = []

    class Custom(ToyTrainer):
        @classmethod
        def build_model(cls, cfg):
            calls.append("model")
            return Toy(bn=True)

        @classmethod
        def build_optimizer(cls, cfg, model):
            calls.append("optimizer")
            return torch.optim.Adam(model.parameters(), lr=cfg.base_lr)

        @classmethod
        def build_lr_scheduler(cls, cfg, optimizer):
            calls.append("lr_scheduler")
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)

        @classmethod
        def build_train_loader(cls, cfg):
            calls.append("train_loader")
            return make_loader()

        @classmethod
        def build_test_loader(cls, cfg):
            calls.append("test_loader")
            return make_loader(seed=5)

        def build_writers(self):
            calls.append("writers")
            self.recorder = Recorder()
            return [self.recorder]

        def build_hooks(self):
            calls.append("hooks")
            self.marker = Marker()
            return [*super().build_hooks(), self.marker]

        @classmethod
        def test(cls, cfg, model):
            loader = iter(cls.build_test_loader(cfg))
            model.eval()
            with torch.no_grad():
                loss = sum(model(next(loader))["loss_mse"].item() for _ in range(2))
            model.train()
            return {"val": {"loss": loss}}

    cfg = config(tmp_path, max_iter=10, eval_period=5, best_metric="val/loss", best_mode="min")
    trainer = Custom(cfg)
    assert calls == ["model", "optimizer", "train_loader", "lr_scheduler", "hooks", "writers"]
    assert isinstance(trainer.optimizer, torch.optim.Adam)
    results = trainer.train()

    assert set(results) == {"val"} and math.isfinite(results["val"]["loss"])
    assert calls.count("test_loader") == 2  # at iteration 4 and after training
    assert trainer.recorder.iters == [4, 9, 10]  # and after training, as detectron2
    assert trainer.marker.backwards == 10  # hooks' after_backward runs
    # StepLR stepped once per iteration by the LRScheduler hook.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)
    assert trainer.storage.latest()["val/loss"][1] == 10  # the evaluation after training
    assert (tmp_path / "model_best.pth").exists()
    assert not (tmp_path / "metrics.json").exists()


def test_default_test_evaluates_nothing(tmp_path):
    trainer = ToyTrainer(config(tmp_path, max_iter=4, eval_period=2))
    assert ToyTrainer.test(trainer.cfg, trainer.model) == {}
    assert trainer.train() == {}
    assert not any(k.startswith("val") for k in trainer.storage.latest())
    with pytest.raises(NotImplementedError, match="build_test_loader"):
        ToyTrainer.build_test_loader(trainer.cfg)


def test_precise_bn_runs_on_a_second_loader(tmp_path):
    cfg = config(tmp_path, max_iter=4, precise_bn=True, precise_bn_iters=3)
    trainer = BNTrainer(cfg)
    trainer.train()
    # After the last step, PreciseBN set the running mean to the true mean over 3 batches of
    # its own loader (a fresh one: the same first batches as the training loader's).
    linear, bn = trainer.model.body
    batches = iter(make_loader())
    with torch.no_grad():
        want = torch.stack([linear(next(batches)[0]).mean(0) for _ in range(3)]).mean(0)
    torch.testing.assert_close(bn.running_mean, want, rtol=1e-5, atol=1e-6)


def test_steps_past_max_iter_are_ignored(tmp_path):
    cfg = config(tmp_path, max_iter=20, lr_steps=[10, 20, 30], warmup_iters=0, base_lr=0.5)
    got = lrs(ToyTrainer(cfg), 20)
    assert got == pytest.approx([0.5] * 10 + [0.05] * 10, rel=1e-12)


def test_a_subclass_after_backward_runs(tmp_path):
    seen = []

    class Own(ToyTrainer):
        def after_backward(self):
            seen.append(self.iter)
            super().after_backward()

    trainer = Own(config(tmp_path, max_iter=3))
    trainer.train()
    assert seen == [0, 1, 2]
    ref = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert ref() is None


def test_trainer_is_freed_without_the_cycle_collector(tmp_path):
    # The checkpointer holds a weak proxy and the evaluation closure a weak reference. (The
    # writers are left out: CommonMetricPrinter.write keeps its own frame in a local, a cycle
    # through the caller frames that only the collector frees.)
    class Quiet(ToyTrainer):
        def build_writers(self):
            return [Recorder()]

    trainer = Quiet(config(tmp_path, max_iter=3, eval_period=2))
    trainer.train()
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert ref() is None
    finally:
        gc.enable()


def test_one_process_trains_the_model_unwrapped(tmp_path):
    model = Toy()
    assert defaults.create_ddp_model(model, broadcast_buffers=False) is model
    writers = defaults.default_writers(tmp_path / "w", max_iter=10, window_size=5)
    assert [type(w).__name__ for w in writers] == [
        "CommonMetricPrinter",
        "JSONWriter",
        "TensorboardXWriter",
    ]
    for w in writers:
        w.close()
    assert (tmp_path / "w" / "metrics.json").exists()


def test_async_metric_writes_of_the_wrapped_trainer_are_waited_for(tmp_path):
    """The periodic writer of a DefaultTrainer waits for its wrapped trainer's asynchronous
    metric writes (they live on ``trainer._trainer``): each line carries its losses, as in
    the synchronous mode."""

    def run(out: Path, async_write: bool) -> List[Dict[str, Any]]:
        t = ToyTrainer(config(out, log_period=1, checkpoint_period=100))
        t._trainer.async_write_metrics = async_write
        t.train()
        rows = [json.loads(x) for x in (out / "metrics.json").read_text().splitlines()]
        return [
            {k: v for k, v in r.items() if "time" not in k and k != "eta_seconds"} for r in rows
        ]

    sync_rows = run(tmp_path / "sync", False)
    assert all("loss_mse" in r for r in sync_rows)
    assert run(tmp_path / "async", True) == sync_rows


def test_a_subclass_assigns_its_own_epoch_and_iters_per_epoch(tmp_path):
    # detectron2's DefaultTrainer has neither name: xmodaler-style subclasses set their own.
    class OwnEpochs(ToyTrainer):
        def __init__(self, cfg: TrainConfig) -> None:
            super().__init__(cfg)
            self.iters_per_epoch = 5
            self.epoch = 0

    trainer = OwnEpochs(config(tmp_path))
    assert (trainer.iters_per_epoch, trainer.epoch) == (5, 0)
    trainer.epoch = 3
    assert trainer.epoch == 3 and trainer._trainer.epoch == 0
