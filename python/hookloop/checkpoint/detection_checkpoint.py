"""``DetectionCheckpointer``: detectron2's checkpointer of model-zoo files, on hookloop's
:class:`~hookloop.checkpoint.Checkpointer`.

Besides what ``Checkpointer`` loads (``.pth`` files: fvcore's, detectron2's, hookloop's, bare
state dicts), it loads

* ``.pkl`` files of detectron2's model zoo (``{"model": ..., "__author__": ...}``), and of
  Caffe2/Detectron1 (numpy arrays under C2 names such as ``res2_0_branch2a_w``, maybe under
  ``blobs``), whose names are converted and matched to the model's
  (:mod:`hookloop.checkpoint.c2_model_loading`);
* ``.pyth`` files of pycls (``model_state``), matched by name;
* any file with ``?matching_heuristics=True`` after its path, matched by name.

Its log records are detectron2's, from this module's logger and
``hookloop.checkpoint.c2_model_loading`` (detectron2's modules of the same names).

Differences from detectron2:

* a ``.pkl`` is unpickled by a restricted unpickler (detectron2 uses ``pickle.load``, which
  runs whatever code the file holds). It rebuilds only what model-zoo files hold: numpy arrays
  and scalars of bools and numbers (from numpy 1 or 2, any pickle protocol), ``OrderedDict``
  and Python's own str/bytes/numbers/containers. Each array's and scalar's dtype is made
  from its type code, with only the state numpy writes for it, before numpy sees the bytes
  (``hookloop.checkpoint._numpy_safe``, which ``Checkpointer`` uses too), so a crafted dtype
  state cannot make an array of object pointers. Any other global, an array of objects, of
  strings, of datetimes or of a structured dtype is refused: ``load`` raises
  ``ValueError`` naming the file, what it holds and the opt-in, ``weights_only=False`` (as
  for ``Checkpointer``), which unpickles as detectron2 does, for files you trust;
* loading again after a failed ``load`` works, and so does ``_load_file`` called outside
  ``load`` (as a file without a query), where detectron2 asserts; an unsupported query after
  a path is a ``ValueError`` raised before anything is read;
* with a ``DistributedDataParallel`` model, when a worker cannot read the file, the model's
  states are broadcast from rank 0 with ``torch.distributed`` (detectron2 calls DDP's
  ``_sync_params_and_buffers``, which recent torch no longer has).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
from typing import IO, Any, Dict, List, Optional, Tuple
from urllib.parse import ParseResult, parse_qs, urlparse

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hookloop.checkpoint import _numpy_safe
from hookloop.checkpoint.c2_model_loading import align_and_update_state_dicts
from hookloop.checkpoint.checkpointer import Checkpointer, _IncompatibleKeys, _torch_load
from hookloop.utils import comm

__all__ = ["DetectionCheckpointer"]


# ----------------------------------------------------------------------------------------------
# The model-zoo unpickler


def _encode(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode``, as Python 3 pickles bytes in protocols 0 to 2: latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _numpy_safe.refuse_global(f"_codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


# numpy's names (see hookloop.checkpoint._numpy_safe), and what else model-zoo files hold.
_ALLOWED: Dict[str, Any] = {
    **_numpy_safe.GLOBALS,
    "collections.OrderedDict": collections.OrderedDict,
    "_codecs.encode": _numpy_safe.Global("_codecs.encode", _encode),
}


class _ModelZooUnpickler(pickle.Unpickler):
    """Rebuilds only the numpy data and containers of model-zoo files (see the module's
    docstring); any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get(f"{module}.{name}")
        if found is None:
            raise _numpy_safe.refuse_global(f"{module}.{name}")
        return found


def _load_pkl(f: IO[bytes], weights_only: bool) -> Any:
    """Unpickles a ``.pkl`` as detectron2 does (latin-1, for Python 2's pickles): with
    ``weights_only``, by the model-zoo unpickler."""
    if not weights_only:
        return pickle.load(f, encoding="latin1")
    with _numpy_safe.loading():
        return _numpy_safe.plain_data(_ModelZooUnpickler(f, encoding="latin1").load())


# ----------------------------------------------------------------------------------------------


def _matching_heuristics(url: ParseResult) -> Tuple[bool, Dict[str, List[str]]]:
    """Whether the path's query asks for ``matching_heuristics=True``, and the other queries."""
    queries = parse_qs(url.query)
    return queries.pop("matching_heuristics", None) == ["True"], queries


def _weights_only(checkpointer: Checkpointer) -> bool:
    """How :meth:`Checkpointer.load` unpickles this load (its argument, else the
    checkpointer's), as :meth:`Checkpointer._load_file` reads it."""
    during_load = getattr(checkpointer, "_load_weights_only", None)
    if during_load is None:
        return bool(getattr(checkpointer, "weights_only", True))
    return bool(during_load)


def _broadcast_from_main(model: DistributedDataParallel) -> None:
    """Sets every parameter and buffer to rank 0's (as DDP does when it is made)."""
    group = getattr(model, "process_group", None)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for t in list(model.module.parameters()) + list(model.module.buffers()):
        dist.broadcast(t.data, src=src, group=group)


