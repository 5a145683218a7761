"""Logging setup and rate-limited logging, mirroring ``detectron2.utils.logger``.

:func:`setup_logger` configures a logger as detectron2's does (colored console on rank 0,
``log.txt`` for every rank); :func:`log_first_n`, :func:`log_every_n` and
:func:`log_every_n_seconds` limit how often a call site logs.

The detectron2 bridge: importing this module makes the ``"hookloop"`` logger a child of the
``"detectron2"`` logger (``logging.getLogger("hookloop").parent``). Records of
``hookloop.engine.*`` and ``hookloop.utils.*`` therefore take the path that detectron2's engine
records took: a ``"detectron2"`` logger configured with ``setup_logger(name="detectron2")``
(detectron2's or this one) prints each of them once through its handlers, and
``logging.getLogger("detectron2").setLevel(logging.WARNING)`` silences them. While the
``"detectron2"`` logger is left alone (no level, no handlers, propagating) it is transparent and
the records reach the root logger as before. A ``"hookloop"`` logger configured on its own
(``setup_logger()`` here, whose default name is ``"hookloop"``) has its own level and handlers
and, not propagating, is then independent of the ``"detectron2"`` one.

Only the standard library is imported here, so ``import hookloop`` can install the bridge.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import time
from collections import Counter
from typing import IO, Any, Dict, Optional, Tuple, Union

__all__ = ["setup_logger", "log_first_n", "log_every_n", "log_every_n_seconds"]

_PLAIN_FORMAT = "[%(asctime)s] %(name)s %(levelname)s: %(message)s"
_DATE_FORMAT = "%m/%d %H:%M:%S"

# termcolor's codes, as detectron2 gets them from termcolor.colored.
_GREEN = "\x1b[32m"
_RED = "\x1b[31m"
_BLINK = "\x1b[5m"
_UNDERLINE = "\x1b[4m"
_RESET = "\x1b[0m"


class _ColorfulFormatter(logging.Formatter):
    """detectron2's console formatter: the root name shortened to ``abbrev_name`` and a red
    ``WARNING``/``ERROR`` prefix. The record itself is left unchanged, so a handler that runs
    after this one (the file) still sees the full logger name."""

    def __init__(self, *args: Any, root_name: str, abbrev_name: str, **kwargs: Any) -> None:
        self._root_name = root_name + "."
        self._abbrev_name = abbrev_name + "." if abbrev_name else ""
        super().__init__(*args, **kwargs)

    def formatMessage(self, record: logging.LogRecord) -> str:
        name = record.name
        record.name = name.replace(self._root_name, self._abbrev_name)
        try:
            log = super().formatMessage(record)
        finally:
            record.name = name
        if record.levelno == logging.WARNING:
            prefix = f"{_BLINK}{_RED}WARNING{_RESET}"
        elif record.levelno >= logging.ERROR:
            prefix = f"{_UNDERLINE}{_BLINK}{_RED}ERROR{_RESET}"
        else:
            return log
        return prefix + " " + log


def setup_logger(
    output: Union[str, os.PathLike[str], None] = None,
    distributed_rank: int = 0,
    *,
    color: bool = True,
    name: str = "hookloop",
    abbrev_name: Optional[str] = None,
    enable_propagation: bool = False,
    configure_stdout: bool = True,
) -> logging.Logger:
    """Initialize the hookloop logger and set its verbosity level to "DEBUG".

    Calling it again with the same arguments returns the same logger without adding handlers.

    Args:
        output (str): a file name or a directory to save log. If None, will not save log
            file. If ends with ".txt" or ".log", assumed to be a file name. Otherwise, logs
            will be saved to ``output/log.txt``.
        distributed_rank (int): ranks other than 0 log only to ``<file>.rank{rank}``.
        color (bool): colored console output (unless the ``NO_COLOR`` environment variable
            is set).
        name (str): the root module name of this logger. ``name="detectron2"`` also shows
            hookloop's records (see the module docstring).
        abbrev_name (str): an abbreviation of the module, to avoid long names in logs.
            Set to "" to not log the root module in logs.
            By default, will abbreviate "detectron2" to "d2" and leave other
            modules unchanged.
        enable_propagation (bool): whether to propagate logs to the parent logger.
        configure_stdout (bool): whether to configure logging to stdout.

    Returns:
        logging.Logger: a logger
    """
    if output is not None:
        if not isinstance(output, (str, os.PathLike)):
            raise TypeError(
                f"setup_logger() output must be a str, os.PathLike or None, "
                f"got {type(output).__name__}"
            )
        output = os.fspath(output)
    if isinstance(distributed_rank, bool) or not isinstance(distributed_rank, int):
        raise TypeError(
            f"setup_logger() distributed_rank must be an int, got {type(distributed_rank).__name__}"
        )
    if distributed_rank < 0:
        raise ValueError(f"setup_logger() distributed_rank must be >= 0, got {distributed_rank}")
    if not isinstance(name, str):
        raise TypeError(f"setup_logger() name must be a str, got {type(name).__name__}")
    if abbrev_name is not None and not isinstance(abbrev_name, str):
        raise TypeError(
            f"setup_logger() abbrev_name must be a str or None, got {type(abbrev_name).__name__}"
        )
    return _setup_logger(
        output,
        distributed_rank,
        bool(color),
        name,
        abbrev_name,
        bool(enable_propagation),
        bool(configure_stdout),
    )


@functools.lru_cache  # so that calling setup_logger multiple times won't add many handlers
def _setup_logger(
    output: Optional[str],
    distributed_rank: int,
    color: bool,
    name: str,
    abbrev_name: Optional[str],
    enable_propagation: bool,
    configure_stdout: bool,
) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.propagate = enable_propagation

    if abbrev_name is None:
        abbrev_name = "d2" if name == "detectron2" else name

    plain_formatter = logging.Formatter(_PLAIN_FORMAT, datefmt=_DATE_FORMAT)
    # stdout logging: master only
    if configure_stdout and distributed_rank == 0:
        ch = logging.StreamHandler(stream=sys.stdout)
        ch.setLevel(logging.DEBUG)
        formatter: logging.Formatter
        if color and not os.environ.get("NO_COLOR"):
            formatter = _ColorfulFormatter(
                f"{_GREEN}[%(asctime)s %(name)s]: {_RESET}%(message)s",
                datefmt=_DATE_FORMAT,
                root_name=name,
                abbrev_name=abbrev_name,
            )
        else:
            formatter = plain_formatter
        ch.setFormatter(formatter)
        logger.addHandler(ch)

    # file logging: all workers
    if output is not None:
        if output.endswith(".txt") or output.endswith(".log"):
            filename = output
        else:
            filename = os.path.join(output, "log.txt")
        if distributed_rank > 0:
            filename = filename + ".rank{}".format(distributed_rank)
        dirname = os.path.dirname(filename)
        if dirname:
            os.makedirs(dirname, exist_ok=True)

        fh = logging.StreamHandler(_cached_log_stream(filename))
        fh.setLevel(logging.DEBUG)
        fh.setFormatter(plain_formatter)
        logger.addHandler(fh)

    return logger


# Cache the opened file object, so that different calls to `setup_logger` with the same file
# name can safely write to the same file.
@functools.cache
def _cached_log_stream(filename: str) -> IO[str]:
    try:
        stream = open(filename, "a")  # closed at exit
    except OSError as e:
        raise OSError(e.errno, f"setup_logger() cannot open the log file {filename!r}") from e
    atexit.register(stream.close)
    return stream


# Below are some other convenient logging methods, after abseil-py's absl.logging.


def _find_caller() -> Tuple[str, Tuple[str, int, str]]:
    """The module name and (file, line, function) of the first frame outside this file."""
    frame: Optional[Any] = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename != __file__:
            mod_name = frame.f_globals.get("__name__", "hookloop")
            if mod_name == "__main__":
                mod_name = "hookloop"
            return mod_name, (code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return "hookloop", ("", 0, "")


_LOG_COUNTER: Counter = Counter()
_LOG_TIMER: Dict[Tuple[str, int, str], float] = {}


def _check_n(func: str, n: Any, *, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(n, bool) or not isinstance(n, kinds):
        what = "an int" if integer else "a number"
        raise TypeError(f"{func}() n must be {what}, got {type(n).__name__}")
    if integer and n < 1:
        raise ValueError(f"{func}() n must be >= 1, got {n}")
    if not integer and n < 0:
        raise ValueError(f"{func}() n must be >= 0, got {n}")


def log_first_n(
    lvl: int, msg: str, n: int = 1, *, name: Optional[str] = None, key: Any = "caller"
) -> None:
    """Log only for the first n times.

    Args:
        lvl (int): the logging level
        msg (str):
        n (int):
        name (str): name of the logger to use. Will use the caller's module by default.
        key (str or tuple[str]): the string(s) can be one of "caller" or
            "message", which defines how to identify duplicated logs.
            For example, if called with `n=1, key="caller"`, this function
            will only log the first call from the same caller, regardless of
            the message content.
            If called with `n=1, key="message"`, this function will log the
            same content only once, even if they are called from different places.
            If called with `n=1, key=("caller", "message")`, this function
            will not log only if the same caller has logged the same message before.
    """
    _check_n("log_first_n", n, integer=True)
    if isinstance(key, str):
        key = (key,)
    if not isinstance(key, tuple) or not key or any(k not in ("caller", "message") for k in key):
        raise ValueError(
            f"log_first_n() key must be 'caller', 'message' or a tuple of them, got {key!r}"
        )

    caller_module, caller_key = _find_caller()
    hash_key: Tuple[Any, ...] = ()
    if "caller" in key:
        hash_key = hash_key + caller_key
    if "message" in key:
        hash_key = hash_key + (msg,)

    _LOG_COUNTER[hash_key] += 1
    if _LOG_COUNTER[hash_key] <= n:
        logging.getLogger(name or caller_module).log(lvl, msg)


def log_every_n(lvl: int, msg: str, n: int = 1, *, name: Optional[str] = None) -> None:
    """Log once per n times.

    Args:
        lvl (int): the logging level
        msg (str):
        n (int):
        name (str): name of the logger to use. Will use the caller's module by default.
    """
    _check_n("log_every_n", n, integer=True)
    caller_module, key = _find_caller()
    _LOG_COUNTER[key] += 1
    if n == 1 or _LOG_COUNTER[key] % n == 1:
        logging.getLogger(name or caller_module).log(lvl, msg)


def log_every_n_seconds(lvl: int, msg: str, n: float = 1, *, name: Optional[str] = None) -> None:
    """Log no more than once per n seconds.

    Args:
        lvl (int): the logging level
        msg (str):
        n (int):
        name (str): name of the logger to use. Will use the caller's module by default.
    """
    _check_n("log_every_n_seconds", n, integer=False)
    caller_module, key = _find_caller()
    last_logged = _LOG_TIMER.get(key, None)
    current_time = time.time()
    if last_logged is None or current_time - last_logged >= n:
        logging.getLogger(name or caller_module).log(lvl, msg)
        _LOG_TIMER[key] = current_time


def _link_to_detectron2() -> None:
    """Makes ``"hookloop"`` a child of ``"detectron2"`` in the logger tree (see the module
    docstring). Idempotent."""
    hookloop_logger = logging.getLogger("hookloop")
    detectron2_logger = logging.getLogger("detectron2")
    if hookloop_logger.parent is not detectron2_logger:
        hookloop_logger.parent = detectron2_logger
        # Loggers cache isEnabledFor per level; any setLevel clears every cache.
        hookloop_logger.setLevel(hookloop_logger.level)


_link_to_detectron2()
