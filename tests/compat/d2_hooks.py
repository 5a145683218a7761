"""The reference engine's checkpointing hook: fvcore's own ``PeriodicCheckpointer`` (the real
upstream, a test dependency) as a ``compat.d2`` hook, as ``detectron2.engine.hooks`` defines
it, and a small model of detectron2's ``DetectionCheckpointer`` on fvcore's ``Checkpointer``.
They live here rather than in ``compat.d2`` because the package does not depend on fvcore.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import pickle
import re
from urllib.parse import parse_qs, urlparse

import torch
from fvcore.common import checkpoint as fv_checkpoint
from fvcore.common.checkpoint import Checkpointer
from fvcore.common.checkpoint import PeriodicCheckpointer as FvPeriodicCheckpointer
from fvcore.nn import precise_bn as fv_precise_bn
from fvcore.nn.precise_bn import get_bn_modules, update_bn_stats

from compat import d2

__all__ = [
    "Checkpointer",
    "FvPeriodicCheckpointer",
    "PeriodicCheckpointer",
    "BestCheckpointer",
    "PreciseBN",
    "fv_precise_bn",
    "fv_checkpoint",
    "DetectionCheckpointer",
]


class PeriodicCheckpointer(FvPeriodicCheckpointer, d2.HookBase):
    """fvcore's periodic saver as a hook: every ``period`` iterations and at the last one."""

    def before_train(self) -> None:
        self.max_iter = self.trainer.max_iter

    def after_step(self) -> None:
        self.step(self.trainer.iter)


class BestCheckpointer(d2.HookBase):
    """detectron2's best-metric saver: at EvalHook's iterations, saves ``file_prefix`` when
    the latest ``val_metric`` beats the best so far (``mode`` "max" or "min")."""

    def __init__(self, eval_period, checkpointer, val_metric, mode="max", file_prefix="model_best"):
        self._logger = d2.hooks_logger
        self._period = eval_period
        self._val_metric = val_metric
        assert mode in ["max", "min"], (
            f'Mode "{mode}" to `BestCheckpointer` is unknown. It should be one of {"max", "min"}.'
        )
        self._compare = operator.gt if mode == "max" else operator.lt
        self._checkpointer = checkpointer
        self._file_prefix = file_prefix
        self.best_metric = None
        self.best_iter = None

    def _update_best(self, val, iteration):
        if math.isnan(val) or math.isinf(val):
            return False
        self.best_metric = val
        self.best_iter = iteration
        return True

    def _best_checking(self):
        metric_tuple = self.trainer.storage.latest().get(self._val_metric)
        if metric_tuple is None:
            self._logger.warning(
                f"Given val metric {self._val_metric} does not seem to be computed/stored."
                "Will not be checkpointing based on it."
            )
            return
        latest_metric, metric_iter = metric_tuple
        if self.best_metric is None:
            if self._update_best(latest_metric, metric_iter):
                self._checkpointer.save(f"{self._file_prefix}", iteration=metric_iter)
                self._logger.info(
                    f"Saved first model at {self.best_metric:0.5f} @ {self.best_iter} steps"
                )
        elif self._compare(latest_metric, self.best_metric):
            self._checkpointer.save(f"{self._file_prefix}", iteration=metric_iter)
            self._logger.info(
                f"Saved best model as latest eval score for {self._val_metric} is "
                f"{latest_metric:0.5f}, better than last best score "
                f"{self.best_metric:0.5f} @ iteration {self.best_iter}."
            )
            self._update_best(latest_metric, metric_iter)
        else:
            self._logger.info(
                f"Not saving as latest eval score for {self._val_metric} is {latest_metric:0.5f}, "
                f"not better than best score {self.best_metric:0.5f} @ iteration {self.best_iter}."
            )

    def after_step(self):
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0:
            if next_iter != self.trainer.max_iter:
                self._best_checking()

    def after_train(self):
        if self.trainer.iter + 1 >= self.trainer.max_iter:
            self._best_checking()


class PreciseBN(d2.HookBase):
    """detectron2's PreciseBN: fvcore's ``update_bn_stats`` every ``period`` iterations and
    after the last one, over one iterator of ``data_loader`` that later runs continue."""

    def __init__(self, period, model, data_loader, num_iter):
        self._logger = d2.hooks_logger
        if len(get_bn_modules(model)) == 0:
            self._logger.info(
                "PreciseBN is disabled because model does not contain BN layers in training mode."
            )
            self._disabled = True
            return
        self._model = model
        self._data_loader = data_loader
        self._num_iter = num_iter
        self._period = period
        self._disabled = False
        self._data_iter = None

    def after_step(self):
        next_iter = self.trainer.iter + 1
        is_final = next_iter == self.trainer.max_iter
        if is_final or (self._period > 0 and next_iter % self._period == 0):
            self.update_stats()

    def update_stats(self):
        if self._disabled:
            return
        if self._data_iter is None:
            self._data_iter = iter(self._data_loader)

        def data_loader():
            for num_iter in itertools.count(1):
                if num_iter % 100 == 0:
                    self._logger.info(
                        "Running precise-BN ... {}/{} iterations.".format(num_iter, self._num_iter)
                    )
                yield next(self._data_iter)  # a spent iterator: RuntimeError (PEP 479)

        with d2.EventStorage():  # the model's events go to a storage that is dropped
            self._logger.info(
                "Running precise-BN for {} iterations...  ".format(self._num_iter)
                + "Note that this could produce different statistics every time."
            )
            update_bn_stats(self._model, data_loader(), self._num_iter)


