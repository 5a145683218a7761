"""What ``run_step`` makes of the model's output: the loss dict and the summed loss."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Tuple

import torch

__all__ = ["losses_of"]

_ONLY_STR = frozenset({str})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def losses_of(out: Any, who: str) -> Tuple[Mapping[str, torch.Tensor], torch.Tensor]:
    """The model's output as (loss dict, summed loss): a loss tensor (named ``total_loss``)
    or a non-empty dict of str -> loss tensor. Anything else is a TypeError/ValueError saying
    what run_step expected and what it got (a float among tensors too: detectron2 would sum
    it and then fail in ``.detach()`` when writing the metrics)."""
    if isinstance(out, torch.Tensor):
        return {"total_loss": out}, out
    if type(out) is dict and out:
        # The per-step path: the keys' and values' types, and one sum; the checks below only
        # when it fails.
        if _ONLY_STR.issuperset(map(type, out)) and _TENSORS.issuperset(map(type, out.values())):
            return out, _sum(out.values())
    expected = "a loss tensor or a dict of str -> loss tensor"
    if not isinstance(out, Mapping):
        raise TypeError(f"[{who}] the model must return {expected}, got {type(out).__name__}")
    if not out:
        raise ValueError(f"[{who}] the model must return {expected}, got an empty dict")
    for name, value in out.items():
        if not isinstance(name, str):
            raise TypeError(
                f"[{who}] the model's loss dict must have str keys, got {type(name).__name__} "
                f"key {name!r}"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"[{who}] the model's loss '{name}' must be a tensor, got {type(value).__name__}"
            )
    return out, _sum(out.values())


def _sum(values: Iterable[Any]) -> Any:
    """``sum(values)`` started from the first value instead of 0: ``0 + tensor`` goes through
    ``Tensor.__radd__`` and costs about as much as two tensor additions (the values are the
    same; the graph has one add fewer)."""
    it = iter(values)
    total = next(it)
    for v in it:
        total = total + v
    return total
