"""The guard: what a capture baked in from the Python side, and the watch on what hooks and
loads change of it between steps.

A replay runs the step as it was captured. :class:`_Baked` records, at the capture, which
parameters require gradients, which modules train, the optimizer's param groups (their
parameters and every option but the LR, which the graph reads from the table) and its state
tensors; :class:`Guard` compares them before every replay and names the first change. Two
watches catch what no comparison sees: torch's global registration hooks report a tensor or
submodule assigned anew on one of the model's modules (:func:`_watch_assignments`), and the
model's and optimizer's load post-hooks report a load (:func:`_watch_loads`). Any of these
drops the graphs (the step decides, and counts the recaptures here).
"""

from __future__ import annotations

import operator
import weakref
from itertools import chain
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

from hookloop.engine.graph.batch import _same_value
from hookloop.engine.graph.seam import WHO

__all__ = ["RECAPTURE_WARNING", "Guard"]

#: A warning when the step has been captured again this many times (see Guard.recaptured).
RECAPTURE_WARNING = 10

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")
#: Param-group entries a replay does not take from the group: the LR comes from the table.
_NOT_BAKED = frozenset({"params", "lr", "initial_lr"})


def _state_ids(state: Mapping[Any, Any]) -> List[int]:
    """The ids of every value in an optimizer's state, parameter by parameter (made in C:
    looking the parameters up would hash each tensor in Python)."""
    return list(map(id, chain.from_iterable(map(dict.values, state.values()))))


def _no_ids(state: Any) -> List[int]:
    return []


def _nothing(_: Any) -> Tuple[()]:
    return ()


def _as_tuple(values: Any, n: int) -> Tuple[Any, ...]:
    """``itemgetter``'s result as a tuple of ``n`` (one key gives the value itself)."""
    return (values,) if n == 1 else tuple(values)


class _Baked:
    """What a capture baked in from the Python side, checked before every replay: which
    parameters require gradients, which modules are in training mode, the optimizer's param
    groups (their parameters and every option but the LR, which the graph reads from the
    table), the optimizer's state (the tensors a replay updates, by identity), and the
    model's modules by name (for :meth:`Guard.assignment`). A hook that freezes a backbone,
    puts a submodule in eval mode, schedules the momentum, adds a param group or clears or
    replaces the optimizer's state changes one of these, and the eager step would follow it:
    the graphs are dropped and the step is captured again. The check is a few comparisons
    made in C (about 2.5 µs a step for the tiny MLP), while the device runs the replay before."""

    __slots__ = (
        "params",
        "grads",
        "modules",
        "modes",
        "names",
        "groups",
        "keys",
        "getters",
        "options",
        "state",
        "state_ids",
        "ids_of",
    )

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.params = list(model.parameters())
        self.grads = list(map(_REQUIRES_GRAD, self.params))
        named = list(model.named_modules())
        self.modules = [m for _, m in named]
        self.modes = list(map(_TRAINING, self.modules))
        self.names = {id(m): n for n, m in named}
        self.groups = optimizer.param_groups
        self.keys = [[k for k in g if k not in _NOT_BAKED] for g in self.groups]
        self.getters = [operator.itemgetter(*keys) if keys else _nothing for keys in self.keys]
        self.options = self._options(self.groups)
        #: Each parameter's state as the capture saw it (copies of the dicts: the tensors, kept
        #: alive so that their ids stay theirs), and the ids of those values in order. A state
        #: that is not a dict per parameter (torch's optimizers all keep one) is not watched.
        watched = all(isinstance(s, dict) for s in optimizer.state.values())
        self.ids_of = _state_ids if watched else _no_ids
        self.state = [(p, dict(s)) for p, s in optimizer.state.items()] if watched else []
        self.state_ids = self.ids_of(optimizer.state)

    def _options(self, groups: Sequence[Mapping[str, Any]]) -> List[Tuple[Any, ...]]:
        # The params list by identity (== compares its items by identity first), its length.
        return [
            (len(g), g["params"], len(g["params"]), get(g)) for g, get in zip(groups, self.getters)
        ]

    def changed(self, model: Any, optimizer: Any) -> Optional[str]:
        """None, or what changed since the capture."""
        groups = optimizer.param_groups
        try:
            if (
                list(map(_REQUIRES_GRAD, self.params)) == self.grads
                and list(map(_TRAINING, self.modules)) == self.modes
                and groups is self.groups
                and len(groups) == len(self.options)
                and self._options(groups) == self.options  # identity first, then ==
                and self.ids_of(optimizer.state) == self.state_ids
            ):
                return None
        except Exception:  # an option removed, one whose == has no truth value, odd state
            pass
        return self._what_changed(model, optimizer)

    def _what_changed(self, model: Any, optimizer: Any) -> str:
        groups = optimizer.param_groups
        names = {id(p): n for n, p in model.named_parameters()}
        for p, was in zip(self.params, self.grads):
            if p.requires_grad != was:
                return f"requires_grad of {names.get(id(p), 'a parameter')} changed to {not was}"
        for m, was in zip(self.modules, self.modes):
            if m.training != was:
                mode = "eval" if was else "train"
                return f"{self.names[id(m)] or 'the model'} was put in {mode} mode"
        if groups is not self.groups or len(groups) != len(self.options):
            n = len(self.options)
            return f"the optimizer's param groups changed ({len(groups)}, captured with {n})"
        for i, (g, keys, (size, params, n, values)) in enumerate(
            zip(groups, self.keys, self.options)
        ):
            now = g["params"]
            if len(g) != size or len(now) != n or any(p is not q for p, q in zip(now, params)):
                return f"param group {i}'s parameters or options changed"
            for k, old in zip(keys, _as_tuple(values, len(keys))):
                now = g.get(k)
                if now is not old and not (
                    not isinstance(old, torch.Tensor) and _same_value(now, old)
                ):
                    return f"param group {i}'s {k} changed from {old!r} to {now!r}"
        return self._state_changed(optimizer.state, names) or "the captured state changed"

    def _state_changed(self, state: Any, names: Mapping[int, str]) -> Optional[str]:
        """How the optimizer's state differs from the captured one (a replay would update the
        captured tensors, not the ones the optimizer holds now), or None."""
        if self.state and not any(map(len, state.values())):
            return "the optimizer's state was cleared"
        held = {id(p): s for p, s in self.state}
        for p, now in list(state.items()) + [(p, {}) for p, _ in self.state if p not in state]:
            was = held.get(id(p), {})
            diff = [f"{k} replaced" for k, v in was.items() if k in now and now[k] is not v]
            diff += [f"{k} removed" for k in was if k not in now]
            diff += [f"{k} added" for k in now if k not in was]
            if diff:
                name = names.get(id(p), "a parameter outside the model")
                return f"the optimizer's state of {name} changed ({', '.join(diff)})"
        return None