# --- detectron2.checkpoint ------------------------------------------------------------------

_detection_logger = logging.getLogger("compat.d2.checkpoint.detection_checkpoint")
_c2_logger = logging.getLogger("compat.d2.checkpoint.c2_model_loading")


class DetectionCheckpointer(Checkpointer):
    """detectron2's checkpointer: reads model-zoo ``.pkl`` files (detectron2's, with
    ``__author__``, as they are; Caffe2's, with ``blobs``, renamed and matched by suffix), a
    ``?matching_heuristics=True`` query on other files, and drops the missing
    ``pixel_mean``/``pixel_std`` and unexpected ``cell_anchors`` keys from what it reports."""

    def __init__(self, model, save_dir="", *, save_to_disk=None, **checkpointables):
        main = d2.comm.is_main_process()
        super().__init__(
            model,
            save_dir,
            save_to_disk=main if save_to_disk is None else save_to_disk,
            **checkpointables,
        )
        self._parsed_url_during_load = None

    def load(self, path, *args, **kwargs):
        assert self._parsed_url_during_load is None
        _detection_logger.info("[DetectionCheckpointer] Loading from {} ...".format(path))
        if path:
            parsed_url = urlparse(path)
            self._parsed_url_during_load = parsed_url
            path = self.path_manager.get_local_path(parsed_url._replace(query="").geturl())
        ret = super().load(path, *args, **kwargs)
        self._parsed_url_during_load = None  # not reset when the load raises, as upstream
        return ret

    def _load_file(self, filename):
        if filename.endswith(".pkl"):
            with self.path_manager.open(filename, "rb") as f:
                data = pickle.load(f, encoding="latin1")
            if "model" in data and "__author__" in data:
                self.logger.info("Reading a file from '{}'".format(data["__author__"]))
                return data
            data = data.get("blobs", data)
            data = {k: v for k, v in data.items() if not k.endswith("_momentum")}
            return {"model": data, "__author__": "Caffe2", "matching_heuristics": True}
        loaded = self._torch_load(filename)
        if "model" not in loaded:
            loaded = {"model": loaded}
        assert self._parsed_url_during_load is not None, "`_load_file` must be called inside `load`"
        parsed_url = self._parsed_url_during_load
        queries = parse_qs(parsed_url.query)
        if queries.pop("matching_heuristics", "False") == ["True"]:
            loaded["matching_heuristics"] = True
        if len(queries) > 0:
            raise ValueError(
                f"Unsupported query remaining: f{queries}, orginal filename: {parsed_url.geturl()}"
            )
        return loaded

    def _torch_load(self, f):
        return super()._load_file(f)

    def _load_model(self, checkpoint):
        if checkpoint.get("matching_heuristics", False):
            self._convert_ndarray_to_tensor(checkpoint["model"])
            checkpoint["model"] = align_and_update_state_dicts(
                self.model.state_dict(),
                checkpoint["model"],
                c2_conversion=checkpoint.get("__author__", None) == "Caffe2",
            )
        incompatible = super()._load_model(checkpoint)
        buffers = dict(self.model.named_buffers(recurse=False))
        for k in ["pixel_mean", "pixel_std"]:
            if k in buffers and k in incompatible.missing_keys:
                incompatible.missing_keys.remove(k)
        for k in incompatible.unexpected_keys[:]:
            if "anchor_generator.cell_anchors" in k:
                incompatible.unexpected_keys.remove(k)
        return incompatible


