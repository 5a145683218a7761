"""Name matching for pre-trained weights, mirroring ``detectron2.checkpoint.c2_model_loading``.

:func:`align_and_update_state_dicts` renames a checkpoint's keys to a model's: Caffe2 /
Detectron1 blob names (``res2_0_branch2a_w``) to detectron2's module names
(``res2.0.conv1.weight``), then each model key takes the longest checkpoint key that is a
whole-component suffix of it, so weights of a backbone load into a model that nests it
(``backbone.bottom_up.res2.0.conv1.weight``). The renaming rules, the matching, and the log
records (their text, levels and this module's logger) are detectron2's.

Differences from detectron2, in what it leaves undefined: two C2 names that rename to one key
raise ``ValueError`` naming them (detectron2 asserts), and a checkpoint with no keys matches
nothing (detectron2's matching matrix fails on it).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

__all__ = ["align_and_update_state_dicts", "convert_basic_c2_names", "convert_c2_detectron_names"]

_Rule = Callable[[str], str]


def _sub(pattern: str, repl: str) -> _Rule:
    """A regular-expression rule (``re.sub``: every match)."""
    compiled = re.compile(pattern)
    return lambda key: compiled.sub(repl, key)


def _text(old: str, new: str) -> _Rule:
    """A plain-text rule (``str.replace``: every occurrence)."""
    return lambda key: key.replace(old, new)


# Each rule rewrites every key before the next applies; a rule reads one key, so applying the
# whole sequence key by key is the same. The order is detectron2's and matters: "_" becomes "."
# before anything else, and "bn.s" must become "norm.weight" before the stem rules look for it.
_BASIC_RULES: Tuple[_Rule, ...] = (
    lambda key: {"pred_b": "linear_b", "pred_w": "linear_w"}.get(key, key),
    _text("_", "."),
    _sub(r"\.b$", ".bias"),
    _sub(r"\.w$", ".weight"),
    # BatchNorm and GroupNorm are both "norm".
    _sub(r"bn\.s$", "norm.weight"),
    _sub(r"bn\.bias$", "norm.bias"),
    _sub(r"bn\.rm", "norm.running_mean"),
    _sub(r"bn\.running.mean$", "norm.running_mean"),
    _sub(r"bn\.riv$", "norm.running_var"),
    _sub(r"bn\.running.var$", "norm.running_var"),
    _sub(r"bn\.gamma$", "norm.weight"),
    _sub(r"bn\.beta$", "norm.bias"),
    _sub(r"gn\.s$", "norm.weight"),
    _sub(r"gn\.bias$", "norm.bias"),
    # The stem; "conv1" alone would also match heads' convs, hence the anchored prefix.
    _sub(r"^res\.conv1\.norm\.", "conv1.norm."),
    _sub(r"^conv1\.", "stem.conv1."),
    # Residual blocks (res2..res5 keep C2's stage names).
    _text(".branch1.", ".shortcut."),
    _text(".branch2a.", ".conv1."),
    _text(".branch2b.", ".conv2."),
    _text(".branch2c.", ".conv3."),
    # DensePose.
    _sub(r"^body.conv.fcn", "body_conv_fcn"),
    _text("AnnIndex.lowres", "ann_index_lowres"),
    _text("Index.UV.lowres", "index_uv_lowres"),
    _text("U.lowres", "u_lowres"),
    _text("V.lowres", "v_lowres"),
)


def _fpn_name(key: str) -> str:
    """FPN's lateral (``fpn.inner.res2.2.sum.lateral.weight``) and output
    (``fpn.res2.2.sum.weight``) convolutions: ``fpn_lateral2.weight``, ``fpn_output2.weight``."""
    parts = key.split(".")
    norm = ".norm" if "norm" in parts else ""
    if key.startswith("fpn.inner."):
        return "fpn_lateral{}{}.{}".format(int(parts[2][len("res") :]), norm, parts[-1])
    if key.startswith("fpn.res"):
        return "fpn_output{}{}.{}".format(int(parts[1][len("res") :]), norm, parts[-1])
    return key


_DETECTRON_RULES: Tuple[_Rule, ...] = (
    # RPN's hidden conv and outputs; C2 defines them at FPN level 2 and shares them ("fpn2").
    _text("conv.rpn.fpn2", "proposal_generator.rpn_head.conv"),
    _text("conv.rpn", "proposal_generator.rpn_head.conv"),
    _text("rpn.bbox.pred.fpn2", "proposal_generator.rpn_head.anchor_deltas"),
    _text("rpn.cls.logits.fpn2", "proposal_generator.rpn_head.objectness_logits"),
    _text("rpn.bbox.pred", "proposal_generator.rpn_head.anchor_deltas"),
    _text("rpn.cls.logits", "proposal_generator.rpn_head.objectness_logits"),
    # Fast R-CNN box head (4conv1fc heads name their convs head_conv1_w, head_conv1_gn_s).
    _sub(r"^bbox\.pred", "bbox_pred"),
    _sub(r"^cls\.score", "cls_score"),
    _sub(r"^fc6\.", "box_head.fc1."),
    _sub(r"^fc7\.", "box_head.fc2."),
    _sub(r"^head\.conv", "box_head.conv"),
    _fpn_name,
    # Mask head: StandardROIHeads, then Res5ROIHeads.
    _text(".[mask].fcn", "mask_head.mask_fcn"),
    _sub(r"^\.mask\.fcn", "mask_head.mask_fcn"),
    _text("mask.fcn.logits", "mask_head.predictor"),
    _text("conv5.mask", "mask_head.deconv"),
    # Keypoint head: its convs' blobs are plain "conv_fcnX".
    _text("conv.fcn", "roi_heads.keypoint_head.conv_fcn"),
    _text("kps.score.lowres", "roi_heads.keypoint_head.score_lowres"),
    _text("kps.score.", "roi_heads.keypoint_head.score."),
)


def _apply(rules: Sequence[_Rule], key: str) -> str:
    for rule in rules:
        key = rule(key)
    return key


def convert_basic_c2_names(original_keys: List[str]) -> List[str]:
    """Apply some basic name conversion to names in C2 weights. It only deals with typical
    backbone models.

    Args:
        original_keys (list[str]):
    Returns:
        list[str]: The same number of strings matching those in original_keys.
    """
    return [_apply(_BASIC_RULES, k) for k in original_keys]


def convert_c2_detectron_names(weights: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Map Caffe2 Detectron weight names to Detectron2 names.

    Args:
        weights (dict): name -> tensor

    Returns:
        dict: detectron2 names -> tensor
        dict: detectron2 names -> C2 names
    """
    logger = logging.getLogger(__name__)
    logger.info("Renaming Caffe2 weights ......")
    original_keys = sorted(weights.keys())
    layer_keys = [_apply(_DETECTRON_RULES, k) for k in convert_basic_c2_names(original_keys)]

    first_of: Dict[str, str] = {}
    for orig, renamed in zip(original_keys, layer_keys):
        if renamed in first_of:
            raise ValueError(
                f"Caffe2 weights {first_of[renamed]!r} and {orig!r} are both renamed to {renamed!r}"
            )
        first_of[renamed] = orig

    new_weights: Dict[str, Any] = {}
    new_keys_to_original_keys: Dict[str, str] = {}
    for orig, renamed in zip(original_keys, layer_keys):
        new_keys_to_original_keys[renamed] = orig
        value = weights[orig]
        if renamed.startswith("bbox_pred.") or renamed.startswith("mask_head.predictor."):
            # C2 predicts the background class too: its rows go (4 box deltas, 1 mask).
            start = 4 if renamed.startswith("bbox_pred.") else 1
            new_weights[renamed] = value[start:]
            logger.info(
                "Remove prediction weight for background class in {}. The shape changes from "
                "{} to {}.".format(renamed, tuple(value.shape), tuple(new_weights[renamed].shape))
            )
        elif renamed.startswith("cls_score."):
            # C2's background class is the first; detectron2's is the last.
            logger.info(
                "Move classification weights for background class in {} from index 0 to "
                "index {}.".format(renamed, value.shape[0] - 1)
            )
            new_weights[renamed] = torch.cat([value[1:], value[:1]])
        else:
            new_weights[renamed] = value
    return new_weights, new_keys_to_original_keys