class DetectionCheckpointer(Checkpointer):
    """Same as :class:`Checkpointer`, but is able to:

    1. handle models in detectron & detectron2 model zoo, and apply conversions for legacy
       models.
    2. correctly load checkpoints that are only available on the master worker

    Args:
        model (nn.Module), save_dir (str), checkpointables: as :class:`Checkpointer`'s (also
            its ``async_save`` and ``weights_only``).
        save_to_disk (bool): None (the default): only the main process saves.

    A ``.pkl`` loads with a restricted unpickler unless ``weights_only=False`` (see the
    module's docstring).
    """

    # Class defaults, for subclasses that skip __init__.
    _parsed_url_during_load: Optional[ParseResult] = None
    # The DistributedDataParallel wrapper of the model, if it was given one.
    _ddp_model: Optional[DistributedDataParallel] = None

    def __init__(
        self,
        model: nn.Module,
        save_dir: str = "",
        *,
        save_to_disk: Optional[bool] = None,
        **checkpointables: Any,
    ) -> None:
        is_main_process = comm.is_main_process()
        super().__init__(
            model,
            save_dir,
            save_to_disk=is_main_process if save_to_disk is None else save_to_disk,
            **checkpointables,
        )
        self._ddp_model = model if isinstance(model, DistributedDataParallel) else None
        self._parsed_url_during_load = None

    def load(self, path: str, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """As :meth:`Checkpointer.load`; ``path`` may end with ``?matching_heuristics=True``."""
        logger = logging.getLogger(__name__)
        logger.info("[DetectionCheckpointer] Loading from {} ...".format(path))
        url: Optional[ParseResult] = None
        if path:
            path = os.fsdecode(path)
            url = urlparse(path)
            path = self.path_manager.get_local_path(url._replace(query="").geturl())
            _, other_queries = _matching_heuristics(url)
            if other_queries and not path.endswith((".pkl", ".pyth")):
                # Only the files that Checkpointer loads read the query (as in detectron2).
                raise ValueError(
                    f"Unsupported query remaining: {other_queries}, original filename: "
                    f"{url.geturl()}"
                )

        need_sync = False
        ddp = getattr(self, "_ddp_model", None)
        if path and ddp is not None and comm.get_world_size() > 1:
            has_file = os.path.isfile(path)
            all_has_file = comm.all_gather(has_file)
            if not all_has_file[0]:
                raise FileNotFoundError(f"File {path} not found on main worker.")
            if not all(all_has_file):
                logger.warning(
                    f"Not all workers can read checkpoint {path}. "
                    "Training may fail to fully resume."
                )
                need_sync = True
            if not has_file:
                path, url = "", None  # load nothing here; rank 0's states come below

        previous = getattr(self, "_parsed_url_during_load", None)
        self._parsed_url_during_load = url
        try:
            ret = super().load(path, *args, **kwargs)
        finally:
            self._parsed_url_during_load = previous
        if need_sync and ddp is not None:
            logger.info("Broadcasting model states from main worker ...")
            _broadcast_from_main(ddp)
        return ret

    def _load_file(self, filename: str) -> Dict[str, Any]:
        if filename.endswith(".pkl"):
            with self.path_manager.open(filename, "rb") as f:
                data = _load_pkl(f, _weights_only(self))
            if not isinstance(data, dict):
                raise ValueError(f"{filename} holds a {type(data).__name__}, not a dict")
            if "model" in data and "__author__" in data:
                # file is in Detectron2 model zoo format
                self.logger.info("Reading a file from '{}'".format(data["__author__"]))
                return data
            # assume file is from Caffe2 / Detectron1 model zoo
            if "blobs" in data:
                # Detection models have "blobs", but ImageNet models don't
                data = data["blobs"]
                if not isinstance(data, dict):
                    raise ValueError(f"{filename}: its 'blobs' is a {type(data).__name__}")
            weights = {
                k: v
                for k, v in data.items()
                if not (isinstance(k, str) and k.endswith("_momentum"))
            }
            return {"model": weights, "__author__": "Caffe2", "matching_heuristics": True}
        if filename.endswith(".pyth"):
            # assume file is from pycls; no one else seems to use the ".pyth" extension
            data = _torch_load(filename, _weights_only(self))
            if not isinstance(data, dict) or "model_state" not in data:
                raise ValueError(
                    f"Cannot load .pyth file {filename}; pycls checkpoints must contain "
                    "'model_state'."
                )
            model_state = {
                k: v
                for k, v in data["model_state"].items()
                if not k.endswith("num_batches_tracked")
            }
            return {"model": model_state, "__author__": "pycls", "matching_heuristics": True}

        loaded = self._torch_load(filename)
        if not isinstance(loaded, dict) or "model" not in loaded:
            loaded = {"model": loaded}
        url = getattr(self, "_parsed_url_during_load", None)
        if url is not None and _matching_heuristics(url)[0]:
            loaded["matching_heuristics"] = True
        return loaded

    def _torch_load(self, f: str) -> Any:
        """A file that :class:`Checkpointer` loads (``.pth``), as it loads it."""
        return super()._load_file(f)

    def _load_model(self, checkpoint: Any) -> _IncompatibleKeys:
        if checkpoint.get("matching_heuristics", False):
            self._convert_ndarray_to_tensor(checkpoint["model"])
            # convert weights by name-matching heuristics
            checkpoint["model"] = align_and_update_state_dicts(
                self.model.state_dict(),
                checkpoint["model"],
                c2_conversion=checkpoint.get("__author__", None) == "Caffe2",
            )
        # for non-caffe2 models, use standard ways to load it
        incompatible = super()._load_model(checkpoint)
        if incompatible is None:  # a base of a subclass's that returns None
            return incompatible

        model_buffers = dict(self.model.named_buffers(recurse=False))
        for k in ("pixel_mean", "pixel_std"):
            # Missing from old checkpoints; the model's config sets them anyway.
            if k in model_buffers and k in incompatible.missing_keys:
                incompatible.missing_keys.remove(k)
        # Cell anchors were buffers in old checkpoints; now they are non-persistent.
        incompatible.unexpected_keys[:] = [
            k for k in incompatible.unexpected_keys if "anchor_generator.cell_anchors" not in k
        ]
        return incompatible
