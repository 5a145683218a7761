"""A config-light ``DefaultTrainer``, mirroring ``detectron2.engine.defaults``.

detectron2's ``DefaultTrainer`` reads a yacs ``CfgNode`` and builds its model and data from
the model zoo. hookloop has no model zoo: the configuration is :class:`TrainConfig`, a small
typed dataclass (loadable from a dict, a YAML file or ``key=value`` command-line overrides),
and ``build_model`` / ``build_train_loader`` are the override points a subclass must fill in.
Everything else (optimizer, warmup + cosine or multi-step schedule, checkpointing, evaluation,
the writers and the default hook list) has a default, with detectron2's names and order.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import logging
import math
import os
import random
import typing
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Type, TypeVar, Union

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

import hookloop.engine.hooks as hooks
from hookloop.checkpoint import DetectionCheckpointer
from hookloop.engine.additions import Added
from hookloop.engine.graph import CUDAGraphTrainer
from hookloop.engine.train_loop import AMPTrainer, HookBase, SimpleTrainer, TrainerBase
from hookloop.nn.precise_bn import get_bn_modules
from hookloop.solver import LRMultiplier, WarmupParamScheduler
from hookloop.solver.param_scheduler import CosineParamScheduler, MultiStepParamScheduler
from hookloop.utils import comm
from hookloop.utils.events import CommonMetricPrinter, EventWriter, JSONWriter, TensorboardXWriter
from hookloop.utils.logger import setup_logger

__all__ = ["DefaultTrainer", "TrainConfig", "create_ddp_model", "default_writers"]

logger = logging.getLogger(__name__)

_C = TypeVar("_C", bound="TrainConfig")


# ----------------------------------------------------------------------------------------------
# The configuration


@dataclass
class TrainConfig:
    """What :class:`DefaultTrainer` needs to know, as typed fields with detectron2's defaults
    (``cfg.SOLVER.*``, ``cfg.TEST.*``, ``cfg.OUTPUT_DIR``, ``cfg.SEED``) where detectron2 has
    one.

    Build it directly (``TrainConfig(max_iter=1000)``), with :meth:`from_dict`,
    :meth:`from_yaml` or :meth:`merge_overrides`. Every way checks each field's type and value
    and raises ``TypeError``/``ValueError`` naming the field. To add fields of your own,
    subclass it as another ``@dataclass``: the loaders read the subclass's fields.

    Attributes:
        max_iter: iterations to train (``SOLVER.MAX_ITER``).
        output_dir: where checkpoints, ``metrics.json`` and TensorBoard events go.
        weights: a checkpoint to initialize the model from when not resuming
            (``MODEL.WEIGHTS``); "" for none.
        checkpoint_period: save ``model_<iter>.pth`` every N iterations.
        max_to_keep: keep only the newest N periodic checkpoints (None: keep all).
        eval_period: run :meth:`DefaultTrainer.test` every N iterations; 0 only after training.
        log_period: write metrics (console, metrics.json, TensorBoard) every N iterations.
        window_size: median-smoothing window of the writers.
        amp: train with :class:`AMPTrainer` (bfloat16 autocast on a CPU).
        cuda_graph: train with :class:`~hookloop.engine.graph.CUDAGraphTrainer` (the whole
            step as one CUDA graph; needs a CUDA device; with ``amp``, bfloat16 autocast);
            :meth:`DefaultTrainer.build_optimizer` then builds a fused SGD.
        data_on_device: for :meth:`DefaultTrainer.build_train_loader`, which is yours: keep
            in-memory data on the device with :class:`hookloop.data.DeviceResidentLoader`
            (the demo's reads it; see docs/data.md).
        gather_metric_period: put the losses into the storage every N iterations.
        base_lr, momentum, nesterov, weight_decay: SGD's; ``weight_decay_norm`` is the weight
            decay of normalization layers' parameters (detectron2's default 0).
        warmup_iters, warmup_factor, warmup_method: the warmup at the start of the schedule.
        lr_steps: iterations where the LR is multiplied by ``lr_gamma``; empty: a cosine
            schedule from ``base_lr`` to ``base_lr_end``.
        rescale_interval: whether the schedule after warmup is rescaled to the rest of the run.
        precise_bn: run :class:`hooks.PreciseBN` (at ``eval_period``) over
            ``precise_bn_iters`` batches of a second training loader.
        best_metric: a metric from :meth:`DefaultTrainer.test` (a "a/b" key) to keep
            ``model_best.pth`` for; "" for none. ``best_mode``: "max" or "min".
        seed: seeds Python's, numpy's and torch's RNGs before the model is built; negative:
            a seed drawn from the OS, logged.
        trackers: experiment trackers the writers also log to: ``"mlflow"``, ``"wandb"``
            (see :func:`default_writers`).
    """

    max_iter: int = 40000
    output_dir: str = "./output"
    weights: str = ""
    checkpoint_period: int = 5000
    max_to_keep: Optional[int] = None
    eval_period: int = 0
    log_period: int = 20
    window_size: int = 20
    amp: bool = False
    cuda_graph: bool = False
    data_on_device: bool = False
    gather_metric_period: int = 1
    base_lr: float = 0.001
    base_lr_end: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0001
    weight_decay_norm: float = 0.0
    warmup_iters: int = 1000
    warmup_factor: float = 0.001
    warmup_method: str = "linear"
    rescale_interval: bool = False
    lr_steps: Tuple[int, ...] = ()
    lr_gamma: float = 0.1
    precise_bn: bool = False
    precise_bn_iters: int = 200
    best_metric: str = ""
    best_mode: str = "max"
    seed: int = -1
    trackers: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls: Type[_C], values: Mapping[str, Any]) -> _C:
        """A config from ``{field: value}``; fields not given keep their defaults.

        Raises:
            ValueError: naming an unknown key (with the closest field name) or a bad value.
            TypeError: naming a key whose value has the wrong type.
        """
        if not isinstance(values, Mapping):
            raise TypeError(
                f"{cls.__name__}.from_dict() needs a mapping, got {type(values).__name__}"
            )
        for key in values:
            cls._field_type(key)
        return cls(**values)

    @classmethod
    def from_yaml(cls: Type[_C], path: Union[str, "os.PathLike[str]"]) -> _C:
        """A config from a YAML file holding one mapping of fields (see :meth:`from_dict`).
        Needs PyYAML (``pip install hookloop[yaml]``)."""
        try:
            import yaml
        except ImportError as e:
            raise ImportError(
                f"{cls.__name__}.from_yaml() needs PyYAML: pip install 'hookloop[yaml]' "
                "(or pip install pyyaml)"
            ) from e
        path = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            try:
                values = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"{path} is not valid YAML: {e}") from e
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ValueError(
                f"{path} must hold a mapping of {cls.__name__} fields, got {type(values).__name__}"
            )
        values = dict(values)
        types = _field_types(cls)
        for key, value in values.items():
            if isinstance(value, str) and types.get(key) in (float, Optional[float]):
                # YAML 1.1 reads `1e-3` (no dot) as a string.
                try:
                    values[key] = float(value)
                except ValueError:
                    pass
        return cls.from_dict(values)

    def merge_overrides(self: _C, overrides: Iterable[str]) -> _C:
        """A copy with command-line overrides applied: each ``key=value``, the value read as
        a Python literal (``max_iter=100``, ``lr_steps=[10,20]``, ``amp=True``); a str field
        also takes the text as it is (``output_dir=/tmp/run``).

        Raises:
            ValueError: naming an override that is not ``key=value``, an unknown key, a value
                that is not a literal, or a bad value.
            TypeError: naming a key whose value has the wrong type.
        """
        if isinstance(overrides, (str, bytes)):
            raise TypeError("merge_overrides() takes a list of 'key=value' strings, got a str")
        changes: Dict[str, Any] = {}
        for item in overrides:
            if not isinstance(item, str):
                raise TypeError(f"override {item!r} must be a 'key=value' str")
            key, sep, text = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ValueError(f"override {item!r} must be 'key=value'")
            tp = type(self)._field_type(key)
            text = text.strip()
            if tp is bool and text.lower() in ("true", "false"):
                # As YAML and most command lines spell them.
                changes[key] = text.lower() == "true"
                continue
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                if not _accepts_str(tp):
                    raise ValueError(
                        f"override {key}: {text!r} is not a Python literal "
                        f"(expected {_type_name(tp)})"
                    ) from None
                value = text
            if _accepts_str(tp) and not isinstance(value, str) and value is not None:
                # `output_dir=123` or `best_metric=1e-3` names the text, not the number.
                value = text
            changes[key] = value
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a dict (what :meth:`from_dict` reads back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- checking ------------------------------------------------------------------------------

    @classmethod
    def _field_type(cls, key: Any) -> Any:
        types = _field_types(cls)
        if key not in types:
            close = difflib.get_close_matches(str(key), list(types), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{cls.__name__} has no field {key!r}{hint}")
        return types[key]

    def validate(self) -> None:
        """Checks (and normalizes: an int for a float, a list for a tuple) every field.

        Raises:
            TypeError, ValueError: naming the field.
        """
        name = type(self).__name__
        for key, tp in _field_types(type(self)).items():
            object.__setattr__(self, key, _coerce(f"{name}.{key}", tp, getattr(self, key)))
        # Checked before the signs: NaN passes every comparison.
        for key in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, key)):
                raise ValueError(f"{name}.{key} must be finite, got {getattr(self, key)}")
        for key in _COUNT_FIELDS:
            value = getattr(self, key)
            for v in value if isinstance(value, tuple) else (value,):
                if v is not None and v > _MAX_COUNT:
                    raise ValueError(
                        f"{name}.{key} must be at most 2**53 (an exact iteration), got {v}"
                    )
        if self.seed >= 2**32:
            raise ValueError(
                f"{name}.seed must be below 2**32 (numpy's generator takes no more), or "
                f"negative for a seed drawn from the OS; got {self.seed}"
            )

        def positive(*keys: str) -> None:
            for key in keys:
                if getattr(self, key) <= 0:
                    raise ValueError(f"{name}.{key} must be positive, got {getattr(self, key)}")

        def non_negative(*keys: str) -> None:
            for key in keys:
                if getattr(self, key) < 0:
                    raise ValueError(f"{name}.{key} must be >= 0, got {getattr(self, key)}")

        positive(
            "max_iter",
            "checkpoint_period",
            "log_period",
            "window_size",
            "gather_metric_period",
            "base_lr",
            "lr_gamma",
            "precise_bn_iters",
        )
        non_negative(
            "eval_period",
            "momentum",
            "weight_decay",
            "weight_decay_norm",
            "warmup_iters",
            "warmup_factor",
            "base_lr_end",
        )
        if self.max_to_keep is not None and self.max_to_keep <= 0:
            raise ValueError(f"{name}.max_to_keep must be positive or None, got {self.max_to_keep}")
        if self.base_lr_end > self.base_lr:
            raise ValueError(
                f"{name}.base_lr_end ({self.base_lr_end}) must not exceed base_lr ({self.base_lr})"
            )
        if self.warmup_method not in ("linear", "constant"):
            raise ValueError(
                f"{name}.warmup_method must be 'linear' or 'constant', got {self.warmup_method!r}"
            )
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"{name}.best_mode must be 'max' or 'min', got {self.best_mode!r}")
        unknown = [t for t in self.trackers if t not in ("mlflow", "wandb")]
        if unknown:
            raise ValueError(f"{name}.trackers must be 'mlflow' or 'wandb', got {unknown[0]!r}")
        steps = self.lr_steps
        if any(s <= 0 for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
            raise ValueError(
                f"{name}.lr_steps must be positive and strictly increasing, got {list(steps)}"
            )


def _field_types(cls: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


# TrainConfig's own numbers (a subclass's fields are its own business): floats are finite,
# and iterations, periods and counts at most 2**53, where the core keeps iterations exact.
_FLOAT_FIELDS = tuple(k for k, tp in _field_types(TrainConfig).items() if tp is float)
_COUNT_FIELDS = tuple(
    k
    for k, tp in _field_types(TrainConfig).items()
    if k != "seed" and tp in (int, Optional[int], Tuple[int, ...])
)
_MAX_COUNT = 2**53


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin in (tuple, list):
        return f"a list of {_type_name(args[0])}" if args else "a list"
    return getattr(tp, "__name__", str(tp))


def _accepts_str(tp: Any) -> bool:
    return tp is str or (typing.get_origin(tp) is Union and str in typing.get_args(tp))


def _coerce(what: str, tp: Any, value: Any) -> Any:
    """``value`` as a ``tp`` (int for float, list for tuple, path for str), or a TypeError
    naming ``what``. Unknown annotations are taken as they are."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def wrong() -> TypeError:
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return TypeError(f"{what} must be {_type_name(tp)}, got {type(value).__name__} {shown}")

    if origin is Union:
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(what, arg, value)
            except TypeError:
                pass
        raise wrong()
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise wrong()
        item = args[0] if args else Any
        items = []
        for i, v in enumerate(value):
            try:
                items.append(_coerce(f"{what}[{i}]", item, v))
            except TypeError:
                raise wrong() from None
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise wrong()
        return bool(value)
    if tp is int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise wrong()
        return int(value)
    if tp is float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise wrong()
        return float(value)
    if tp is str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise wrong()
        return value
    return value


