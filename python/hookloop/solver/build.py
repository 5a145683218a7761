"""Optimizer and LR scheduler builders, mirroring ``detectron2.solver.build``.

``get_default_optimizer_params`` and ``reduce_param_groups`` take plain arguments (LazyConfig
training scripts call them). The functions that take a ``cfg`` read detectron2's config keys
as attributes (``cfg.SOLVER.BASE_LR``, ``cfg.SOLVER.CLIP_GRADIENTS.ENABLED``, ...): a yacs
``CfgNode`` from detectron2's ``get_cfg()`` works, and so does any object with those
attributes. hookloop's own config-light trainer builds from its typed ``TrainConfig`` instead
(``DefaultTrainer.build_optimizer``).
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Type, Union

import torch

from hookloop.solver.lr_scheduler import LRMultiplier, LRScheduler, WarmupParamScheduler
from hookloop.solver.param_scheduler import (
    CosineParamScheduler,
    MultiStepParamScheduler,
    ParamScheduler,
    StepWithFixedGammaParamScheduler,
)

__all__ = [
    "GradientClipType",
    "build_lr_scheduler",
    "build_optimizer",
    "get_default_optimizer_params",
    "maybe_add_gradient_clipping",
    "reduce_param_groups",
]

_GradientClipperInput = Union[torch.Tensor, Iterable[torch.Tensor]]
_GradientClipper = Callable[[_GradientClipperInput], None]

# The layers whose parameters get `weight_decay_norm` (NaiveSyncBatchNorm and FrozenBatchNorm
# subclasses of BatchNorm2d are included through it).
_NORM_TYPES = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
    torch.nn.GroupNorm,
    torch.nn.InstanceNorm1d,
    torch.nn.InstanceNorm2d,
    torch.nn.InstanceNorm3d,
    torch.nn.LayerNorm,
    torch.nn.LocalResponseNorm,
)


class GradientClipType(Enum):
    VALUE = "value"
    NORM = "norm"


def _create_gradient_clipper(cfg: Any) -> _GradientClipper:
    """A function that clips the gradients of the tensors it is given, by value or by norm as
    ``cfg`` (detectron2's ``SOLVER.CLIP_GRADIENTS`` node: ``CLIP_TYPE``, ``CLIP_VALUE``,
    ``NORM_TYPE``) says. ``cfg`` is copied: later changes to it change nothing."""
    cfg = copy.deepcopy(cfg)
    clip_type = GradientClipType(cfg.CLIP_TYPE)  # ValueError naming an unknown type
    if clip_type is GradientClipType.VALUE:

        def clip_by_value(p: _GradientClipperInput) -> None:
            torch.nn.utils.clip_grad_value_(p, cfg.CLIP_VALUE)

        return clip_by_value

    def clip_by_norm(p: _GradientClipperInput) -> None:
        torch.nn.utils.clip_grad_norm_(p, cfg.CLIP_VALUE, cfg.NORM_TYPE)

    return clip_by_norm


def _generate_optimizer_class_with_gradient_clipping(
    optimizer: Type[torch.optim.Optimizer],
    *,
    per_param_clipper: Optional[_GradientClipper] = None,
    global_clipper: Optional[_GradientClipper] = None,
) -> Type[torch.optim.Optimizer]:
    """A subclass of ``optimizer``, named ``<Name>WithGradientClip``, whose ``step()`` first
    clips the gradients: each parameter's with ``per_param_clipper``, or all of them at once
    with ``global_clipper``."""
    if per_param_clipper is not None and global_clipper is not None:
        raise ValueError("Not allowed to use both per-parameter clipping and global clipping")

    def step(self: Any, closure: Any = None) -> Any:
        if per_param_clipper is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    per_param_clipper(p)
        elif global_clipper is not None:
            global_clipper(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        # The optimizer's own step: the class made here is type(self) (detectron2 assigns it
        # to an existing optimizer's __class__).
        return super(type(self), self).step(closure)

    return type(optimizer.__name__ + "WithGradientClip", (optimizer,), {"step": step})


def maybe_add_gradient_clipping(cfg: Any, optimizer: Any) -> Any:
    """If ``cfg.SOLVER.CLIP_GRADIENTS.ENABLED``, an optimizer type that clips every
    parameter's gradient before its step (by ``CLIP_TYPE``, ``CLIP_VALUE``, ``NORM_TYPE``);
    otherwise ``optimizer`` unchanged.

    Args:
        cfg: a config with detectron2's ``SOLVER.CLIP_GRADIENTS`` keys.
        optimizer: a subclass of ``torch.optim.Optimizer``, or an optimizer, whose class then
            becomes the clipping subclass (detectron2 does the same, "not recommended").

    Returns:
        the clipping type, the optimizer given, or ``optimizer`` unchanged.
    """
    clip_cfg = cfg.SOLVER.CLIP_GRADIENTS
    if not clip_cfg.ENABLED:
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer_type: Type[torch.optim.Optimizer] = type(optimizer)
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        optimizer_type = optimizer
    else:
        raise TypeError(
            "maybe_add_gradient_clipping() optimizer must be a torch.optim.Optimizer or a "
            f"subclass of it, got {optimizer!r}"
        )
    clipping = _generate_optimizer_class_with_gradient_clipping(
        optimizer_type, per_param_clipper=_create_gradient_clipper(clip_cfg)
    )
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.__class__ = clipping
        return optimizer
    return clipping


def build_optimizer(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD over :func:`get_default_optimizer_params` of ``model``, from detectron2's
    ``SOLVER`` keys (``BASE_LR``, ``MOMENTUM``, ``NESTEROV``, ``WEIGHT_DECAY``,
    ``WEIGHT_DECAY_NORM``, ``BIAS_LR_FACTOR``, ``WEIGHT_DECAY_BIAS``), with gradient clipping
    when ``SOLVER.CLIP_GRADIENTS.ENABLED``."""
    solver = cfg.SOLVER
    params = get_default_optimizer_params(
        model,
        base_lr=solver.BASE_LR,
        weight_decay_norm=solver.WEIGHT_DECAY_NORM,
        bias_lr_factor=solver.BIAS_LR_FACTOR,
        weight_decay_bias=solver.WEIGHT_DECAY_BIAS,
    )
    optimizer = torch.optim.SGD(
        params,
        lr=solver.BASE_LR,
        momentum=solver.MOMENTUM,
        nesterov=solver.NESTEROV,
        weight_decay=solver.WEIGHT_DECAY,
        foreach=True,
    )
    clipped: torch.optim.Optimizer = maybe_add_gradient_clipping(cfg, optimizer)
    return clipped


