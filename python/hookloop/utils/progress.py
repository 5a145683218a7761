"""A live progress line for the terminal: :class:`ProgressBar`, an :class:`EventWriter`.

The line is drawn by tqdm (the optional extra ``hookloop[progress]``). Without tqdm, or when
the output is not a terminal, the writer does nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Any, Callable, List, Optional, Tuple

from hookloop.utils.events import EventWriter, get_event_storage, has_event_storage

__all__ = ["ProgressBar"]

logger = logging.getLogger(__name__)


def _tqdm_class() -> Any:
    """tqdm's bar class without its monitor thread (each redraw here is explicit), or None
    when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None

    class _Bar(tqdm):  # type: ignore[misc,valid-type]
        monitor_interval = 0

    return _Bar


class ProgressBar(EventWriter):
    """Show one live line on a terminal: iteration/max, it/s, ETA, the smoothed
    ``total_loss`` and the ``lr``, redrawn in place.

    Use it like the other writers, e.g. ``PeriodicWriter([CommonMetricPrinter(max_iter),
    ProgressBar(max_iter)], period=1)``: ``write()`` redraws at most once per
    ``refresh_interval`` seconds and returns at once otherwise, so it can be called every
    iteration. Log lines that console handlers write meanwhile (the printer's) appear whole
    above the line: while the bar is shown, the console ``StreamHandler``\\ s of the loggers
    that exist then write through tqdm's ``external_write_mode``. ``close()`` draws the last
    state, ends the line and restores those handlers.

    When ``file`` is not a terminal, or tqdm is not installed, nothing is written.

    Args:
        max_iter (int): the number of iterations of the run, for the ETA; None shows only
            the count and the rate (and the write after training then counts one more).
        window_size (int): ``total_loss`` is the median over this many recent values, as
            :class:`CommonMetricPrinter` smooths it.
        file (file object): where to draw; ``sys.stderr`` by default.
        terminal (bool): whether ``file`` is a terminal; by default ``file.isatty()``.
        refresh_interval (float): the least number of seconds between two redraws.
    """

    def __init__(
        self,
        max_iter: Optional[int] = None,
        window_size: int = 20,
        *,
        file: Optional[IO[str]] = None,
        terminal: Optional[bool] = None,
        refresh_interval: float = 0.1,
    ) -> None:
        if max_iter is not None and (isinstance(max_iter, bool) or not isinstance(max_iter, int)):
            raise TypeError(
                f"ProgressBar max_iter must be an int or None, got {type(max_iter).__name__}"
            )
        if isinstance(window_size, bool) or not isinstance(window_size, int):
            raise TypeError(
                f"ProgressBar window_size must be an int, got {type(window_size).__name__}"
            )
        if window_size <= 0:
            raise ValueError(f"ProgressBar window_size must be positive, got {window_size}")
        if isinstance(refresh_interval, bool) or not isinstance(refresh_interval, (int, float)):
            raise TypeError(
                "ProgressBar refresh_interval must be a number, "
                f"got {type(refresh_interval).__name__}"
            )
        if refresh_interval < 0:
            raise ValueError(f"ProgressBar refresh_interval must be >= 0, got {refresh_interval}")
        if file is not None and not callable(getattr(file, "write", None)):
            raise TypeError(
                f"ProgressBar file must have a write() method, got {type(file).__name__}"
            )
        self._max_iter = max_iter
        self._window_size = window_size
        self._file: IO[str] = file if file is not None else sys.stderr
        self._interval = float(refresh_interval)
        self._clock: Callable[[], float] = time.monotonic
        self._next_draw = float("-inf")
        self._bar: Any = None
        self._patched: List[Tuple[logging.StreamHandler, Any]] = []
        if terminal is None:
            isatty = getattr(self._file, "isatty", None)
            terminal = bool(isatty()) if callable(isatty) else False
        self._tqdm: Any = _tqdm_class() if terminal else None
        # When disabled, write() is this one attribute test.
        self._enabled = self._tqdm is not None

    def write(self) -> None:
        if not self._enabled:
            return
        now = self._clock()
        if now < self._next_draw:
            return
        self._next_draw = now + self._interval
        self._draw(get_event_storage())

    def close(self) -> None:
        if self._bar is None:
            return
        try:
            if has_event_storage():  # the last state, which tqdm's close() then draws
                storage = get_event_storage()
                self._bar.set_postfix_str(self._postfix(storage), refresh=False)
                self._bar.n = max(self._bar.n, self._done(storage))
            self._bar.close()
        finally:
            self._bar = None
            self._unpatch_handlers()

    def _done(self, storage: Any) -> int:
        # write() runs after the step of storage.iter, or after training, when storage.iter
        # is max_iter.
        done = storage.iter + 1
        return done if self._max_iter is None else min(done, self._max_iter)

    def _postfix(self, storage: Any) -> str:
        parts = []
        try:
            loss = storage.history("total_loss").median(self._window_size)
        except KeyError:
            pass
        else:
            parts.append(f"total_loss={loss:.4g}")
        try:
            lr = storage.history("lr").latest()
        except KeyError:
            pass
        else:
            parts.append(f"lr={lr:.5g}")
        return ", ".join(parts)

    def _draw(self, storage: Any) -> None:
        done = self._done(storage)
        postfix = self._postfix(storage)
        if self._bar is None:
            self._bar = self._tqdm(
                total=self._max_iter,
                initial=done,
                file=self._file,
                postfix=postfix or None,
                unit="it",
                dynamic_ncols=True,
                mininterval=0,
                miniters=1,
                smoothing=0.1,
            )
            self._patch_handlers()
            return
        self._bar.set_postfix_str(postfix, refresh=False)
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)  # redraws: miniters=1, mininterval=0
        else:
            self._bar.refresh()

    def _patch_handlers(self) -> None:
        """Routes the console handlers' writes through tqdm, which clears the bar before a
        line and redraws it after. Their level, filters and format stay as they are."""
        consoles = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
        consoles.add(id(self._file))
        loggers: List[Any] = [logging.getLogger()]
        loggers += [
            lg
            for lg in list(logging.Logger.manager.loggerDict.values())
            if isinstance(lg, logging.Logger)
        ]
        for lg in loggers:
            for handler in lg.handlers:
                if (
                    isinstance(handler, logging.StreamHandler)
                    and id(handler.stream) in consoles
                    and not isinstance(handler.stream, _BarSafeStream)
                ):
                    original = handler.stream
                    handler.setStream(_BarSafeStream(original, self._tqdm))
                    self._patched.append((handler, original))

    def _unpatch_handlers(self) -> None:
        for handler, original in self._patched:
            if isinstance(handler.stream, _BarSafeStream) and handler.stream.wrapped is original:
                handler.setStream(original)
        self._patched = []


class _BarSafeStream:
    """A console stream whose writes clear the live bar first and redraw it after. The write
    is flushed inside, so a buffered stdout cannot land after the redrawn bar on stderr."""

    def __init__(self, stream: Any, tqdm_class: Any) -> None:
        self.wrapped = stream
        self._tqdm = tqdm_class

    def write(self, s: str) -> int:
        with self._tqdm.external_write_mode(file=self.wrapped):
            n = self.wrapped.write(s)
            self.wrapped.flush()
        return n

    def flush(self) -> None:
        self.wrapped.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)