# ----------------------------------------------------------------------------------------------
# Helpers detectron2 keeps beside its DefaultTrainer


def create_ddp_model(
    model: torch.nn.Module, *, fp16_compression: bool = False, **kwargs: Any
) -> torch.nn.Module:
    """Wraps ``model`` in ``DistributedDataParallel`` when more than one process trains, else
    returns it as it is.

    Args:
        model: a torch.nn.Module
        fp16_compression: add fp16 compression hooks to the ddp object. See more at
            https://pytorch.org/docs/stable/ddp_comm_hooks.html#torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook
        kwargs: other arguments of :class:`torch.nn.parallel.DistributedDataParallel`.
    """
    if comm.get_world_size() == 1:
        return model
    if isinstance(model, DistributedDataParallel):
        return model
    if "device_ids" not in kwargs:
        on_cuda = any(p.is_cuda for p in model.parameters())
        # A CPU (gloo) model takes no device_ids.
        kwargs["device_ids"] = [comm.get_local_rank()] if on_cuda else None
    ddp = DistributedDataParallel(model, **kwargs)
    if fp16_compression:
        from torch.distributed.algorithms.ddp_comm_hooks import default as comm_hooks

        ddp.register_comm_hook(state=None, hook=comm_hooks.fp16_compress_hook)
    return ddp