class Guard:
    """What the capture baked in (while a graph is captured) and how many times a change made
    the step capture again."""

    __slots__ = ("baked", "recaptures")

    def __init__(self) -> None:
        #: While a graph is captured: what it baked in (checked before each replay; a tensor
        #: or submodule assigned anew on one of its modules between steps drops the graphs).
        self.baked: Optional[_Baked] = None
        #: How many times a change after a capture made it capture again.
        self.recaptures = 0

    def bake(self, model: Any, optimizer: Any) -> None:
        """At the first capture (after its first replay: the eager seam's, with
        warmup_iters=0, made the optimizer's state, which a CUDA capture makes while it
        records)."""
        self.baked = _Baked(model, optimizer)

    def forget(self) -> None:
        self.baked = None

    def changed(self, trainer: Any) -> Optional[str]:
        """Before a replay: None, or what changed of what the capture baked in."""
        baked = self.baked
        if baked is None:
            return None
        what = baked.changed(trainer.model, trainer.optimizer)
        return None if what is None else f"{what} before iteration {trainer.iter}"

    def assignment(self, module: Any, name: str, it: Optional[int]) -> Optional[str]:
        """``module.name = ...`` between steps (after iteration ``it``, when known): why the
        graphs go when ``module`` is one of the captured model's, or None."""
        baked = self.baked
        where = None if baked is None else baked.names.get(id(module))
        if where is None:
            return None
        at = f" after iteration {it}" if it is not None else ""
        return f"{where + '.' if where else ''}{name} of the model was assigned anew{at}"

    def recaptured(self, why: str, warmup_iters: int) -> Optional[str]:
        """Counts one more capture after a change (``why``); returns the warning to give once
        when the count reaches :data:`RECAPTURE_WARNING`, or None."""
        self.recaptures += 1
        if self.recaptures != RECAPTURE_WARNING:
            return None
        return (
            f"{WHO} has captured the step again {RECAPTURE_WARNING} times, each after a "
            f"change to what the capture holds (the last: {why}), and each capture runs "
            f"warmup_iters={warmup_iters} eager steps first. Make such changes less "
            "often, or train with SimpleTrainer"
        )


def _watch_assignments(step: Any) -> None:
    """Calls ``step.assigned(module, name)`` at every assignment of a registered buffer,
    parameter or submodule (torch's global registration hooks), for as long as ``step``
    lives."""
    from torch.nn.modules import module as nn_module

    this = weakref.ref(step)

    def assigned(module: Any, name: str, value: Any) -> None:
        s = this()
        if s is not None:
            s.assigned(module, name)

    handles = [
        nn_module.register_module_buffer_registration_hook(assigned),
        nn_module.register_module_parameter_registration_hook(assigned),
        nn_module.register_module_module_registration_hook(assigned),
    ]
    weakref.finalize(step, _remove_all, handles)


def _remove_all(handles: Sequence[Any]) -> None:
    for h in handles:
        h.remove()


def _watch_loads(step: Any, model: Any, optimizer: Any) -> None:
    """Calls ``step.invalidate()`` after every load of ``optimizer`` or ``model``: a load
    replaces the optimizer's state tensors (the graph holds the old ones) and may replace the
    model's (``load_state_dict(assign=True)``). A weak reference: the hooks keep nothing
    alive."""
    this = weakref.ref(step)

    def invalidate(*_: Any) -> None:
        s = this()
        if s is not None:
            s.invalidate()

    optimizer.register_load_state_dict_post_hook(invalidate)
    model.register_load_state_dict_post_hook(invalidate)