def get_default_optimizer_params(
    model: torch.nn.Module,
    base_lr: Optional[float] = None,
    weight_decay: Optional[float] = None,
    weight_decay_norm: Optional[float] = None,
    bias_lr_factor: Optional[float] = 1.0,
    weight_decay_bias: Optional[float] = None,
    lr_factor_func: Optional[Callable[[str], float]] = None,
    overrides: Optional[Dict[str, Dict[str, float]]] = None,
) -> List[Dict[str, Any]]:
    """
    Get default param list for optimizer, with support for a few types of
    overrides. If no overrides needed, this is equivalent to `model.parameters()`.

    Args:
        base_lr: lr for every group by default. Can be omitted to use the one in optimizer.
        weight_decay: weight decay for every group by default. Can be omitted to use the one
            in optimizer.
        weight_decay_norm: override weight decay for params in normalization layers
        bias_lr_factor: multiplier of lr for bias parameters.
        weight_decay_bias: override weight decay for bias parameters.
        lr_factor_func: function to calculate lr decay rate by mapping the parameter names to
            corresponding lr decay rate. Note that setting this option requires
            also setting ``base_lr``.
        overrides: if not `None`, provides values for optimizer hyperparameters
            (LR, weight decay) for module parameters with a given name; e.g.
            ``{"embedding": {"lr": 0.01, "weight_decay": 0.1}}`` will set the LR and
            weight decay values for all module parameters named `embedding`.
            A ``"bias"`` entry is added to it when ``bias_lr_factor``/``weight_decay_bias``
            are set (as in detectron2, the dict given is changed).

    For common detection models, ``weight_decay_norm`` is the only option
    needed to be set. ``bias_lr_factor,weight_decay_bias`` are legacy settings
    from Detectron1 that are not found useful.

    Example:
    ::
        torch.optim.SGD(get_default_optimizer_params(model, weight_decay_norm=0),
                       lr=0.01, weight_decay=1e-4, momentum=0.9)
    """
    if overrides is None:
        overrides = {}
    defaults: Dict[str, Any] = {}
    if base_lr is not None:
        defaults["lr"] = base_lr
    if weight_decay is not None:
        defaults["weight_decay"] = weight_decay
    bias: Dict[str, float] = {}
    if bias_lr_factor is not None and bias_lr_factor != 1.0:
        if base_lr is None:
            raise ValueError("bias_lr_factor requires base_lr")
        bias["lr"] = base_lr * bias_lr_factor
    if weight_decay_bias is not None:
        bias["weight_decay"] = weight_decay_bias
    if bias:
        if "bias" in overrides:
            raise ValueError("Conflicting overrides for 'bias'")
        overrides["bias"] = bias
    if lr_factor_func is not None and base_lr is None:
        raise ValueError("lr_factor_func requires base_lr")

    params: List[Dict[str, Any]] = []
    seen: Set[torch.nn.Parameter] = set()
    for module_name, module in model.named_modules():
        for param_name, value in module.named_parameters(recurse=False):
            # Frozen parameters stay out; a shared one goes in once, under its first name.
            if not value.requires_grad or value in seen:
                continue
            seen.add(value)
            hyperparams = dict(defaults)
            if weight_decay_norm is not None and isinstance(module, _NORM_TYPES):
                hyperparams["weight_decay"] = weight_decay_norm
            if lr_factor_func is not None:
                hyperparams["lr"] *= lr_factor_func(f"{module_name}.{param_name}")
            hyperparams.update(overrides.get(param_name, {}))
            params.append({"params": [value], **hyperparams})
    return reduce_param_groups(params)


