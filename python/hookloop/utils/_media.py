"""Images and histograms as the writers hand them on: the TensorBoard writer's image points,
and the trackers' queued items, which become MLflow image artifacts and JSON histograms, and
W&B ``Image``s and ``Histogram``s.

A tracker queues each in a row's values beside the scalars, as plain data under a key that
is a tuple (a scalar's key is its name, so an image, a histogram and a scalar may share a
name), so that a checkpoint holding what was not sent yet loads without unpickling a class of
ours (``torch.load(weights_only=True)``):

- an image: ``("image", name): (height, width, channels, HWC uint8 bytes)``;
- a histogram: ``("histogram", name): {min, max, num, sum, sum_squares, bucket_limits,
  bucket_counts}``, detectron2's ``add_histogram_raw`` fields (``bucket_limits`` are the
  buckets' right edges; the first bucket starts at ``min``).
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hookloop import _core

__all__ = ["image_point", "take_media"]

_HISTOGRAM_FIELDS = ("min", "max", "num", "sum", "sum_squares", "bucket_limits", "bucket_counts")


def image_point(
    tag: str, img: Any, step: int, dataformats: str = "CHW"
) -> Tuple[str, int, int, int, int, bytes]:
    """An image as (tag, step, height, width, channels, HWC uint8 bytes), converted the way
    torch's SummaryWriter converts: uint8 as is, anything else (bfloat16 and float16 read as
    float32) scaled by 255 and clipped."""
    import numpy as np

    if hasattr(img, "detach"):
        img = img.detach()
        if str(img.dtype) in ("torch.bfloat16", "torch.float16"):
            img = img.float()
        img = img.cpu().numpy()
    arr = np.asarray(img)
    if dataformats == "HW" and arr.ndim == 2:
        arr = arr[None]
    elif dataformats == "HWC" and arr.ndim == 3:
        arr = arr.transpose(2, 0, 1)
    elif dataformats != "CHW":
        raise ValueError(
            f"image '{tag}': dataformats must be 'CHW', 'HWC' or 'HW', got {dataformats!r}"
        )
    _core.check_chw(tag, arr.shape)  # the core's one image rule
    if arr.dtype != np.uint8:
        arr = (arr.astype(np.float32) * 255.0).clip(0, 255).astype(np.uint8)
    c, h, w = arr.shape
    hwc = np.ascontiguousarray(arr.transpose(1, 2, 0))
    return (tag, int(step), int(h), int(w), int(c), hwc.tobytes())


def take_media(
    storage: Any, reader: Optional[int]
) -> Tuple[Dict[int, Dict[Tuple[str, str], Any]], List[str]]:
    """The images and histograms ``reader`` has not taken yet, as queued items by iteration
    (``{iteration: {(kind, name): item}}``), and a message for each image that could not be
    converted (it is skipped)."""
    out: Dict[int, Dict[Tuple[str, str], Any]] = {}
    failed: List[str] = []
    for name, img, step in storage._take_images(reader):
        try:
            _, _, h, w, c, data = image_point(name, img, step)
        except Exception as e:
            failed.append(f"image '{name}' at iter {step}: {type(e).__name__}: {e}")
            continue
        out.setdefault(int(step), {})[("image", name)] = (h, w, c, data)
    for hist in storage._take_histograms(reader):
        fields = {k: hist[k] for k in _HISTOGRAM_FIELDS}
        out.setdefault(int(hist["global_step"]), {})[("histogram", hist["tag"])] = fields
    return out, failed


def image_array(item: Tuple[Any, ...]) -> Any:
    """A queued image as a numpy array that both trackers take: ``(H, W)`` uint8 for one
    channel, ``(H, W, 3)`` and ``(H, W, 4)`` as they are, and two channels (grey and alpha, as
    TensorBoard's PNG shows them) as ``(H, W, 4)`` RGBA with the grey in R, G and B."""
    import numpy as np

    h, w, c, data = item
    arr = np.frombuffer(data, dtype=np.uint8).reshape(h, w, c)
    if c == 1:
        return arr[:, :, 0]
    if c == 2:
        return arr[:, :, [0, 0, 0, 1]]
    return arr


def media_bytes(key: Any, item: Any) -> int:
    """What a queued item holds, in bytes: an image's pixels, a histogram's buckets (8 bytes
    a number); 0 for a scalar (its key is a str)."""
    if not isinstance(key, tuple):
        return 0
    if key[0] == "image":
        return len(item[3])
    return 8 * (len(item["bucket_limits"]) + len(item["bucket_counts"]) + 5)


def histogram_edges(fields: Dict[str, Any]) -> Tuple[List[float], List[float]]:
    """A queued histogram as ``(counts, edges)``, numpy's ``np.histogram`` layout (one more
    edge than counts)."""
    return list(fields["bucket_counts"]), [float(fields["min"]), *fields["bucket_limits"]]


def rebinned(
    counts: Sequence[float], edges: Sequence[float], max_bins: int
) -> Tuple[List[float], List[float]]:
    """At most ``max_bins`` buckets: each run of ``k`` neighbours (the fewest that fit) merged
    into one, its count their sum, its edges the run's outer ones. W&B keeps at most 512
    buckets; detectron2's ``put_histogram`` makes 1000."""
    n = len(counts)
    if n <= max_bins:
        return list(counts), list(edges)
    k = math.ceil(n / max_bins)
    merged = [float(sum(counts[i : i + k])) for i in range(0, n, k)]
    return merged, [float(edges[min(i, n)]) for i in range(0, n + k, k)][: len(merged) + 1]


_KEY_CHARS = re.compile(r"[^a-zA-Z0-9_\-./ ]")
_NAME_CHARS = re.compile(r"[^\w\-./: ]")


def valid_name(name: str, bad: "re.Pattern[str]", limit: int) -> str:
    """``name`` with the characters ``bad`` matches as ``_``, as a relative path whose parts
    are neither empty nor ``.`` or ``..`` (``a//b`` becomes ``a/b``, ``/x`` becomes ``x``,
    ``../x`` becomes ``__/x``), at most ``limit`` characters (a longer one keeps its start
    and ends with ``-`` and the 8 hex digits of the whole name's CRC32, so that two long names
    stay apart)."""
    out = bad.sub("_", name)
    parts = ["_" * len(p) if p in (".", "..") else p for p in out.split("/") if p]
    out = "/".join(parts) or "_"
    if len(out) > limit:
        out = f"{out[: limit - 9]}-{zlib.crc32(name.encode('utf-8', 'replace')):08x}"
    return out


def safe_key(name: str) -> str:
    """A name as MLflow takes it in an image key and an artifact path: characters other than
    ASCII letters, digits, ``_ - . /`` and space become ``_``, the path rule of
    :func:`valid_name`, at most 100 characters (the key is part of a file's name)."""
    return valid_name(name, _KEY_CHARS, 100)


def mlflow_name(name: str) -> str:
    """A scalar's or a param's name as MLflow takes it (its client's rule): characters other
    than letters, digits, ``_ - . : /`` and space become ``_``, the path rule of
    :func:`valid_name`, at most 250 characters."""
    return valid_name(name, _NAME_CHARS, 250)