def _best_match(model_key: str, ckpt_keys: Mapping[str, Any]) -> Optional[str]:
    """The longest checkpoint key that is ``model_key`` or a suffix of it starting after a
    ".": ``roi_heads.mesh_head.whatever_conv1`` matches ``whatever_conv1`` but not ``conv1``.
    The longest candidate starts after the first "." (or is the whole key)."""
    if model_key in ckpt_keys:
        return model_key if model_key else None
    start = model_key.find(".")
    while start >= 0:
        candidate = model_key[start + 1 :]
        if candidate and candidate in ckpt_keys:
            return candidate
        start = model_key.find(".", start + 1)
    return None


def align_and_update_state_dicts(
    model_state_dict: Mapping[str, Any],
    ckpt_state_dict: Dict[str, Any],
    c2_conversion: bool = True,
) -> Dict[str, Any]:
    """Match names between the two state-dict, and returns a new chkpt_state_dict with names
    converted to match model_state_dict with heuristics. The returned dict can be later loaded
    with fvcore checkpointer. If ``c2_conversion==True``, ``ckpt_state_dict`` is assumed to be
    a Caffe2 model and will be renamed at first.

    Strategy: suppose that the models that we will create will have prefixes appended to each
    of its keys, for example due to an extra level of nesting that the original pre-trained
    weights from ImageNet won't contain. For example, model.state_dict() might return
    backbone[0].body.res2.conv1.weight, while the pre-trained model contains
    res2.conv1.weight. We thus want to match both parameters together. For that, we look for
    each model weight, look among all loaded keys if there is one that is a suffix of the
    current weight name, and use it if that's the case. If multiple matches exist, take the
    one with longest size of the corresponding name. For example, for the same model as
    before, the pretrained weight file can contain both res2.conv1.weight, as well as
    conv1.weight. In this case, we want to match backbone[0].body.conv1.weight to
    conv1.weight, and backbone[0].body.res2.conv1.weight to res2.conv1.weight.

    A checkpoint key whose shape differs from its model key's is not matched (two warnings)
    and is passed on under its own name, as are the keys that match nothing.

    Raises:
        ValueError: when one checkpoint key is the best match of two model keys.
    """
    logger = logging.getLogger(__name__)
    model_keys = sorted(model_state_dict.keys())
    original_keys: Dict[str, str]
    if c2_conversion:
        ckpt_state_dict, original_keys = convert_c2_detectron_names(ckpt_state_dict)
    else:
        original_keys = {x: x for x in ckpt_state_dict.keys()}
    ckpt_keys = sorted(ckpt_state_dict.keys())

    matched_keys: Dict[str, str] = {}  # checkpoint key -> model key
    result_state_dict: Dict[str, Any] = {}
    for key_model in model_keys:
        key_ckpt = _best_match(key_model, ckpt_state_dict)
        if key_ckpt is None:
            continue
        value_ckpt = ckpt_state_dict[key_ckpt]
        shape_in_model = model_state_dict[key_model].shape
        if shape_in_model != value_ckpt.shape:
            logger.warning(
                "Shape of {} in checkpoint is {}, while shape of {} in model is {}.".format(
                    key_ckpt, value_ckpt.shape, key_model, shape_in_model
                )
            )
            logger.warning(
                "{} will not be loaded. Please double check and see if this is desired.".format(
                    key_ckpt
                )
            )
            continue
        result_state_dict[key_model] = value_ckpt
        if key_ckpt in matched_keys:
            # detectron2's text, a missing space included.
            logger.error(
                "Ambiguity found for {} in checkpoint!"
                "It matches at least two keys in the model ({} and {}).".format(
                    key_ckpt, key_model, matched_keys[key_ckpt]
                )
            )
            raise ValueError("Cannot match one checkpoint key to multiple keys in the model.")
        matched_keys[key_ckpt] = key_model

    matched_model_keys = sorted(matched_keys.values())
    if not matched_model_keys:
        logger.warning("No weights in checkpoint matched with model.")
        return ckpt_state_dict
    common_prefix = _longest_common_prefix(matched_model_keys)
    model_to_original = {v: original_keys[k] for k, v in matched_keys.items()}
    submodule = common_prefix[:-1] if common_prefix else "model"
    logger.info(
        f"Following weights matched with submodule {submodule} - Total num: "
        f"{_count_table_rows(matched_model_keys, model_to_original)}"
    )

    for k in ckpt_keys:
        if k not in matched_keys:
            result_state_dict[k] = ckpt_state_dict[k]
    return result_state_dict


