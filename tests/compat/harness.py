"""Runs a usage pattern against one engine and collects everything it can observe.

A pattern is a function ``pattern(E, R)``: ``E`` is a :class:`compat.backends.Engine`, ``R`` a
:class:`Recorder` whose ``out`` is the pattern's own empty folder. It drives ``E`` as the real
code drives detectron2, and records what that code would look at with ``R.rec(...)`` /
``R.storage(storage)``. :func:`observe` runs it and returns an :class:`Observation`:

- the exception it raised (type name and message), or None, and the warnings it raised
  (deprecations left out);
- ``R``'s records, in order;
- the log records of the engine's loggers and of the pattern's own (``logger``, level,
  message), with the engine's logger prefix removed and wall-clock values masked;
- what it printed;
- every file under ``out``: metrics.json lines (parsed; timing keys masked), other text files,
  TensorBoard scalars, images (decoded pixels) and histograms read back with TensorBoard's own
  reader (one list per run folder), and the names of checkpoint files (with the top-level keys
  of each checkpoint and the trainer state's keys).

What hookloop adds on purpose is masked in :data:`ADDITIONS`, the one place that lists it.
Everything else must be equal between engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import pickle
import random
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from compat.backends import Engine, backend

__all__ = [
    "Pattern",
    "PATTERNS",
    "pattern",
    "Recorder",
    "Observation",
    "observe",
    "ADDITIONS",
    "masked_value",
]


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A usage pattern: the function, the repository it comes from (``owner/name``), where in
    it (a path or a description), and which backends it runs on (all by default)."""

    func: Callable[[Engine, "Recorder"], Any]
    repo: str
    source: str

    @property
    def name(self) -> str:
        return self.func.__name__


PATTERNS: List[Pattern] = []


