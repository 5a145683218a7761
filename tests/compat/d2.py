"""The tests' model of detectron2: ``hookloop._d2_reference``, under its old name.

The reference engine ships inside the package so that ``hookloop bench`` can run it without
this directory. This module *is* that module (``sys.modules`` is pointed at it), so
``from compat import d2`` gives the same classes and functions, private names included.
"""

import sys

from hookloop import _d2_reference

sys.modules[__name__] = _d2_reference
