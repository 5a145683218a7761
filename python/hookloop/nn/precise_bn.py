"""Precise BatchNorm statistics, mirroring ``fvcore.nn.precise_bn``.

During training the BN running statistics are an exponential average over batches seen with
weights that kept changing. :func:`update_bn_stats` recomputes them with the weights fixed: the
running mean (variance) becomes the plain average, over ``num_iters`` batches, of each batch's
mean (unbiased variance), which is what fvcore computes.
"""

from __future__ import annotations

import itertools
import logging
import operator
from typing import Any, Callable, Iterable, List, Optional, Tuple, Type, cast

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
    running average.

    Each BN layer averages over the calls it actually gets: a layer skipped in a batch is not
    counted for that batch, and a layer called twice in one forward counts both calls.

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
        ValueError: when ``data_loader`` runs out before ``num_iters`` batches; the BN
            statistics are then left as they were.
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

    # bn.running_mean = (1 - momentum) * bn.running_mean + momentum * batch_mean: with
    # momentum 1/k at a layer's k-th call, running_mean after k calls is the average of the k
    # batch means (the first call replaces the old value). Each layer counts its own calls in a
    # forward pre-hook, which BN's forward reads the momentum after.
    saved = [(bn.momentum, _stats(bn)[0].clone(), _stats(bn)[1].clone()) for bn in bn_layers]
    calls = [0] * len(bn_layers)

    def counting_hook(bn: _BatchNorm, index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            calls[index] += 1
            bn.momentum = 1.0 / calls[index]

        return hook

    handles = [bn.register_forward_pre_hook(counting_hook(bn, i)) for i, bn in enumerate(bn_layers)]
    bar = None if tqdm_class is None else tqdm_class(total=num_iters)
    done = 0
    ok = False
    try:
        for inputs in itertools.islice(data_loader, num_iters):
            model(inputs)
            done += 1
            if bar is not None:
                bar.update(1)
        if done != num_iters:
            raise ValueError(
                f"update_bn_stats() is meant to run for num_iters={num_iters} iterations, but "
                f"data_loader stopped after {done}"
            )
        ok = True
    finally:
        for handle in handles:
            handle.remove()
        if bar is not None:
            bar.close()
        for bn, (momentum, mean, var) in zip(bn_layers, saved):
            bn.momentum = momentum
            if not ok:
                running_mean, running_var = _stats(bn)
                running_mean.copy_(mean)
                running_var.copy_(var)
    unused = sum(1 for c in calls if c == 0)
    if unused:
        logger.info(
            f"update_bn_stats(): {unused} BN layers were not called; their stats are unchanged"
        )


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
