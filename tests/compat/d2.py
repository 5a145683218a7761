"""The tests' model of detectron2: ``compat.reference_engine``, under the name the tests use.

This module *is* that module (``sys.modules`` is pointed at it), so ``from compat import d2``
gives the same classes and functions, private names included.
"""

import sys

from compat import reference_engine

sys.modules[__name__] = reference_engine
