"""Shared fixtures for the hookloop test suite."""

from __future__ import annotations

import logging
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


@pytest.fixture
def hookloop_logs_info() -> Iterator[None]:
    """hookloop's logger at INFO for the test. DefaultTrainer calls setup_logger() when that
    logger would drop INFO records; the logger then stops propagating, which later tests' log
    captures (caplog, the corpus) would miss."""
    log = logging.getLogger("hookloop")
    level = log.level
    log.setLevel(logging.INFO)
    yield
    log.setLevel(level)
