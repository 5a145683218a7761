"""The whole training step as one CUDA graph: :class:`CUDAGraphTrainer` and its collaborators.

Capture sits behind one small seam, :class:`StepGraph` (:mod:`.seam`: ``CUDAStepGraph``,
``EagerStepGraph``). :class:`GraphStep` (:mod:`.step`) holds what the captured function reads
and writes, all at fixed addresses, so one replay is one training step; each part is a room of
its own:

- :mod:`.options`: the options (``graph``, ``fallback``, ``precision``, ``warmup_iters``,
  ``ring_size``, ``max_graphs``), checked in one place;
- :mod:`.state`: the phase of the capture (NEW, CONFIGURED, WARMING, CAPTURED), the run's
  eager mode and whether the step is running, with its transitions;
- :mod:`.batch`: one graph per batch signature, up to ``max_graphs``, each with its static
  batch (the loader's tensors copied in before each replay) or the loader's graph source;
- :mod:`.lr`: the LR table, one row per iteration, which the graph reads at the device step
  counter (all graphs share the counter, the table and the ring);
- :mod:`.ring`: the loss ring buffer the storage reads, and its invariant (a slot is read
  before the graph writes it again);
- :mod:`.guard`: what a capture baked in from the Python side, checked before each replay,
  and the watches on assignments and loads; a change is captured again;
- :mod:`.trainer`: :class:`CUDAGraphTrainer` itself.
"""

# The names graph.py had (its public ones, and the private ones tests and tools import), where
# they live now; `X as X`: an explicit re-export.
from hookloop.engine.graph.guard import RECAPTURE_WARNING as RECAPTURE_WARNING
from hookloop.engine.graph.guard import _Baked as _Baked
from hookloop.engine.graph.lr import MAX_TABLE_ROWS as MAX_TABLE_ROWS
from hookloop.engine.graph.lr import lr_rows as lr_rows
from hookloop.engine.graph.options import DEFAULT_MAX_GRAPHS as DEFAULT_MAX_GRAPHS
from hookloop.engine.graph.options import GraphOptions
from hookloop.engine.graph.ring import RING_SAFETY as RING_SAFETY
from hookloop.engine.graph.seam import CAPTURE_OPTIONS as CAPTURE_OPTIONS
from hookloop.engine.graph.seam import (
    CUDAStepGraph,
    EagerStepGraph,
    StepGraph,
    capture_problem,
)
from hookloop.engine.graph.state import Phase
from hookloop.engine.graph.step import GraphStep
from hookloop.engine.graph.trainer import CUDAGraphTrainer
from hookloop.engine.graph.trainer import _GraphTrainerParts as _GraphTrainerParts

__all__ = [
    "CUDAGraphTrainer",
    "CUDAStepGraph",
    "EagerStepGraph",
    "GraphOptions",
    "GraphStep",
    "Phase",
    "StepGraph",
    "capture_problem",
]
