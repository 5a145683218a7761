"""Shared fixtures for the hookloop test suite."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
from hookloop.utils.events import EventStorage, has_event_storage
from hypothesis import settings

# Property tests draw the same examples on every run (a suite that can fail by chance blocks
# every landing); HYPOTHESIS_PROFILE=explore draws new ones, for looking for bugs on purpose.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture
def storage() -> Iterator[EventStorage]:
    """A fresh ``EventStorage`` entered as the current storage (start_iter 0)."""
    assert not has_event_storage(), "a previous test left an EventStorage active"
    with EventStorage() as s:
        yield s
    assert not has_event_storage()