def default_writers(
    output_dir: Union[str, "os.PathLike[str]"],
    max_iter: Optional[int] = None,
    window_size: int = 20,
    *,
    trackers: Iterable[Union[str, EventWriter]] = (),
) -> List[EventWriter]:
    """Build a list of :class:`EventWriter` to be used. It now consists of a
    :class:`CommonMetricPrinter`, :class:`TensorboardXWriter` and :class:`JSONWriter`.

    Args:
        output_dir: directory to store JSON metrics and tensorboard events
        max_iter: the total number of iterations
        window_size: the writers' smoothing window
        trackers: experiment trackers to add (hookloop's addition): ``"mlflow"`` (an
            :class:`MLflowWriter` to ``MLFLOW_TRACKING_URI``, else to the experiment
            ``hookloop`` of ``sqlite:///<output_dir>/mlflow.db``, its artifacts in
            ``<output_dir>/mlartifacts``), ``"wandb"`` (a :class:`WandbWriter`,
            ``WANDB_MODE`` or offline, its files under ``output_dir``), or writers

    Returns:
        list[EventWriter]: a list of :class:`EventWriter` objects.
    """
    output_dir = os.fspath(output_dir)
    if isinstance(trackers, (str, EventWriter)):
        trackers = [trackers]
    extra: List[EventWriter] = []
    for tracker in trackers:
        if isinstance(tracker, EventWriter):
            extra.append(tracker)
        elif tracker == "mlflow":
            from hookloop.utils.trackers import MLflowWriter

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if uri:
                extra.append(MLflowWriter(uri, window_size=window_size))
            else:
                # A store of its own, whose images stay beside it (a database store's default
                # experiment keeps artifacts in ./mlruns of the working directory).
                root = os.path.abspath(output_dir)
                extra.append(
                    MLflowWriter(
                        "sqlite:///" + os.path.join(root, "mlflow.db"),
                        experiment_name="hookloop",
                        artifact_location=os.path.join(root, "mlartifacts"),
                        window_size=window_size,
                    )
                )
        elif tracker == "wandb":
            from hookloop.utils.wandb_writer import WandbWriter

            mode = os.environ.get("WANDB_MODE") or "offline"
            extra.append(WandbWriter(mode=mode, dir=output_dir, window_size=window_size))
        else:
            raise ValueError(
                f"default_writers trackers: {tracker!r} is not 'mlflow', 'wandb' or an EventWriter"
            )
    os.makedirs(output_dir, exist_ok=True)
    return [
        # It may not always print what you want to see, since it prints "common" metrics only.
        CommonMetricPrinter(max_iter, window_size=window_size),
        JSONWriter(os.path.join(output_dir, "metrics.json"), window_size=window_size),
        TensorboardXWriter(output_dir, window_size=window_size),
        *extra,
    ]


