"""hookloop.utils.logger: detectron2's setup_logger and log_* helpers, and the bridge that lets
code which configures or silences the "detectron2" logger do the same to hookloop's records."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import types

import pytest
import torch
from hookloop.engine import SimpleTrainer
from hookloop.utils import logger as logmod
from hookloop.utils.logger import log_every_n, log_every_n_seconds, log_first_n, setup_logger
from torch import nn

STARTING = "Starting training from iteration 0"
LOG_LINE = re.compile(r"^\[\d\d/\d\d \d\d:\d\d:\d\d\] (\S+) (\w+): (.*)$")


@pytest.fixture(autouse=True)
def clean_logging(monkeypatch):
    """Each test starts with the loggers it touches as found, and leaves them so: the
    setup_logger cache cleared, added handlers removed and their files closed."""
    names = ["detectron2", "hookloop", "hookloop.engine.train_loop", "mod"]  # caplog: root
    saved = {}
    for name in names:
        lg = logging.getLogger(name)
        saved[name] = (lg.level, lg.propagate, list(lg.handlers))
    opened = []
    open_log = logmod._cached_log_stream

    def recording_open(filename):
        opened.append(open_log(filename))
        return opened[-1]

    monkeypatch.setattr(logmod, "_cached_log_stream", recording_open)
    yield
    for name, (level, propagate, handlers) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers = handlers
        lg.propagate = propagate
        lg.setLevel(level)
    logmod._setup_logger.cache_clear()
    open_log.cache_clear()
    for stream in opened:
        stream.close()
    logmod._LOG_COUNTER.clear()
    logmod._LOG_TIMER.clear()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, logger_name):
        return [r.getMessage() for r in self.records if r.name == logger_name]


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(2, 1)

    def forward(self, x):
        return {"loss": self.w(x).pow(2).mean()}


def _train(iters=2):
    model = _Model()
    data = [torch.ones(4, 2)] * iters
    trainer = SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.train(0, iters)


def _file_lines(path):
    return [LOG_LINE.match(line).groups() for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------------------------
# setup_logger


def test_setup_logger_writes_log_txt_in_an_output_dir(tmp_path):
    # default_setup-style: setup_logger(cfg.OUTPUT_DIR) then log from the package's modules.
    logger = setup_logger(str(tmp_path / "out"), configure_stdout=False)
    assert logger is logging.getLogger("hookloop")
    assert logger.level == logging.DEBUG and logger.propagate is False
    logger.info("hello")
    logging.getLogger("hookloop.engine.hooks").debug("from a child")
    assert _file_lines(tmp_path / "out" / "log.txt") == [
        ("hookloop", "INFO", "hello"),
        ("hookloop.engine.hooks", "DEBUG", "from a child"),
    ]


@pytest.mark.parametrize("filename", ["run.log", "train.txt"])
def test_setup_logger_output_ending_in_log_or_txt_is_the_file(tmp_path, filename):
    path = tmp_path / "nested" / filename
    setup_logger(path, configure_stdout=False, name="mod").info("x")  # os.PathLike accepted
    assert _file_lines(path) == [("mod", "INFO", "x")]


def test_setup_logger_other_ranks_log_only_to_their_own_file(tmp_path, capsys):
    logger = setup_logger(str(tmp_path), distributed_rank=3, name="mod")
    logger.info("rank three")
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "log.txt").exists()
    assert _file_lines(tmp_path / "log.txt.rank3") == [("mod", "INFO", "rank three")]


def test_setup_logger_called_twice_adds_no_handlers(tmp_path):
    a = setup_logger(str(tmp_path), name="mod")
    n = len(a.handlers)
    b = setup_logger(str(tmp_path), name="mod")
    assert b is a and len(b.handlers) == n == 2
    b.info("once")
    assert [m for _, _, m in _file_lines(tmp_path / "log.txt")] == ["once"]


def test_setup_logger_colored_console_abbreviates_detectron2(tmp_path, capsys):
    setup_logger(str(tmp_path), name="detectron2")
    logging.getLogger("detectron2.data.build").info("info line")
    logging.getLogger("detectron2.data.build").warning("warn line")
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"\x1b\[32m\[\d\d/\d\d \d\d:\d\d:\d\d d2\.data\.build\]: \x1b\[0minfo line", out[0]
    )
    assert out[1].startswith("\x1b[5m\x1b[31mWARNING\x1b[0m \x1b[32m[")
    assert out[1].endswith("d2.data.build]: \x1b[0mwarn line")
    # The console's abbreviation does not leak into the file.
    assert [n for n, _, _ in _file_lines(tmp_path / "log.txt")] == ["detectron2.data.build"] * 2


def test_setup_logger_abbrev_name_and_plain_console(capsys):
    setup_logger(name="mod", abbrev_name="", color=True)
    logging.getLogger("mod.sub").error("bad")
    out = capsys.readouterr().out
    assert out.startswith("\x1b[4m\x1b[5m\x1b[31mERROR\x1b[0m ")
    assert " sub]: \x1b[0mbad" in out
    logmod._setup_logger.cache_clear()
    logging.getLogger("mod").handlers.clear()
    setup_logger(name="mod", color=False)
    logging.getLogger("mod.sub").info("plain")
    assert LOG_LINE.match(capsys.readouterr().out.rstrip("\n")).groups() == (
        "mod.sub",
        "INFO",
        "plain",
    )


def test_setup_logger_enable_propagation_reaches_root(caplog):
    setup_logger(name="mod", configure_stdout=False, enable_propagation=True)
    logging.getLogger("mod.x").info("up")
    assert [r.getMessage() for r in caplog.records if r.name == "mod.x"] == ["up"]


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"output": 3}, TypeError, "output"),
        ({"distributed_rank": "0"}, TypeError, "distributed_rank"),
        ({"distributed_rank": -1}, ValueError, "distributed_rank"),
        ({"name": None}, TypeError, "name"),
        ({"abbrev_name": 1}, TypeError, "abbrev_name"),
    ],
)
def test_setup_logger_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        setup_logger(**kwargs)


# ----------------------------------------------------------------------------------------------
# The detectron2 bridge


def test_logger_module_links_hookloop_under_detectron2_without_torch():
    assert logging.getLogger("hookloop").parent is logging.getLogger("detectron2")
    code = (
        "import sys, logging, hookloop.utils.logger; "
        "assert 'torch' not in sys.modules; "
        "assert logging.getLogger('hookloop').parent is logging.getLogger('detectron2')"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unconfigured_detectron2_logger_is_transparent(caplog):
    # Nothing configured but the root logger (logging.basicConfig style): records reach it.
    caplog.set_level(logging.INFO)
    _train()
    assert [r.getMessage() for r in caplog.records].count(STARTING) == 1


def test_default_setup_style_detectron2_logger_shows_engine_records_once(tmp_path, caplog):
    # detectron2's default_setup: setup_logger(output_dir, rank, name="detectron2"), here
    # hookloop's own, after the import rewrite.
    caplog.set_level(logging.INFO)
    setup_logger(str(tmp_path), name="detectron2", configure_stdout=False)
    _train()
    lines = _file_lines(tmp_path / "log.txt")
    assert lines.count(("hookloop.engine.train_loop", "INFO", STARTING)) == 1
    # It does not propagate past "detectron2", as detectron2's own records do not.
    assert STARTING not in [r.getMessage() for r in caplog.records]


def test_detectron2s_own_setup_logger_shows_engine_records_once():
    # What detectron2.utils.logger.setup_logger does to the "detectron2" logger, when a script
    # keeps detectron2's logger setup and rewrites only the engine imports.
    d2 = logging.getLogger("detectron2")
    d2.setLevel(logging.DEBUG)
    d2.propagate = False
    handler = _Records()
    d2.addHandler(handler)
    _train()
    assert handler.messages("hookloop.engine.train_loop").count(STARTING) == 1


def test_hookloop_and_detectron2_both_set_up_log_each_record_once(tmp_path):
    setup_logger(str(tmp_path), name="detectron2", configure_stdout=False)
    setup_logger(str(tmp_path), configure_stdout=False)  # name="hookloop", same log.txt
    _train()
    lines = _file_lines(tmp_path / "log.txt")
    assert lines.count(("hookloop.engine.train_loop", "INFO", STARTING)) == 1


def test_silencing_detectron2_logger_silences_engine_records(caplog):
    caplog.set_level(logging.INFO)
    logging.getLogger("detectron2").setLevel(logging.WARNING)
    _train()
    logging.getLogger("hookloop.engine.train_loop").warning("still shown")
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("hookloop.")]
    assert messages == ["still shown"]


def test_silencing_a_set_up_detectron2_logger_silences_engine_records(tmp_path):
    setup_logger(str(tmp_path), name="detectron2", configure_stdout=False)
    logging.getLogger("detectron2").setLevel(logging.WARNING)
    _train()
    assert (tmp_path / "log.txt").read_text() == ""


# ----------------------------------------------------------------------------------------------
# log_first_n, log_every_n, log_every_n_seconds


def _messages(caplog):
    return [(r.name, r.levelno, r.getMessage()) for r in caplog.records]


def test_log_first_n_per_caller(caplog):
    caplog.set_level(logging.DEBUG)
    for i in range(5):
        log_first_n(logging.INFO, f"msg {i}", n=2)
    assert _messages(caplog) == [
        (__name__, logging.INFO, "msg 0"),
        (__name__, logging.INFO, "msg 1"),
    ]


def test_log_first_n_by_message_across_callers(caplog):
    caplog.set_level(logging.DEBUG)
    log_first_n(logging.WARNING, "same", key="message", name="mod")
    log_first_n(logging.WARNING, "same", key="message", name="mod")
    log_first_n(logging.WARNING, "other", key="message", name="mod")
    for _ in range(2):
        log_first_n(logging.INFO, "a", key=("caller", "message"), name="mod")
        log_first_n(logging.INFO, "b", key=("caller", "message"), name="mod")
    assert [m for _, _, m in _messages(caplog)] == ["same", "other", "a", "b"]
    assert {n for n, _, _ in _messages(caplog)} == {"mod"}


def test_log_every_n(caplog):
    caplog.set_level(logging.DEBUG)
    for i in range(7):
        log_every_n(logging.INFO, f"step {i}", n=3)
    assert [m for _, _, m in _messages(caplog)] == ["step 0", "step 3", "step 6"]


def test_log_every_n_seconds_with_a_fake_clock(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    now = [100.0]
    monkeypatch.setattr(logmod, "time", types.SimpleNamespace(time=lambda: now[0]))
    for t in (100.0, 100.5, 101.0, 101.9, 103.5):
        now[0] = t
        log_every_n_seconds(logging.INFO, f"t={t}", n=1)
    assert [m for _, _, m in _messages(caplog)] == ["t=100.0", "t=101.0", "t=103.5"]


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda: log_first_n(logging.INFO, "m", key="line"), ValueError),
        (lambda: log_first_n(logging.INFO, "m", key=()), ValueError),
        (lambda: log_first_n(logging.INFO, "m", n=0), ValueError),
        (lambda: log_every_n(logging.INFO, "m", n="2"), TypeError),
        (lambda: log_every_n_seconds(logging.INFO, "m", n=-1), ValueError),
    ],
)
def test_log_helpers_reject_bad_arguments(call, error):
    with pytest.raises(error, match=r"\b(n|key)\b"):
        call()
