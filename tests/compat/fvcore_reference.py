"""fvcore's parameter-scheduler formulas and detectron2's warmup, written out in plain Python:
the oracle of the schedule tests (tests/solver).

A transcription kept deliberately literal: the same float operations in the same order as
``fvcore.common.param_scheduler`` and ``detectron2.solver.lr_scheduler``, so that hookloop's
native values must match these bit for bit. No hookloop import.
"""

from __future__ import annotations

import bisect
import math

__all__ = [
    "EPS",
    "RefConstant",
    "RefCosine",
    "RefExponential",
    "RefLinear",
    "RefMultiStep",
    "RefPolynomialDecay",
    "RefStep",
    "ref_fixed_gamma",
    "RefComposite",
    "ref_warmup",
]

EPS = 1e-6


class RefConstant:
    def __init__(self, value):
        self.value = value

    def __call__(self, where):
        if where >= 1.0:
            raise RuntimeError(where)
        return self.value


class RefCosine:
    def __init__(self, start_value, end_value):
        self.start, self.end = start_value, end_value

    def __call__(self, where):
        return self.end + 0.5 * (self.start - self.end) * (1 + math.cos(math.pi * where))


class RefExponential:
    def __init__(self, start_value, decay):
        self.start, self.decay = start_value, decay

    def __call__(self, where):
        return self.start * (self.decay**where)


class RefLinear:
    def __init__(self, start_value, end_value):
        self.start, self.end = start_value, end_value

    def __call__(self, where):
        return self.end * where + self.start * (1 - where)


class RefMultiStep:
    def __init__(self, values, num_updates=None, milestones=None):
        if milestones is None:
            width = math.ceil(num_updates / float(len(values)))
            milestones = [width * (k + 1) for k in range(len(values) - 1)]
        if num_updates is None:
            num_updates, milestones = milestones[-1], milestones[:-1]
        self.values, self.num_updates, self.milestones = values, num_updates, milestones

    def __call__(self, where):
        if where > 1.0:
            raise RuntimeError(where)
        epoch_num = int((where + EPS) * self.num_updates)
        return self.values[bisect.bisect_right(self.milestones, epoch_num)]


class RefPolynomialDecay:
    def __init__(self, base_value, power):
        self.base, self.power = base_value, power

    def __call__(self, where):
        return self.base * (1 - where) ** self.power


class RefStep:
    def __init__(self, num_updates, values):
        self.values = values

    def __call__(self, where):
        return self.values[int((where + EPS) * len(self.values))]


def ref_fixed_gamma(base_value, num_decays, gamma, num_updates):
    values = [base_value]
    for _ in range(num_decays):
        values.append(values[-1] * gamma)
    return RefStep(num_updates, values)


class RefComposite:
    def __init__(self, schedulers, lengths, interval_scaling):
        lengths = list(lengths)
        if sum(lengths) != 1.0:
            lengths[-1] = 1.0 - sum(lengths[:-1])
        self.schedulers, self.lengths, self.scaling = schedulers, lengths, interval_scaling

    def __call__(self, where):
        i = 0
        running_total = self.lengths[i]
        while (where + EPS) > running_total and i < len(self.schedulers) - 1:
            i += 1
            running_total += self.lengths[i]
        scheduler_where = where
        if self.scaling[i] == "rescaled":
            scheduler_start = running_total - self.lengths[i]
            scheduler_where = (where - scheduler_start) / self.lengths[i]
        return self.schedulers[i](scheduler_where)


def ref_warmup(scheduler, warmup_factor, warmup_length, warmup_method="linear", rescale=False):
    end_value = scheduler(0.0) if rescale else scheduler(warmup_length)
    start_value = warmup_factor * scheduler(0.0)
    if warmup_method == "constant":
        warmup = RefConstant(start_value)
    else:
        warmup = RefLinear(start_value, end_value)
    return RefComposite(
        [warmup, scheduler],
        [warmup_length, 1 - warmup_length],
        ["rescaled", "rescaled" if rescale else "fixed"],
    )
