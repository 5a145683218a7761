"""Overhead benchmarks, shared by ``hookloop bench`` and ``benches/``.

- :mod:`hookloop.bench.overhead`: the sections of ``benches/bench_overhead.py`` (put_scalar,
  memory, loop, write_metrics, writers, the default stack), their table and JSON;
- :mod:`hookloop.bench.tiny_mlp`: the end-to-end tiny MLP, its hand-written loop and the
  trainers of each engine (also used by ``benches/gpu_check.py``);
- :mod:`hookloop.bench.command`: ``hookloop bench``, which runs a selection of the above side
  by side with detectron2 when it is importable.

Importing this package imports nothing; the submodules import torch.
"""
