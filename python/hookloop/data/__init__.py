"""Data utilities, mirroring ``detectron2.data``: the training sampler, and a loader whose data
stays on the device (:mod:`hookloop.data.resident`)."""

from hookloop.data.resident import (
    DeviceResidentLoader,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
)
from hookloop.data.samplers import TrainingSampler

__all__ = [
    "DeviceResidentLoader",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "TrainingSampler",
]
