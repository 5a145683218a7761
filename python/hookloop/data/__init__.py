"""Data utilities, mirroring ``detectron2.data`` (so far: the training sampler)."""

from hookloop.data.samplers import TrainingSampler

__all__ = ["TrainingSampler"]
