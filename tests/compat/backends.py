"""The engines the usage corpus runs against, each as one namespace with detectron2's names.

- ``hookloop``: the product.
- ``reference``: the tests' model of detectron2 (``compat.d2``), written for hookloop.
- ``d2src``: detectron2's own engine modules, imported from a source tree that
  ``HOOKLOOP_D2_SRC`` names (``git archive HEAD detectron2 | tar -x -C $DIR``), with fvcore
  from PyPI. Its packages' ``__init__`` files (which import the whole model zoo) are never run:
  each package is registered as an empty module whose ``__path__`` points into the tree, so
  only the engine's own modules and what they import are loaded.

A pattern receives one of these and writes its code against ``E.SimpleTrainer``,
``E.hooks.PeriodicWriter``, ``E.EventStorage``..., as the real code writes it against
``detectron2.engine`` and ``detectron2.utils.events``. ``E.logger_prefix`` is the prefix of the
engine's logger names (``hookloop.``/``detectron2.``/``compat.d2.``): log records are compared
with it removed.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import types
import warnings
from typing import Any, Dict

__all__ = ["Engine", "backend", "BACKENDS", "d2src_dir"]


class Engine(types.SimpleNamespace):
    """One backend's engine: ``name``, ``logger_prefix``, the trainers, ``hooks`` (a module),
    the storage and writers, ``Checkpointer``/``PeriodicCheckpointer``, ``comm``, and
    ``solver`` (``LRMultiplier``, ``WarmupParamScheduler`` and fvcore's param schedulers by
    their names), ``precise_bn`` (``update_bn_stats``/``get_bn_modules``: fvcore's module
    for the reference and detectron2), ``DetectionCheckpointer`` (detectron2's, ``None`` where
    the engine has none), ``checkpoint_module`` (what ``from fvcore.common.checkpoint
    import _strip_prefix_if_present, _IncompatibleKeys`` reads: fvcore's module for the
    reference and detectron2) and ``c2_model_loading`` (the module with detectron2's
    ``align_and_update_state_dicts``; ``None`` where the engine has none)."""

    name: str
    logger_prefix: str


BACKENDS = ("hookloop", "reference", "d2src")


def d2src_dir() -> str:
    """The detectron2 source tree named by ``HOOKLOOP_D2_SRC`` (the folder holding the
    ``detectron2`` package), or '' when it is not set or holds no engine."""
    root = os.environ.get("HOOKLOOP_D2_SRC", "")
    if root and os.path.isfile(os.path.join(root, "detectron2", "engine", "train_loop.py")):
        return root
    return ""


def _solver(lr_scheduler: Any, param_scheduler: Any) -> types.SimpleNamespace:
    """``detectron2.solver``'s LR wrappers and fvcore's param schedulers, in one namespace."""
    from hookloop.solver.param_scheduler import __all__ as param_schedulers

    names = {n: getattr(param_scheduler, n) for n in param_schedulers}
    names["LRMultiplier"] = lr_scheduler.LRMultiplier
    names["WarmupParamScheduler"] = lr_scheduler.WarmupParamScheduler
    return types.SimpleNamespace(**names)


def _optional_module(name: str) -> Any:
    """The module ``name``, or None where it does not exist (yet)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _hookloop() -> Engine:
    from hookloop import checkpoint
    from hookloop.engine import hooks, train_loop
    from hookloop.nn import precise_bn
    from hookloop.solver import lr_scheduler, param_scheduler
    from hookloop.utils import comm, events

    solver = _solver(lr_scheduler, param_scheduler)

    return Engine(
        name="hookloop",
        logger_prefix="hookloop.",
        HookBase=train_loop.HookBase,
        TrainerBase=train_loop.TrainerBase,
        SimpleTrainer=train_loop.SimpleTrainer,
        AMPTrainer=train_loop.AMPTrainer,
        hooks=hooks,
        EventStorage=events.EventStorage,
        get_event_storage=events.get_event_storage,
        HistoryBuffer=events.HistoryBuffer,
        EventWriter=events.EventWriter,
        JSONWriter=events.JSONWriter,
        TensorboardXWriter=events.TensorboardXWriter,
        CommonMetricPrinter=events.CommonMetricPrinter,
        Checkpointer=checkpoint.Checkpointer,
        PeriodicCheckpointer=checkpoint.PeriodicCheckpointer,
        comm=comm,
        solver=solver,
        precise_bn=precise_bn,
        # May not exist yet: a pattern that needs it then fails on calling None.
        DetectionCheckpointer=getattr(checkpoint, "DetectionCheckpointer", None),
        checkpoint_module=checkpoint,
        c2_model_loading=_optional_module("hookloop.checkpoint.c2_model_loading"),
    )