def _hyperparams(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _expand_param_groups(params: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One group per parameter, in the order parameters first appear; a later group that
    names a parameter again updates that parameter's hyper-parameters (and name). With
    ``param_names``, names and parameters are paired in order (extra ones are dropped)."""
    out: Dict[Any, Dict[str, Any]] = {}
    for group in params:
        if "params" not in group:
            raise ValueError(f"a param group needs a 'params' entry, got keys {sorted(group)}")
        hp = _hyperparams(group)
        if "param_names" in group:
            for name, p in zip(group["param_names"], group["params"]):
                out.setdefault(p, {}).update({"param_names": [name], "params": [p], **hp})
        else:
            for p in group["params"]:
                out.setdefault(p, {}).update({"params": [p], **hp})
    return list(out.values())


def reduce_param_groups(params: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The param groups merged into as few as possible: one group per distinct set of
    hyper-parameters (in order of first appearance), holding its parameters in order, which
    lets torch's multi-tensor optimizers work on few large groups. ``param_names`` entries
    are kept beside their parameters."""
    merged: Dict[Tuple[Tuple[str, Any], ...], List[Dict[str, Any]]] = defaultdict(list)
    for item in _expand_param_groups(params):
        merged[tuple(_hyperparams(item).items())].append(item)
    out = []
    for key, items in merged.items():
        group: Dict[str, Any] = dict(key)
        group["params"] = [p for item in items for p in item["params"]]
        if "param_names" in items[0]:
            group["param_names"] = [n for item in items for n in item.get("param_names", [])]
        out.append(group)
    return out


def build_lr_scheduler(cfg: Any, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """An :class:`LRMultiplier` over ``cfg.SOLVER.MAX_ITER`` from detectron2's ``SOLVER`` keys:
    ``LR_SCHEDULER_NAME`` ``"WarmupMultiStepLR"`` (``STEPS``, ``GAMMA``; steps past
    ``MAX_ITER`` are dropped with a warning), ``"WarmupCosineLR"`` (to
    ``BASE_LR_END / BASE_LR``) or ``"WarmupStepWithFixedGammaLR"`` (``GAMMA``,
    ``NUM_DECAYS``), after a warmup (``WARMUP_FACTOR``, ``WARMUP_ITERS``, ``WARMUP_METHOD``,
    ``RESCALE_INTERVAL``)."""
    solver = cfg.SOLVER
    name = solver.LR_SCHEDULER_NAME
    sched: ParamScheduler
    if name == "WarmupMultiStepLR":
        steps = [x for x in solver.STEPS if x <= solver.MAX_ITER]
        if len(steps) != len(solver.STEPS):
            logging.getLogger(__name__).warning(
                "SOLVER.STEPS contains values larger than SOLVER.MAX_ITER. "
                "These values will be ignored."
            )
        sched = MultiStepParamScheduler(
            values=[solver.GAMMA**k for k in range(len(steps) + 1)],
            milestones=steps,
            num_updates=solver.MAX_ITER,
        )
    elif name == "WarmupCosineLR":
        end_value = solver.BASE_LR_END / solver.BASE_LR
        if not 0.0 <= end_value <= 1.0:
            raise ValueError(
                f"SOLVER.BASE_LR_END / SOLVER.BASE_LR must be in [0, 1], got {end_value}"
            )
        sched = CosineParamScheduler(1, end_value)
    elif name == "WarmupStepWithFixedGammaLR":
        sched = StepWithFixedGammaParamScheduler(
            base_value=1.0,
            gamma=solver.GAMMA,
            num_decays=solver.NUM_DECAYS,
            num_updates=solver.MAX_ITER,
        )
    else:
        raise ValueError("Unknown LR scheduler: {}".format(name))
    sched = WarmupParamScheduler(
        sched,
        solver.WARMUP_FACTOR,
        min(solver.WARMUP_ITERS / solver.MAX_ITER, 1.0),
        solver.WARMUP_METHOD,
        solver.RESCALE_INTERVAL,
    )
    return LRMultiplier(optimizer, multiplier=sched, max_iter=solver.MAX_ITER)