def pattern(repo: str, source: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as a corpus pattern from ``repo`` (``owner/name``)."""

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        if any(p.name == func.__name__ for p in PATTERNS):
            raise ValueError(f"two corpus patterns are named {func.__name__}")
        PATTERNS.append(Pattern(func, repo, source))
        return func

    return register


# --- what hookloop adds on purpose, masked here and nowhere else -----------------------------

#: hookloop's deliberate additions. Each entry names what it masks and why.
ADDITIONS = {
    # IterationTimer logs a per-hook time table after detectron2's two lines.
    "log:time in hooks": re.compile(r"^Time in hooks:\n"),
    # A resume that cannot be exact says so (detectron2 resumes such a loader silently from
    # its start), and a run from iteration 0 that replaces an earlier run's metrics.json says
    # where it kept the earlier file (detectron2 appends to it).
    "log:resume notices": re.compile(
        r"^(The data loader \(\w+\) cannot be resumed|The checkpoint holds no position of the "
        r"data loader|\S+ held \d+ line\(s\) of an earlier run|Removed \d+ line\(s\) of "
        r"iterations >= \d+ from \S+, left by an earlier run)"
    ),
    # A run whose length differs from its checkpoint's says so (detectron2 is silent): a
    # schedule resumed over another max_iter, a train() whose start_iter is past max_iter.
    "log:run length notices": re.compile(
        r"^(LRMultiplier: the checkpoint was saved with max_iter=|train\(\) start_iter \(\d+\) "
        r"is past max_iter)"
    ),
    # A checkpoint's trainer state carries the RNG states, the recent scalar history and the
    # data position, for exact resume, and the state of hooks that detectron2 keeps stateless
    # (BestCheckpointer's best value) where detectron2 does not look; detectron2's holds
    # "iteration" and "hooks".
    "checkpoint:trainer keys": {"rng", "storage", "data", "hookloop_hooks"},
}

# Keys whose values are wall-clock readings (metrics.json, TensorBoard tags, recorded dicts).
_TIME_KEY = re.compile(r"(^|/)(time|data_time|rank_data_time|eta_seconds|last_time)$")

# Wall-clock values inside log messages.
_TIME_IN_TEXT = [
    (
        re.compile(r"\b(eta|time|last_time|data_time|last_data_time|rank_data_time): \S+"),
        r"\1: <t>",
    ),
    (
        re.compile(r"Overall training speed: (\d+) iterations in \S+ \(\S+ s / it\)"),
        r"Overall training speed: \1 iterations in <t> (<t> s / it)",
    ),
    (
        re.compile(r"Total training time: \S+ \(\S+ on hooks\)"),
        "Total training time: <t> (<t> on hooks)",
    ),
]


# Logger names that the README's import-rewrite table maps onto each other, as the engine
# prefixes are: ``fvcore.common.checkpoint`` is ``hookloop.checkpoint``'s (its records are
# the same records under the rewritten module's name); so is ``fvcore.nn.precise_bn``
# ``hookloop.nn.precise_bn``'s.
_LOGGER_RENAMES = {
    "checkpoint.checkpointer": "fvcore.common.checkpoint",
    "nn.precise_bn": "fvcore.nn.precise_bn",
}


def masked_value(key: str, value: Any) -> Any:
    """``value`` with a wall-clock reading replaced by ``'<t>'`` (by its key's name)."""
    if isinstance(key, str) and _TIME_KEY.search(key):
        return "<t>"
    return value


def mask_text(text: str, out_dir: str) -> str:
    text = text.replace(out_dir, "<out>")
    for rx, sub in _TIME_IN_TEXT:
        text = rx.sub(sub, text)
    return text


# --- recording ------------------------------------------------------------------------------


class Recorder:
    """What a pattern records: ``rec(*items)`` appends one entry; ``storage(s)`` appends the
    storage's scalars in key order (latest values, histories, smoothing hints, iteration)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.records: List[Any] = []

    def rec(self, *items: Any) -> None:
        self.records.append(_plain(items, self.out))

    def storage(self, storage: Any, label: str = "storage") -> None:
        latest = [(k, masked_value(k, _num(v)), it) for k, (v, it) in storage.latest().items()]
        histories = [
            (k, [(masked_value(k, _num(v)), it) for v, it in h.values()])
            for k, h in storage.histories().items()
        ]
        self.rec(
            label,
            storage.iter,
            latest,
            histories,
            sorted(storage.smoothing_hints().items()),
        )

    def path(self, *parts: str) -> str:
        """A path under the pattern's folder (its parents are created)."""
        p = os.path.join(self.out, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p


def _num(v: Any) -> Any:
    if isinstance(v, (bool, str)) or v is None:
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return repr(v)
    return "nan" if math.isnan(f) else f


def _plain(x: Any, out: str) -> Any:
    """A comparable copy of ``x``: tensors as lists, floats as floats, paths relative."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.detach().cpu().tolist())
    if isinstance(x, np.ndarray):
        return ("ndarray", x.tolist())
    if isinstance(x, (np.floating, np.integer)):
        return _num(x)
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, str):
        return x.replace(out, "<out>")
    if isinstance(x, dict):
        return [(_plain(k, out), masked_value(k, _plain(v, out))) for k, v in x.items()]
    if isinstance(x, (list, tuple)):
        return [_plain(v, out) for v in x]
    return x


# --- observing ------------------------------------------------------------------------------


@dataclasses.dataclass
class Observation:
    error: Optional[Tuple[str, str]]
    warnings: List[Tuple[str, str]]
    records: List[Any]
    logs: List[Tuple[str, str, str]]
    stdout: List[str]
    files: Dict[str, Any]

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class _Capture(logging.Handler):
    def __init__(self, prefix: str, out: str) -> None:
        super().__init__(logging.DEBUG)
        self.prefix = prefix
        self.out = out
        self.records: List[Tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        name = record.name
        if name.startswith(self.prefix):
            name = name[len(self.prefix) :]
            name = _LOGGER_RENAMES.get(name, name)
        elif not name.startswith("corpus") and not name.startswith("fvcore"):
            return  # another library's logger (torch, tensorboard)
        message = record.getMessage()
        if any(
            ADDITIONS[k].match(message)
            for k in ("log:time in hooks", "log:resume notices", "log:run length notices")
        ):
            return
        self.records.append((name, record.levelname, mask_text(message, self.out)))


def observe(p: Pattern, engine_name: str, out: str) -> Observation:
    """Runs ``p`` against the engine ``engine_name`` in the empty folder ``out``."""
    E = backend(engine_name)
    R = Recorder(out)
    capture = _Capture(E.logger_prefix, out)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    printed = io.StringIO()
    error = None
    # The same seeds for every engine: the tiny models start from the same weights.
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    caught: List[Any] = []
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p.func(E, R)
    except Exception as e:  # what the user's code would see
        error = (type(e).__name__, mask_text(str(e), out))
    finally:
        root.removeHandler(capture)
        root.setLevel(old_level)
    # Warnings are observed too, but for deprecations (torch warns detectron2's older calls).
    seen_warnings = [
        (w.category.__name__, mask_text(str(w.message), out))
        for w in caught
        if not issubclass(w.category, (DeprecationWarning, FutureWarning))
    ]
    return Observation(
        error=error,
        warnings=seen_warnings,
        records=R.records,
        logs=capture.records,
        stdout=[mask_text(line, out) for line in printed.getvalue().splitlines()],
        files=read_outputs(out),
    )


# --- files ----------------------------------------------------------------------------------


def read_outputs(out: str) -> Dict[str, Any]:
    """Everything under ``out``, by path relative to it."""
    files: Dict[str, Any] = {}
    tb_dirs = set()
    for dirpath, _, names in os.walk(out):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, out)
            if name.startswith("events.out.tfevents."):
                tb_dirs.add(dirpath)
            elif name.endswith((".pth", ".pkl", ".pt")):
                files[rel] = _checkpoint_summary(path)
            elif name == "metrics.json" or name.endswith(".jsonl"):
                files[rel] = _json_lines(path)
            else:
                files[rel] = _text(path, out)
    for d in sorted(tb_dirs):
        files[os.path.relpath(d, out) + "/<tensorboard>"] = read_tensorboard(d)
    return files


def _json_lines(path: str) -> List[Any]:
    lines = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                lines.append(("unparsable", line))
                continue
            if isinstance(d, dict):
                lines.append([(k, masked_value(k, _num(v))) for k, v in d.items()])
            else:
                lines.append(d)
    return lines


def _text(path: str, out: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return [mask_text(line, out) for line in f.read().splitlines()]
    except UnicodeDecodeError:
        with open(path, "rb") as f:
            return ("bytes", len(f.read()))


def _checkpoint_summary(path: str) -> Any:
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, pickle.UnpicklingError):
        if not path.endswith(".pkl"):
            raise
        # A model-zoo file pickled by hand (numpy arrays), read as detectron2 reads it.
        with open(path, "rb") as f:
            data = pickle.load(f, encoding="latin1")
    if not isinstance(data, dict):
        return ("object", type(data).__name__)
    summary: List[Any] = [("keys", sorted(data))]
    trainer = data.get("trainer")
    if isinstance(trainer, dict):
        added = ADDITIONS["checkpoint:trainer keys"]
        summary.append(("trainer", sorted(k for k in trainer if k not in added)))
        summary.append(("iteration", trainer.get("iteration")))
        hooks = trainer.get("hooks")
        if isinstance(hooks, dict):
            summary.append(("hooks", sorted(hooks)))
    if "iteration" in data:
        summary.append(("extra iteration", data["iteration"]))
    model = data.get("model")
    if isinstance(model, dict):
        summary.append(
            (
                "model",
                [
                    (k, v.tolist())
                    for k, v in model.items()
                    if isinstance(v, (torch.Tensor, np.ndarray))
                ],
            )
        )
    return summary


def read_tensorboard(log_dir: str) -> Dict[str, Any]:
    """Scalars, images and histograms of every event file in ``log_dir``, as TensorBoard's
    own reader gives them (wall times left out)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(
        log_dir, size_guidance={ea.SCALARS: 0, ea.IMAGES: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0}
    )
    acc.Reload()
    tags = acc.Tags()
    result: Dict[str, Any] = {}
    result["scalars"] = {
        tag: [(e.step, masked_value(tag, _num(e.value))) for e in acc.Scalars(tag)]
        for tag in sorted(tags.get(ea.SCALARS, []))
    }
    result["images"] = {
        tag: [(e.step, e.width, e.height, _pixels(e.encoded_image_string)) for e in acc.Images(tag)]
        for tag in sorted(tags.get(ea.IMAGES, []))
    }
    result["histograms"] = {
        tag: [
            (
                e.step,
                _num(e.histogram_value.min),
                _num(e.histogram_value.max),
                _num(e.histogram_value.num),
                _num(e.histogram_value.sum),
                _num(e.histogram_value.sum_squares),
                [_num(x) for x in e.histogram_value.bucket_limit],
                [_num(x) for x in e.histogram_value.bucket],
            )
            for e in acc.Histograms(tag)
        ]
        for tag in sorted(tags.get(ea.HISTOGRAMS, []))
    }
    result["tensors"] = sorted(tags.get(ea.TENSORS, []))
    return result


def _pixels(png: bytes) -> Any:
    """An image's mode and pixels (the same picture compares equal at any compression; a
    grayscale PNG differs from an RGB one)."""
    from PIL import Image

    img = Image.open(io.BytesIO(png))
    return (img.mode, img.size, np.asarray(img).tolist())