def _count_table_rows(keys: List[str], original_names: Dict[str, str]) -> int:
    """How many rows detectron2's table of matched weights has: one per group of keys in one
    submodule (see :func:`_group_keys_by_module`), one per key in no group."""
    groups = _group_keys_by_module(keys, original_names)
    seen: Set[str] = set()
    rows = 0
    for key in keys:
        if key in seen:
            continue
        if key in groups:
            seen.update(groups[key])
        rows += 1
    return rows


def _group_keys_by_module(keys: List[str], original_names: Dict[str, str]) -> Dict[str, List[str]]:
    """Params in the same submodule are grouped together.

    Args:
        keys: names of all parameters
        original_names: mapping from parameter name to their name in the checkpoint

    Returns:
        dict[name -> all other names in the same group]
    """
    # Each key's submodule prefix ("a.b." of "a.b.w"), shortest first (stable): a key joins
    # the first group that holds it.
    prefixes = sorted((k[: k.rfind(".") + 1] for k in keys if "." in k), key=len)
    ret: Dict[str, List[str]] = {}
    for prefix in dict.fromkeys(prefixes):  # a repeated prefix makes the same group
        group = [k for k in keys if k.startswith(prefix)]
        if len(group) <= 1:
            continue
        if not _longest_common_prefix_str([original_names[k] for k in group]):
            continue  # no grouping when the checkpoint names share no prefix
        for k in group:
            ret.setdefault(k, group)
    return ret


def _longest_common_prefix(names: List[str]) -> str:
    """["abc.zfg", "abc.zef"] -> "abc."

    detectron2's rule: the components equal at the same position in the smallest and the
    largest name (split at "."), also after a position that differs.
    """
    split = [n.split(".") for n in names]
    first, last = min(split), max(split)
    common = [a for a, b in zip(first, last) if a == b]
    return ".".join(common) + "." if common else ""


def _longest_common_prefix_str(names: List[str]) -> str:
    first, last = min(names), max(names)
    n = 0
    for a, b in zip(first, last):
        if a != b:
            break
        n += 1
    return first[:n]
