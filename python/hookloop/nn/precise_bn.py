"""Precise BatchNorm statistics, mirroring ``fvcore.nn.precise_bn``.

During training the BN running statistics are an exponential average over batches seen with
weights that kept changing. :func:`update_bn_stats` recomputes them with the weights fixed: the
running mean and variance become the population mean and variance of all samples of the
``num_iters`` batches, which is what fvcore computes.
"""

from __future__ import annotations

import itertools
import logging
import operator
from typing import Any, Dict, Iterable, List, Optional, Tuple, Type, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["BN_MODULE_TYPES", "get_bn_modules", "update_bn_stats"]

logger = logging.getLogger(__name__)

BN_MODULE_TYPES: Tuple[Type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
)


def get_bn_modules(model: nn.Module) -> List[nn.Module]:
    """Find all BatchNorm (BN) modules that are in training mode. See
    :data:`BN_MODULE_TYPES` for the module types included in this search (GroupNorm,
    LayerNorm, InstanceNorm and frozen BN hold no running statistics to update).

    Args:
        model (nn.Module): a model possibly containing BN modules.

    Returns:
        list[nn.Module]: all BN modules in the model that are in training mode.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"get_bn_modules() model must be a torch.nn.Module, got {type(model).__name__}"
        )
    return [m for m in model.modules() if m.training and isinstance(m, BN_MODULE_TYPES)]


@torch.no_grad()
def update_bn_stats(
    model: nn.Module,
    data_loader: Iterable[Any],
    num_iters: int = 200,
    progress: Optional[str] = None,
) -> None:
    """Recompute and update the batch norm stats to make them more precise. During training
    both BN stats and the weight are changing after every iteration, so the running average
    can not precisely reflect the actual stats of the current model. In this function, the BN
    stats are recomputed with fixed weights, to make the running average more precise.
    Specifically, it computes the true average of per-batch mean/variance instead of the
    running average: the population mean and variance of all samples of the ``num_iters``
    batches (each batch weighs by its size), as fvcore's.

    A layer skipped in a batch is not counted for that batch; one never called keeps its
    statistics. A layer called twice in one forward is refused (``AssertionError``), as in
    fvcore.

    Args:
        model (nn.Module): the model whose bn stats will be recomputed.

            Note that:

            1. This function will not alter the training mode of the given model. Users are
               responsible for setting the layers that needs precise-BN to training mode,
               prior to calling this function.
            2. Be careful if your models contain other stateful layers in addition to BN,
               i.e. layers whose state can change in forward iterations. This function will
               alter their state. If you wish them unchanged, you need to either pass in a
               submodule without those layers, or backup the states.
        data_loader (iterable): produces data as inputs to the model; ``num_iters`` items are
            taken from it.
        num_iters (int): number of iterations to compute the stats.
        progress (str or None): None or "tqdm". If set, use tqdm to report the progress.

    Raises:
        AssertionError: when ``data_loader`` runs out before ``num_iters`` batches (fvcore's
            message); the BN statistics are then left as they were.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"update_bn_stats() model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not isinstance(data_loader, Iterable):
        raise TypeError(
            f"update_bn_stats() data_loader must be iterable, got {type(data_loader).__name__}"
        )
    num_iters = _positive_int("update_bn_stats() num_iters", num_iters)
    if progress not in (None, "tqdm"):
        raise ValueError(f"update_bn_stats() progress must be None or 'tqdm', got {progress!r}")

    # Layers without running statistics (track_running_stats=False) have nothing to update.
    bn_layers: List[_BatchNorm] = [
        bn
        for bn in get_bn_modules(model)
        if isinstance(bn, _BatchNorm) and bn.running_mean is not None
    ]
    if not bn_layers:
        return
    tqdm_class: Any = None
    if progress == "tqdm":
        try:
            from tqdm import tqdm
        except ImportError:
            raise ImportError(
                "update_bn_stats(progress='tqdm') needs tqdm: pip install 'hookloop[progress]'"
            ) from None
        tqdm_class = tqdm

    logger.info(f"Computing precise BN statistics for {len(bn_layers)} BN layers ...")
    # With momentum 1 each forward leaves the batch's mean and unbiased variance in the
    # running buffers; the estimators fold them, weighted by batch size, into the population
    # mean and (biased) variance of all samples seen, as fvcore does.
    saved = [(bn.momentum, _stats(bn)[0].clone(), _stats(bn)[1].clone()) for bn in bn_layers]
    for bn in bn_layers:
        bn.momentum = 1.0
    batch_sizes: Dict[nn.Module, int] = {}

    def batch_size_hook(module: nn.Module, inputs: Tuple[Any, ...]) -> None:
        assert module not in batch_sizes, (
            "Some BN layers are reused. This is not supported and probably not desired."
        )
        x = inputs[0]
        assert isinstance(x, torch.Tensor), f"BN layer should take tensor as input. Got {inputs}"
        batch_sizes[module] = x.numel() // x.shape[1]

    handles = [bn.register_forward_pre_hook(batch_size_hook) for bn in bn_layers]
    estimators = [_PopulationVarianceEstimator(*_stats(bn)) for bn in bn_layers]
    bar = None if tqdm_class is None else tqdm_class(total=num_iters)
    done = 0
    ok = False
    try:
        for inputs in itertools.islice(data_loader, num_iters):
            batch_sizes.clear()
            model(inputs)
            done += 1
            for bn, estimator in zip(bn_layers, estimators):
                batch_size = batch_sizes.get(bn)
                if batch_size is not None:  # None: the layer was unused in this forward
                    estimator.update(*_stats(bn), batch_size)
            if bar is not None:
                bar.update(1)
        if done != num_iters:
            raise AssertionError(
                "update_bn_stats is meant to run for {} iterations, "
                "but the dataloader stops at {} iterations.".format(num_iters, done - 1)
            )
        ok = True
    finally:
        for handle in handles:
            handle.remove()
        if bar is not None:
            bar.close()
        for bn, (momentum, mean, var), estimator in zip(bn_layers, saved, estimators):
            bn.momentum = momentum
            if ok and estimator.tot > 0:
                # Into the buffers, not new tensors: a captured CUDA graph (CUDAGraphTrainer)
                # and anything else holding them keep seeing the model's statistics.
                running_mean, running_var = _stats(bn)
                running_mean.copy_(estimator.pop_mean)
                running_var.copy_(estimator.pop_var)
            else:
                running_mean, running_var = _stats(bn)
                running_mean.copy_(mean)
                running_var.copy_(var)
    unused = sum(1 for e in estimators if e.tot == 0)
    if unused:
        logger.info(
            f"update_bn_stats(): {unused} BN layers were not called; their stats are unchanged"
        )


class _PopulationVarianceEstimator:
    """The population mean and variance of all samples of several batches, from each batch's
    size, mean and unbiased variance (fvcore's estimator: batches weigh by their size)."""

    def __init__(self, mean_buffer: torch.Tensor, var_buffer: torch.Tensor) -> None:
        self.pop_mean = torch.zeros_like(mean_buffer)
        self.pop_square_mean = torch.zeros_like(var_buffer)
        self.tot = 0

    def update(self, batch_mean: torch.Tensor, batch_var: torch.Tensor, batch_size: int) -> None:
        self.tot += batch_size
        batch_square_mean = batch_mean.square() + batch_var * ((batch_size - 1) / batch_size)
        self.pop_mean += (batch_mean - self.pop_mean) * (batch_size / self.tot)
        self.pop_square_mean += (batch_square_mean - self.pop_square_mean) * (batch_size / self.tot)

    @property
    def pop_var(self) -> torch.Tensor:
        return self.pop_square_mean - self.pop_mean.square()


def _stats(bn: _BatchNorm) -> Tuple[torch.Tensor, torch.Tensor]:
    """The running mean and variance of a layer that tracks them."""
    return cast(torch.Tensor, bn.running_mean), cast(torch.Tensor, bn.running_var)


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
    return value
