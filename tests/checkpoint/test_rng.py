"""``hookloop.checkpoint.rng``: capture and restore the global random number generators."""

from __future__ import annotations

import io
import json
import logging
import random

import numpy as np
import pytest
import torch
from hookloop.checkpoint import get_rng_state, set_rng_state
from hookloop.checkpoint import rng as rng_module


def _draw():
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def test_round_trip_restores_every_generator():
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = get_rng_state()
    assert set(state) >= {"python", "numpy", "torch"}
    first = _draw()
    _draw()
    set_rng_state(state)
    assert _draw() == first


def test_state_loads_with_weights_only():
    state = get_rng_state()
    first = _draw()
    buf = io.BytesIO()
    torch.save({"rng": state}, buf)
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True)["rng"])
    assert _draw() == first


def test_python_state_through_json_lists():
    state = get_rng_state()
    first = random.random()
    set_rng_state({"python": json.loads(json.dumps(state["python"]))})
    assert random.random() == first


def test_missing_generators_are_left_alone():
    state = get_rng_state()
    py_first = random.random()
    torch_next = torch.rand(1)
    set_rng_state({"python": state["python"]})
    assert random.random() == py_first
    assert not torch.equal(torch.rand(1), torch_next)  # torch's was not rewound


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        ([1, 2], TypeError, "needs a dict"),
        ({"mersenne": 1}, ValueError, "unknown generators \\['mersenne'\\]"),
        ({"python": (3, (1, 2), None)}, ValueError, "bad 'python' state"),
        ({"numpy": {"key": [1]}}, ValueError, "bad 'numpy' state"),
        ({"torch": [1, 2]}, ValueError, "'torch' state must be a uint8 tensor"),
        ({"cuda": "x"}, ValueError, "'cuda' must be a list"),
        ({"cuda": [torch.zeros(2)]}, ValueError, "'cuda\\[0\\]' state must be a uint8 tensor"),
    ],
)
def test_bad_state_changes_nothing(bad, exc, match):
    state = get_rng_state()
    before = _draw()
    set_rng_state(state)
    if isinstance(bad, dict):
        bad = {**state, **bad}  # a good python/torch entry next to the bad one
    with pytest.raises(exc, match=match):
        set_rng_state(bad)
    assert _draw() == before


def test_cuda_state_without_cuda_is_skipped_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(rng_module.torch.cuda, "is_available", lambda: False)
    caplog.set_level(logging.WARNING, logger="hookloop.checkpoint.rng")
    set_rng_state({"cuda": [torch.get_rng_state()]})
    assert "CUDA is not available" in caplog.text
    assert "cuda" not in get_rng_state()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip():
    torch.cuda.init()
    state = get_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    first = torch.rand(4, device="cuda").tolist()
    torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == first