def _reference() -> Engine:
    from compat import d2

    with warnings.catch_warnings():
        # d2_hooks imports fvcore.nn, which scripts its losses with torch.jit at import.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        from compat import d2_hooks

    hooks = types.ModuleType("compat.d2.hooks")
    for name in d2.HOOK_NAMES:
        setattr(hooks, name, getattr(d2, name))
    hooks.PeriodicCheckpointer = d2_hooks.PeriodicCheckpointer  # type: ignore[attr-defined]
    hooks.BestCheckpointer = d2_hooks.BestCheckpointer  # type: ignore[attr-defined]
    hooks.PreciseBN = d2_hooks.PreciseBN  # type: ignore[attr-defined]
    return Engine(
        name="reference",
        logger_prefix="compat.d2.",
        HookBase=d2.HookBase,
        TrainerBase=d2.TrainerBase,
        SimpleTrainer=d2.SimpleTrainer,
        AMPTrainer=d2.AMPTrainer,
        hooks=hooks,
        EventStorage=d2.EventStorage,
        get_event_storage=d2.get_event_storage,
        HistoryBuffer=d2.HistoryBuffer,
        EventWriter=d2.EventWriter,
        JSONWriter=d2.JSONWriter,
        TensorboardXWriter=d2.TensorboardXWriter,
        CommonMetricPrinter=d2.CommonMetricPrinter,
        Checkpointer=d2_hooks.Checkpointer,
        PeriodicCheckpointer=d2_hooks.FvPeriodicCheckpointer,
        comm=d2.comm,
        solver=_solver(d2, d2),
        precise_bn=d2_hooks.fv_precise_bn,
        DetectionCheckpointer=d2_hooks.DetectionCheckpointer,
        checkpoint_module=d2_hooks.fv_checkpoint,
        c2_model_loading=d2_hooks,
    )


# Packages whose __init__ would import far more than the engine (the model zoo, the data
# pipeline, pycocotools, hydra): registered empty, their modules imported one by one.
_EMPTY_PACKAGES = (
    "detectron2",
    "detectron2.utils",
    "detectron2.engine",
    "detectron2.solver",
    "detectron2.evaluation",
    "detectron2.checkpoint",
)


def _d2src() -> Engine:
    root = d2src_dir()
    if not root:
        raise LookupError("HOOKLOOP_D2_SRC does not name a detectron2 source tree")
    for name in _EMPTY_PACKAGES:
        if name in sys.modules:
            continue
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = pkg
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, pkg)
    solver = sys.modules["detectron2.solver"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        lr_scheduler = importlib.import_module("detectron2.solver.lr_scheduler")
    solver.LRMultiplier = lr_scheduler.LRMultiplier  # type: ignore[attr-defined]
    solver.LRScheduler = lr_scheduler.LRScheduler  # type: ignore[attr-defined]
    solver.WarmupParamScheduler = lr_scheduler.WarmupParamScheduler  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        # fvcore.nn scripts its losses with torch.jit at import, which torch deprecates.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        events = importlib.import_module("detectron2.utils.events")
        comm = importlib.import_module("detectron2.utils.comm")
        train_loop = importlib.import_module("detectron2.engine.train_loop")
        hooks = importlib.import_module("detectron2.engine.hooks")
        from fvcore.common import checkpoint as fv_checkpoint
        from fvcore.common import param_scheduler
        from fvcore.common.checkpoint import Checkpointer, PeriodicCheckpointer

        detection_checkpoint = importlib.import_module("detectron2.checkpoint.detection_checkpoint")

    return Engine(
        name="d2src",
        logger_prefix="detectron2.",
        HookBase=train_loop.HookBase,
        TrainerBase=train_loop.TrainerBase,
        SimpleTrainer=train_loop.SimpleTrainer,
        AMPTrainer=train_loop.AMPTrainer,
        hooks=hooks,
        EventStorage=events.EventStorage,
        get_event_storage=events.get_event_storage,
        HistoryBuffer=importlib.import_module("fvcore.common.history_buffer").HistoryBuffer,
        EventWriter=events.EventWriter,
        JSONWriter=events.JSONWriter,
        TensorboardXWriter=events.TensorboardXWriter,
        CommonMetricPrinter=events.CommonMetricPrinter,
        Checkpointer=Checkpointer,
        PeriodicCheckpointer=PeriodicCheckpointer,
        comm=comm,
        solver=_solver(lr_scheduler, param_scheduler),
        precise_bn=importlib.import_module("fvcore.nn.precise_bn"),
        DetectionCheckpointer=detection_checkpoint.DetectionCheckpointer,
        checkpoint_module=fv_checkpoint,
        c2_model_loading=sys.modules["detectron2.checkpoint.c2_model_loading"],
    )


_LOADERS: Dict[str, Any] = {"hookloop": _hookloop, "reference": _reference, "d2src": _d2src}


@functools.cache
def backend(name: str) -> Engine:
    """The engine called ``name`` (one of :data:`BACKENDS`), loaded once per process."""
    return _LOADERS[name]()
