"""The reference engine's checkpointing hook: fvcore's own ``PeriodicCheckpointer`` (the real
upstream, a test dependency) as a ``compat.d2`` hook, as ``detectron2.engine.hooks`` defines
it. It lives here rather than in ``compat.d2`` because the package does not depend on fvcore.
"""

from __future__ import annotations

import itertools
import math
import operator

from fvcore.common.checkpoint import Checkpointer
from fvcore.common.checkpoint import PeriodicCheckpointer as FvPeriodicCheckpointer
from fvcore.nn import precise_bn as fv_precise_bn
from fvcore.nn.precise_bn import get_bn_modules, update_bn_stats

from compat import d2

__all__ = [
    "Checkpointer",
    "FvPeriodicCheckpointer",
    "PeriodicCheckpointer",
    "BestCheckpointer",
    "PreciseBN",
    "fv_precise_bn",
]


class PeriodicCheckpointer(FvPeriodicCheckpointer, d2.HookBase):
    """fvcore's periodic saver as a hook: every ``period`` iterations and at the last one."""

    def before_train(self) -> None:
        self.max_iter = self.trainer.max_iter

    def after_step(self) -> None:
        self.step(self.trainer.iter)


class BestCheckpointer(d2.HookBase):
    """detectron2's best-metric saver: at EvalHook's iterations, saves ``file_prefix`` when
    the latest ``val_metric`` beats the best so far (``mode`` "max" or "min")."""

    def __init__(self, eval_period, checkpointer, val_metric, mode="max", file_prefix="model_best"):
        self._logger = d2.hooks_logger
        self._period = eval_period
        self._val_metric = val_metric
        assert mode in ["max", "min"], (
            f'Mode "{mode}" to `BestCheckpointer` is unknown. It should be one of {"max", "min"}.'
        )
        self._compare = operator.gt if mode == "max" else operator.lt
        self._checkpointer = checkpointer
        self._file_prefix = file_prefix
        self.best_metric = None
        self.best_iter = None

    def _update_best(self, val, iteration):
        if math.isnan(val) or math.isinf(val):
            return False
        self.best_metric = val
        self.best_iter = iteration
        return True

    def _best_checking(self):
        metric_tuple = self.trainer.storage.latest().get(self._val_metric)
        if metric_tuple is None:
            self._logger.warning(
                f"Given val metric {self._val_metric} does not seem to be computed/stored."
                "Will not be checkpointing based on it."
            )
            return
        latest_metric, metric_iter = metric_tuple
        if self.best_metric is None:
            if self._update_best(latest_metric, metric_iter):
                self._checkpointer.save(f"{self._file_prefix}", iteration=metric_iter)
                self._logger.info(
                    f"Saved first model at {self.best_metric:0.5f} @ {self.best_iter} steps"
                )
        elif self._compare(latest_metric, self.best_metric):
            self._checkpointer.save(f"{self._file_prefix}", iteration=metric_iter)
            self._logger.info(
                f"Saved best model as latest eval score for {self._val_metric} is "
                f"{latest_metric:0.5f}, better than last best score "
                f"{self.best_metric:0.5f} @ iteration {self.best_iter}."
            )
            self._update_best(latest_metric, metric_iter)
        else:
            self._logger.info(
                f"Not saving as latest eval score for {self._val_metric} is {latest_metric:0.5f}, "
                f"not better than best score {self.best_metric:0.5f} @ iteration {self.best_iter}."
            )

    def after_step(self):
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0:
            if next_iter != self.trainer.max_iter:
                self._best_checking()

    def after_train(self):
        if self.trainer.iter + 1 >= self.trainer.max_iter:
            self._best_checking()


class PreciseBN(d2.HookBase):
    """detectron2's PreciseBN: fvcore's ``update_bn_stats`` every ``period`` iterations and
    after the last one, over one iterator of ``data_loader`` that later runs continue."""

    def __init__(self, period, model, data_loader, num_iter):
        self._logger = d2.hooks_logger
        if len(get_bn_modules(model)) == 0:
            self._logger.info(
                "PreciseBN is disabled because model does not contain BN layers in training mode."
            )
            self._disabled = True
            return
        self._model = model
        self._data_loader = data_loader
        self._num_iter = num_iter
        self._period = period
        self._disabled = False
        self._data_iter = None

    def after_step(self):
        next_iter = self.trainer.iter + 1
        is_final = next_iter == self.trainer.max_iter
        if is_final or (self._period > 0 and next_iter % self._period == 0):
            self.update_stats()

    def update_stats(self):
        if self._disabled:
            return
        if self._data_iter is None:
            self._data_iter = iter(self._data_loader)

        def data_loader():
            for num_iter in itertools.count(1):
                if num_iter % 100 == 0:
                    self._logger.info(
                        "Running precise-BN ... {}/{} iterations.".format(num_iter, self._num_iter)
                    )
                yield next(self._data_iter)  # a spent iterator: RuntimeError (PEP 479)

        with d2.EventStorage():  # the model's events go to a storage that is dropped
            self._logger.info(
                "Running precise-BN for {} iterations...  ".format(self._num_iter)
                + "Note that this could produce different statistics every time."
            )
            update_bn_stats(self._model, data_loader(), self._num_iter)
