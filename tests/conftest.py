"""Shared fixtures for the hookloop test suite."""

from __future__ import annotations

from typing import Iterator

import pytest
from hookloop.utils.events import EventStorage, has_event_storage


@pytest.fixture
def storage() -> Iterator[EventStorage]:
    """A fresh ``EventStorage`` entered as the current storage (start_iter 0)."""
    assert not has_event_storage(), "a previous test left an EventStorage active"
    with EventStorage() as s:
        yield s
    assert not has_event_storage()
