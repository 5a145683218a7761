"""hookloop.utils.progress.ProgressBar: one live line on a terminal, nothing elsewhere."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from hookloop.engine import PeriodicWriter, SimpleTrainer
from hookloop.utils import progress
from hookloop.utils.events import EventStorage
from hookloop.utils.progress import ProgressBar
from torch import nn

pytest.importorskip("tqdm")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run(bar, iters, log_at=None, logger=None):
    with EventStorage() as storage:
        for i in range(iters):
            storage.iter = i
            storage.put_scalars(total_loss=1.0 / (i + 1), lr=0.01 * (i + 1))
            bar.write()
            if i == log_at:
                logger.info("a log line")
        bar.close()


def _segments(text):
    """What a terminal shows, line by line: the text after the last carriage return (tqdm pads
    a redraw with spaces where the previous one was longer)."""
    return [line.rsplit("\r", 1)[-1].rstrip(" ") for line in text.split("\n")]


def test_terminal_shows_iteration_rate_eta_loss_and_lr():
    out = io.StringIO()
    bar = ProgressBar(100, window_size=1, file=out, terminal=True, refresh_interval=0)
    _run(bar, 5)
    text = out.getvalue()
    final = _segments(text)[0]
    assert " 5/100 [" in final
    assert re.search(r"\d\d:\d\d<\d\d:\d\d", final)  # elapsed<ETA
    assert re.search(r"(it/s|s/it)", final)
    assert final.endswith(", total_loss=0.2, lr=0.05]")
    # Each write redrew the line in place; close ended it.
    assert [f" {i}/100 [" in text for i in range(1, 6)] == [True] * 5
    assert text.endswith("\n") and text.count("\n") == 1


def test_without_max_iter_shows_the_count():
    out = io.StringIO()
    _run(ProgressBar(file=out, terminal=True, refresh_interval=0), 3)
    assert _segments(out.getvalue())[0].startswith("3it [")


def test_not_a_terminal_writes_nothing():
    out = io.StringIO()  # isatty() is False
    bar = ProgressBar(10, file=out)
    _run(bar, 4)
    assert out.getvalue() == ""
    assert bar._bar is None


def test_without_tqdm_writes_nothing(monkeypatch):
    monkeypatch.setattr(progress, "_tqdm_class", lambda: None)
    out = io.StringIO()
    _run(ProgressBar(10, file=out, terminal=True, refresh_interval=0), 4)
    assert out.getvalue() == ""


def test_write_between_redraws_does_nothing():
    out = io.StringIO()
    clock = FakeClock()
    bar = ProgressBar(100, file=out, terminal=True, refresh_interval=1.0)
    bar._clock = clock
    with EventStorage() as storage:
        storage.put_scalar("total_loss", 0.5)
        bar.write()  # draws
    drawn = out.getvalue()
    assert " 1/100 [" in drawn
    clock.now = 0.5
    # Within the interval write() reads nothing: not even the storage, of which none is open.
    for _ in range(3):
        bar.write()
    assert out.getvalue() == drawn
    clock.now = 1.0
    with EventStorage(7) as storage:
        bar.write()
        assert " 8/100 [" in out.getvalue()[len(drawn) :]
        bar.close()


def test_log_lines_stay_whole_above_the_bar():
    out = io.StringIO()
    logger = logging.getLogger("hookloop.tests.progress")
    handler = logging.StreamHandler(out)  # a console handler on the bar's stream
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        _run(ProgressBar(10, file=out, terminal=True, refresh_interval=0), 5, 2, logger)
        lines = _segments(out.getvalue())
        assert lines[0] == "INFO a log line"  # cleared bar, then the whole line
        assert " 5/10 [" in lines[1]  # the bar, redrawn below and finished
        assert handler.stream is out  # restored by close()
        logger.debug("not shown")  # the handler kept its level
        assert "not shown" not in out.getvalue()
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def test_progress_bar_in_a_training_run():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(2, 1)

        def forward(self, x):
            return self.w(x).pow(2).mean()

    model = Model()
    out = io.StringIO()
    trainer = SimpleTrainer(model, [torch.ones(2, 2)] * 3, torch.optim.SGD(model.parameters(), 0.1))
    trainer.register_hooks(
        [PeriodicWriter([ProgressBar(3, file=out, terminal=True, refresh_interval=0)], period=1)]
    )
    trainer.train(0, 3)
    final = _segments(out.getvalue())[0]
    assert " 3/3 [" in final and "total_loss=" in final


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"max_iter": 1.5}, TypeError, "max_iter"),
        ({"window_size": 0}, ValueError, "window_size"),
        ({"window_size": "20"}, TypeError, "window_size"),
        ({"refresh_interval": -1}, ValueError, "refresh_interval"),
        ({"refresh_interval": "0.1"}, TypeError, "refresh_interval"),
        ({"file": 3}, TypeError, "file"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ProgressBar(**kwargs)