def _seed_all_rng(seed: int) -> int:
    """Seeds Python's, numpy's and torch's RNGs; a negative seed is drawn from the OS."""
    if seed < 0:
        seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        logger.info(f"Using a generated random seed {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


_NORM_TYPES = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.GroupNorm,
    torch.nn.LayerNorm,
    torch.nn.LocalResponseNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)


def _optimizer_params(model: torch.nn.Module, cfg: TrainConfig) -> List[Dict[str, Any]]:
    """Trainable parameters in two groups: normalization layers' (``weight_decay_norm``) and
    the rest (``weight_decay``). A parameter shared by modules is listed once."""
    seen = set()
    norm: List[torch.nn.Parameter] = []
    other: List[torch.nn.Parameter] = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (norm if isinstance(module, _NORM_TYPES) else other).append(p)
    groups = [
        {"params": other, "weight_decay": cfg.weight_decay},
        {"params": norm, "weight_decay": cfg.weight_decay_norm},
    ]
    return [g for g in groups if g["params"]]


# ----------------------------------------------------------------------------------------------
# The trainer


class DefaultTrainer(TrainerBase):
    """A trainer with default training logic. It does the following:

    1. Create a :class:`SimpleTrainer` (:class:`AMPTrainer` with ``cfg.amp``,
       :class:`~hookloop.engine.graph.CUDAGraphTrainer` with ``cfg.cuda_graph``) using model,
       optimizer, dataloader defined by the given config. Create a LR scheduler defined by
       the config.
    2. Load the last checkpoint or ``cfg.weights``, if exists, when :meth:`resume_or_load` is
       called.
    3. Register a few common hooks defined by the config.

    It is created to simplify the **standard model training workflow** and reduce code
    boilerplate for users who only need the standard training workflow, with standard
    features. When its assumptions do not hold for you, overwrite its ``build_*`` methods, or
    use :class:`SimpleTrainer` with your own hooks.

    hookloop has no model zoo: subclass it and implement :meth:`build_model` and
    :meth:`build_train_loader` (and :meth:`test` to evaluate).

    Examples:
    ::
        class Trainer(DefaultTrainer):
            @classmethod
            def build_model(cls, cfg):
                return MyModel()

            @classmethod
            def build_train_loader(cls, cfg):
                return my_loader()

        cfg = TrainConfig.from_yaml("train.yaml").merge_overrides(sys.argv[1:])
        trainer = Trainer(cfg)
        trainer.resume_or_load()  # load last checkpoint or cfg.weights
        trainer.train()

    Attributes:
        scheduler: the LR scheduler (:meth:`build_lr_scheduler`'s).
        checkpointer (DetectionCheckpointer): saves the model and this trainer into
            ``cfg.output_dir``; loads ``cfg.weights`` also from model-zoo ``.pkl`` files.
        cfg (TrainConfig):
        model, optimizer, data_loader: the wrapped trainer's (``self._trainer``), settable.
        epoch, iters_per_epoch: the wrapped trainer's, for epoch-based training (a subclass's
            own assignment takes their place).
    """

    # The last test() results (set by the evaluation hook).
    _last_eval_results: Any

    def __init__(self, cfg: TrainConfig) -> None:
        """
        Args:
            cfg (TrainConfig):
        """
        super().__init__()
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"DefaultTrainer needs a TrainConfig, got {type(cfg).__name__}")
        # Fields may have been assigned since the config was made.
        cfg.validate()
        if not logging.getLogger("hookloop").isEnabledFor(logging.INFO):
            setup_logger()
        self.seed = _seed_all_rng(cfg.seed)

        # Assume these objects must be constructed in this order.
        model = self.build_model(cfg)
        optimizer = self.build_optimizer(cfg, model)
        data_loader = self.build_train_loader(cfg)

        model = create_ddp_model(model, broadcast_buffers=False)
        self._trainer: SimpleTrainer
        if cfg.cuda_graph:
            self._trainer = CUDAGraphTrainer(
                model,
                data_loader,
                optimizer,
                gather_metric_period=cfg.gather_metric_period,
                precision=torch.bfloat16 if cfg.amp else None,
            )
        else:
            self._trainer = (AMPTrainer if cfg.amp else SimpleTrainer)(
                model, data_loader, optimizer, gather_metric_period=cfg.gather_metric_period
            )
        # The wrapped trainer runs the backward pass and this trainer's hooks' after_backward.
        self._trainer._hookloop.wrapped_by(self._trainer, self)

        self.scheduler = self.build_lr_scheduler(cfg, optimizer)
        self.checkpointer = DetectionCheckpointer(
            # Assume you want to save checkpoints together with logs/statistics
            model,
            cfg.output_dir,
            save_to_disk=comm.is_main_process(),
            trainer=weakref.proxy(self),
        )
        self.start_iter = 0
        self.max_iter = cfg.max_iter
        self.cfg = cfg

        self.register_hooks(self.build_hooks())

    def resume_or_load(self, resume: bool = True, *, weights_only: Optional[bool] = None) -> None:
        """If ``resume`` is True and ``cfg.output_dir`` contains the last checkpoint (defined
        by a ``last_checkpoint`` file), resume from the file. Resuming means loading all
        available states (eg. optimizer and scheduler) and update iteration counter from the
        checkpoint. ``cfg.weights`` will not be used.

        Otherwise, this is considered as an independent training. The method will load model
        weights from the file ``cfg.weights`` (but will not load other states) and start from
        iteration 0.

        Args:
            resume (bool): whether to do resume or not
            weights_only (bool): how the file is unpickled (see
                :class:`hookloop.checkpoint.Checkpointer`); None: the checkpointer's
                (``weights_only=True`` unless changed). False runs whatever code the file
                holds: only for files you trust.
        """
        # Passed on only when given: a checkpointer of another class may not take it.
        options: Dict[str, Any] = {} if weights_only is None else {"weights_only": weights_only}
        self.checkpointer.resume_or_load(self.cfg.weights, resume=resume, **options)
        if resume and self.checkpointer.has_checkpoint():
            # The checkpoint stores the training iteration that just finished, thus we start
            # at the next iteration
            self.start_iter = self.iter + 1

    def build_hooks(self) -> List[Optional[HookBase]]:
        """Build a list of default hooks, including timing, evaluation, checkpointing, lr
        scheduling, precise BN, writing events.

        Returns:
            list[HookBase]:
        """
        cfg = self.cfg
        ret: List[Optional[HookBase]] = [
            hooks.IterationTimer(),
            hooks.LRScheduler(),
            hooks.PreciseBN(
                # Run at the same freq as (but before) evaluation.
                cfg.eval_period,
                self.model,
                # Build a new data loader to not affect training
                self.build_train_loader(cfg),
                cfg.precise_bn_iters,
            )
            if cfg.precise_bn and get_bn_modules(self.model)
            else None,
        ]

        # Do PreciseBN before checkpointer, because it updates the model and need to be saved
        # by checkpointer.
        if comm.is_main_process():
            ret.append(
                hooks.PeriodicCheckpointer(
                    self.checkpointer, cfg.checkpoint_period, max_to_keep=cfg.max_to_keep
                )
            )

        # The hook must not own the trainer (hooks hold a weak proxy of it).
        trainer_ref = weakref.ref(self)

        def test_and_save_results() -> Any:
            trainer = trainer_ref()
            if trainer is None:
                return None
            trainer._last_eval_results = trainer.test(trainer.cfg, trainer.model)
            return trainer._last_eval_results

        # Do evaluation after checkpointer, because then if it fails, we can use the saved
        # checkpoint to debug.
        ret.append(hooks.EvalHook(cfg.eval_period, test_and_save_results))

        if comm.is_main_process():
            if cfg.best_metric:
                ret.append(
                    hooks.BestCheckpointer(
                        cfg.eval_period, self.checkpointer, cfg.best_metric, mode=cfg.best_mode
                    )
                )
            # run writers in the end, so that evaluation metrics are written
            ret.append(hooks.PeriodicWriter(self.build_writers(), period=cfg.log_period))
        return ret

    def build_writers(self) -> List[EventWriter]:
        """Build a list of writers to be used using :func:`default_writers()`. If you'd like
        a different list of writers, you can overwrite it in your trainer.

        Returns:
            list[EventWriter]: a list of :class:`EventWriter` objects.
        """
        return default_writers(
            self.cfg.output_dir, self.max_iter, self.cfg.window_size, trackers=self.cfg.trackers
        )

    def train(self) -> Optional[Any]:  # type: ignore[override]
        """Run training.

        Returns:
            the results of the last evaluation (:meth:`test`), if one ran. Otherwise None.
        """
        super().train(self.start_iter, self.max_iter)
        return getattr(self, "_last_eval_results", None)

    # The wrapped trainer (as it is now: a subclass may assign its own) is driven through its
    # parts' protocol (TrainerParts.join_run, hooks_ready, leave_run): whatever its class, it
    # is set up for the run as its own before_train would, its losses read in batches.

    def before_train(self) -> None:
        inner = self._trainer
        inner._hookloop.join_run(inner, self)
        super().before_train()
        inner._hookloop.hooks_ready(inner, self)

    def after_train(self) -> None:
        # As SimpleTrainer.after_train: the last batched losses are put before the hooks read
        # the storage; a non-finite one fails a run that otherwise ended well.
        error = self._trainer._hookloop.leave_run(self._trainer)
        super().after_train()
        if error is not None:
            if self.iter == self.max_iter or self.stopped_early:
                raise error
            logger.error("Reading the last losses failed after training stopped: %r", error)

    def run_step(self) -> None:
        self._trainer.iter = self.iter
        self._trainer.run_step()

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["_trainer"] = self._trainer.state_dict()
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or "_trainer" not in state_dict:
            raise ValueError(
                "DefaultTrainer.load_state_dict() needs a DefaultTrainer's state, with a "
                "'_trainer' entry"
            )
        super().load_state_dict(state_dict)
        self._trainer.load_state_dict(state_dict["_trainer"])

    # Access basic attributes from the underlying trainer
    @property
    def model(self) -> torch.nn.Module:
        """The wrapped trainer's model (settable)."""
        return self._trainer.model

    @model.setter
    def model(self, value: torch.nn.Module) -> None:
        self._trainer.model = value

    @property
    def data_loader(self) -> Iterable[Any]:
        """The wrapped trainer's data loader (settable)."""
        return self._trainer.data_loader

    @data_loader.setter
    def data_loader(self, value: Iterable[Any]) -> None:
        self._trainer.data_loader = value

    # epoch and iters_per_epoch are not detectron2's names: a subclass may assign its own
    # (xmodaler-style trainers do), which is then what reads give; the wrapped trainer's stay.
    epoch: Added[int] = Added(
        lambda t: t._trainer.epoch,
        "The wrapped trainer's epoch (0 for the first pass over a finite loader).",
    )
    iters_per_epoch: Added[Optional[int]] = Added(
        lambda t: t._trainer.iters_per_epoch,
        "The wrapped trainer's ``iters_per_epoch``: ``len(data_loader)``, or None.",
    )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped trainer's optimizer (settable)."""
        return self._trainer.optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        self._trainer.optimizer = value

    @classmethod
    def build_model(cls, cfg: TrainConfig) -> torch.nn.Module:
        """
        Returns:
            torch.nn.Module:

        hookloop has no model zoo: overwrite it to return your model (in training mode, on
        its device). Its ``forward(batch)`` returns a loss tensor or a dict of losses.
        """
        raise NotImplementedError(
            f"{cls.__name__}.build_model(cfg) is not implemented: hookloop has no model zoo. "
            "Subclass DefaultTrainer and overwrite build_model (and build_train_loader)."
        )

    @classmethod
    def build_optimizer(cls, cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
        """
        Returns:
            torch.optim.Optimizer:

        SGD with ``cfg.base_lr``, ``momentum``, ``nesterov`` and ``weight_decay``
        (``weight_decay_norm`` for normalization layers), over the parameters that require
        grad. Overwrite it if you'd like a different optimizer.
        """
        return torch.optim.SGD(
            _optimizer_params(model, cfg),
            lr=cfg.base_lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            # A CUDA graph reads the LR from a tensor: only the fused SGD does so on the device.
            **({"fused": True} if cfg.cuda_graph else {}),
        )

    @classmethod
    def build_lr_scheduler(cls, cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> Any:
        """A warmup (``cfg.warmup_*``) followed by a multi-step schedule at ``cfg.lr_steps``
        (times ``lr_gamma`` at each), or with no steps a cosine one to ``base_lr_end``, as an
        :class:`LRMultiplier` over ``cfg.max_iter`` iterations. Overwrite it if you'd like a
        different scheduler."""
        steps = [s for s in cfg.lr_steps if s < cfg.max_iter]
        if len(steps) != len(cfg.lr_steps):
            logger.warning(
                f"lr_steps {list(cfg.lr_steps)} has steps at or past max_iter ({cfg.max_iter}): "
                "they are ignored."
            )
        sched: Any
        if cfg.lr_steps:
            sched = MultiStepParamScheduler(
                values=[cfg.lr_gamma**k for k in range(len(steps) + 1)],
                milestones=steps,
                num_updates=cfg.max_iter,
            )
        else:
            sched = CosineParamScheduler(1, cfg.base_lr_end / cfg.base_lr)
        sched = WarmupParamScheduler(
            sched,
            cfg.warmup_factor,
            min(cfg.warmup_iters / cfg.max_iter, 1.0),
            cfg.warmup_method,
            cfg.rescale_interval,
        )
        return LRMultiplier(optimizer, multiplier=sched, max_iter=cfg.max_iter)

    @classmethod
    def build_train_loader(cls, cfg: TrainConfig) -> Iterable[Any]:
        """
        Returns:
            iterable

        hookloop has no datasets: overwrite it to return your (infinite) training loader.
        To resume exactly where a run stopped, give it a ``state_dict``/``load_state_dict`` or
        a resumable sampler (:class:`hookloop.data.TrainingSampler`). Data that fits in the
        device's memory: :class:`hookloop.data.DeviceResidentLoader` (``cfg.data_on_device``).
        """
        raise NotImplementedError(
            f"{cls.__name__}.build_train_loader(cfg) is not implemented: hookloop has no "
            "datasets. Subclass DefaultTrainer and overwrite build_train_loader (and "
            "build_model)."
        )

    @classmethod
    def build_test_loader(cls, cfg: TrainConfig) -> Iterable[Any]:
        """
        Returns:
            iterable

        Not implemented by default: overwrite it (and :meth:`test`, which uses it) to
        evaluate during training.
        """
        raise NotImplementedError(
            f"{cls.__name__}.build_test_loader(cfg) is not implemented. Overwrite it and "
            "test(cfg, model) to evaluate during training."
        )

    @classmethod
    def test(cls, cfg: TrainConfig, model: torch.nn.Module) -> Dict[str, Any]:
        """
        Args:
            cfg (TrainConfig):
            model (nn.Module):

        Returns:
            dict: a (nested) dict of result metrics, put into the storage as "a/b" scalars.

        By default nothing is evaluated and the result is empty (detectron2's without an
        evaluator). Overwrite it, e.g. with :meth:`build_test_loader`, to evaluate; switch the
        model to eval mode and back to training mode yourself.
        """
        logger.warning(
            f"No evaluation: {cls.__name__}.test(cfg, model) is not implemented. Overwrite it "
            "(with build_test_loader) to evaluate."
        )
        return {}
