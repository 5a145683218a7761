"""hookloop: a Rust-accelerated, drop-in replacement for detectron2's training-loop engine.

Importing ``hookloop`` is cheap and does not import torch; ``hookloop.engine`` does.
Rewrite ``detectron2.engine`` -> ``hookloop.engine`` and ``detectron2.utils.events`` ->
``hookloop.utils.events`` in a detectron2-style codebase to switch.
"""

from hookloop._core import BUILD_PROFILE, __version__
from hookloop.utils import logger as _logger  # noqa: F401  (puts "hookloop" under "detectron2")

__all__ = ["__version__", "BUILD_PROFILE"]
