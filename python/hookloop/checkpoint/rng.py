"""The random number generators' states, for an exact resume.

``get_rng_state()`` captures Python's ``random``, numpy's global generator, torch's CPU
generator and, when CUDA has been initialised, every CUDA device's generator;
``set_rng_state()`` restores them. The state holds only tensors, ints, floats, strings and
tuples, so a checkpoint that contains it loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Dict, Mapping

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]

logger = logging.getLogger(__name__)

_KEYS = ("python", "numpy", "torch", "cuda")


def get_rng_state() -> Dict[str, Any]:
    """The current state of every global random number generator.

    Returns:
        dict: ``python``, ``numpy`` and ``torch`` always; ``cuda`` (one state per device)
        when CUDA is initialised. An uninitialised CUDA has drawn no numbers, so there is
        nothing to capture, and reading its state would start it.
    """
    state: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what :func:`get_rng_state` returned.

    Generators missing from ``state`` are left alone. A ``cuda`` entry is skipped with a
    warning when CUDA is not available here; with fewer devices than saved, the first ones
    are restored (also with a warning).

    Raises:
        TypeError: when ``state`` is not a dict.
        ValueError: naming the generator whose state is malformed.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"set_rng_state() needs a dict, got {type(state).__name__}")
    unknown = set(state) - set(_KEYS)
    if unknown:
        raise ValueError(f"set_rng_state() got unknown generators {sorted(unknown)}")
    # Parse everything before setting anything, so a bad entry changes nothing.
    setters = []
    if "python" in state:
        py = state["python"]
        try:
            r = random.Random()
            r.setstate(_as_tuple(py))
        except (TypeError, ValueError) as e:
            raise ValueError(f"set_rng_state(): bad 'python' state: {e}") from e
        setters.append(lambda: random.setstate(r.getstate()))
    if "numpy" in state:
        np_state = _numpy_tuple(state["numpy"])
        setters.append(lambda: np.random.set_state(np_state))
    if "torch" in state:
        cpu = _byte_tensor("torch", state["torch"])
        setters.append(lambda: torch.set_rng_state(cpu))
    if "cuda" in state:
        cuda = state["cuda"]
        if not isinstance(cuda, (list, tuple)):
            raise ValueError("set_rng_state(): 'cuda' must be a list of per-device states")
        cuda_states = [_byte_tensor(f"cuda[{i}]", s) for i, s in enumerate(cuda)]
        setters.append(lambda: _set_cuda(cuda_states))
    for set_one in setters:
        set_one()


def _set_cuda(states: list) -> None:
    if not torch.cuda.is_available():
        logger.warning("The checkpoint has CUDA RNG states but CUDA is not available: skipped")
        return
    count = torch.cuda.device_count()
    if len(states) != count:
        logger.warning(
            f"The checkpoint has CUDA RNG states for {len(states)} device(s) and this process "
            f"sees {count}: restoring {min(count, len(states))}"
        )
    for i, s in enumerate(states[:count]):
        torch.cuda.set_rng_state(s, device=i)


def _as_tuple(obj: Any) -> Any:
    # random.setstate wants tuples all the way down; a state that went through JSON or
    # another format may come back with lists.
    if isinstance(obj, (list, tuple)):
        return tuple(_as_tuple(x) for x in obj)
    return obj


def _numpy_state() -> Dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "key": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _numpy_tuple(state: Any) -> Any:
    try:
        key = state["key"]
        if isinstance(key, torch.Tensor):
            key = key.numpy()
        out = (
            str(state["bit_generator"]),
            np.asarray(key, dtype=np.int64).astype(np.uint32),
            int(state["pos"]),
            int(state["has_gauss"]),
            float(state["cached_gaussian"]),
        )
        np.random.RandomState().set_state(out)  # validates without touching the global one
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"set_rng_state(): bad 'numpy' state: {e!r}") from e
    return out


def _byte_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise ValueError(
            f"set_rng_state(): {name!r} state must be a uint8 tensor, got {type(value).__name__}"
        )
    return value.cpu()