# Caffe2 blob names -> detectron2 names, in order (detectron2's convert_basic_c2_names and
# the box-head part of convert_c2_detectron_names; no RPN, FPN, mask or keypoint heads).
_C2_RENAMES = [
    (r"^pred_b$", "linear_b"),
    (r"^pred_w$", "linear_w"),
    (r"_", "."),
    (r"\.b$", ".bias"),
    (r"\.w$", ".weight"),
    (r"bn\.s$", "norm.weight"),
    (r"bn\.bias$", "norm.bias"),
    (r"bn\.rm", "norm.running_mean"),
    (r"bn\.riv$", "norm.running_var"),
    (r"^res\.conv1\.norm\.", "conv1.norm."),
    (r"^conv1\.", "stem.conv1."),
    (r"\.branch1\.", ".shortcut."),
    (r"\.branch2a\.", ".conv1."),
    (r"\.branch2b\.", ".conv2."),
    (r"\.branch2c\.", ".conv3."),
    (r"^bbox\.pred", "bbox_pred"),
    (r"^cls\.score", "cls_score"),
    (r"^fc6\.", "box_head.fc1."),
    (r"^fc7\.", "box_head.fc2."),
]


def _convert_c2_names(weights):
    _c2_logger.info("Renaming Caffe2 weights ......")
    new_weights, original = {}, {}
    for orig in sorted(weights):
        name = orig
        for pattern, repl in _C2_RENAMES:
            name = re.sub(pattern, repl, name)
        original[name] = orig
        w = weights[orig]
        if name.startswith("bbox_pred."):
            new_weights[name] = w[4:]  # the background class's box deltas
            _c2_logger.info(
                "Remove prediction weight for background class in {}. The shape changes from "
                "{} to {}.".format(name, tuple(w.shape), tuple(new_weights[name].shape))
            )
        elif name.startswith("cls_score."):
            _c2_logger.info(
                "Move classification weights for background class in {} from index 0 to "
                "index {}.".format(name, w.shape[0] - 1)
            )
            new_weights[name] = torch.cat([w[1:], w[:1]])
        else:
            new_weights[name] = w
    return new_weights, original


def _common_prefix(names):
    split = [n.split(".") for n in names]
    common = [a for a, b in zip(min(split), max(split)) if a == b]
    return ".".join(common) + "." if common else ""


def _common_prefix_str(names):
    lo, hi = min(names), max(names)
    n = 0
    while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


def align_and_update_state_dicts(model_state_dict, ckpt_state_dict, c2_conversion=True):
    """detectron2's suffix matching: each model key takes the longest checkpoint key that is
    a whole-name suffix of it; unmatched checkpoint keys are kept as they are."""
    model_keys = sorted(model_state_dict)
    if c2_conversion:
        ckpt_state_dict, original = _convert_c2_names(ckpt_state_dict)
    else:
        original = {k: k for k in ckpt_state_dict}
    ckpt_keys = sorted(ckpt_state_dict)
    matched, result = {}, {}
    for key_model in model_keys:
        sizes = [len(k) if key_model == k or key_model.endswith("." + k) else 0 for k in ckpt_keys]
        if not sizes or max(sizes) == 0:
            continue
        key_ckpt = ckpt_keys[sizes.index(max(sizes))]
        value = ckpt_state_dict[key_ckpt]
        shape = model_state_dict[key_model].shape
        if shape != value.shape:
            _c2_logger.warning(
                "Shape of {} in checkpoint is {}, while shape of {} in model is {}.".format(
                    key_ckpt, value.shape, key_model, shape
                )
            )
            _c2_logger.warning(
                "{} will not be loaded. Please double check and see if this is desired.".format(
                    key_ckpt
                )
            )
            continue
        result[key_model] = value
        if key_ckpt in matched:
            _c2_logger.error(
                "Ambiguity found for {} in checkpoint!"
                "It matches at least two keys in the model ({} and {}).".format(
                    key_ckpt, key_model, matched[key_ckpt]
                )
            )
            raise ValueError("Cannot match one checkpoint key to multiple keys in the model.")
        matched[key_ckpt] = key_model
    matched_model_keys = sorted(matched.values())
    if not matched_model_keys:
        _c2_logger.warning("No weights in checkpoint matched with model.")
        return ckpt_state_dict
    prefix = _common_prefix(matched_model_keys)
    by_model = {v: original[k] for k, v in matched.items()}
    # Rows of the table detectron2 builds (its contents are not logged, only their number):
    # the keys of one submodule whose checkpoint names share a prefix make one row.
    groups = {}
    for sub in sorted({k[: k.rfind(".") + 1] for k in matched_model_keys if "." in k}, key=len):
        group = [k for k in matched_model_keys if k.startswith(sub)]
        if len(group) > 1 and _common_prefix_str([by_model[k] for k in group]):
            for k in group:
                groups.setdefault(k, group)
    rows, seen = 0, set()
    for k in matched_model_keys:
        if k not in seen:
            seen |= set(groups.get(k, [k]))
            rows += 1
    _c2_logger.info(
        f"Following weights matched with submodule {prefix[:-1] if prefix else 'model'} - "
        f"Total num: {rows}"
    )
    for k in ckpt_keys:
        if k not in matched:
            result[k] = ckpt_state_dict[k]
    return result
