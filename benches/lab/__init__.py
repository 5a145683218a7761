"""The measuring code of the scripts in ``benches/``; not part of the package.

- :mod:`lab.overhead`: the sections of ``bench_overhead.py`` (put_scalar, memory, loop,
  write_metrics, writers, the default stack), their table and JSON;
- :mod:`lab.tiny_mlp`: the end-to-end tiny MLP (``hookloop bench``'s model), its hand-written
  loops and each engine's trainer;
- :mod:`lab.paired`: the tiny MLP's loops timed in paired turns, each in processes of its own.

The baseline engine is the tests' pure-Python model of detectron2,
``tests/compat/reference_engine.py``. The benchmarks run from a checkout: importing this
package puts the checkout's ``tests/`` directory on ``sys.path``, so that the baseline imports
as ``compat.reference_engine`` (as in the tests). Nothing else is imported here; the
submodules import torch.
"""

import os
import sys

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tests")
TESTS = os.path.abspath(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
