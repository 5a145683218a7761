"""Every module-level name of the upstream modules that hookloop mirrors is importable from
hookloop's module, and the helpers behave as upstream's.

Research code imports more than the public names: Unbiased Teacher's
``from fvcore.common.checkpoint import _strip_prefix_if_present, _IncompatibleKeys``, a
trainer's ``from detectron2.solver.build import maybe_add_gradient_clipping``. The names are
listed from the upstream source with ``ast`` (module-level functions, classes and assignments,
and imports that the module re-exports through ``__all__``) when the source is here: fvcore's
installed package, and detectron2's tree in ``$HOOKLOOP_D2_SRC`` (or /tmp/d2src). Otherwise
(CI has fvcore but no detectron2 tree) the lists kept in ``UPSTREAM`` stand in, and a test
checks that they still match the source when it is there. A name hookloop does not mirror is
listed in ``NOT_MIRRORED`` with its reason, and docs/differences.md names it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import os
import re
import sys
import types
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DIFFERENCES = ROOT / "docs" / "differences.md"

# (upstream, path in it) -> the hookloop module that mirrors it.
MIRRORS: Dict[Tuple[str, str], str] = {
    ("fvcore", "common/checkpoint.py"): "hookloop.checkpoint",
    ("detectron2", "utils/events.py"): "hookloop.utils.events",
    ("detectron2", "engine/hooks.py"): "hookloop.engine.hooks",
    ("detectron2", "solver/__init__.py"): "hookloop.solver",
    ("detectron2", "solver/build.py"): "hookloop.solver.build",
    ("detectron2", "solver/lr_scheduler.py"): "hookloop.solver.lr_scheduler",
}

# What upstream_names() gives for fvcore 0.1.5.post20221221 and detectron2 02b5c4e: the lists
# used where the source is not here.
UPSTREAM: Dict[Tuple[str, str], List[str]] = {
    ("fvcore", "common/checkpoint.py"): [
        "TORCH_VERSION", "_IncompatibleKeys", "Checkpointer", "PeriodicCheckpointer",
        "_filter_reused_missing_keys", "get_missing_parameters_message",
        "get_unexpected_parameters_message", "_strip_prefix_if_present",
        "_group_checkpoint_keys", "_group_to_str", "_named_modules_with_dup",
    ],
    ("detectron2", "utils/events.py"): [
        "_CURRENT_STORAGE_STACK", "get_event_storage", "has_event_storage", "EventWriter",
        "JSONWriter", "TensorboardXWriter", "CommonMetricPrinter", "EventStorage",
    ],
    ("detectron2", "engine/hooks.py"): [
        "CallbackHook", "IterationTimer", "PeriodicWriter", "PeriodicCheckpointer",
        "BestCheckpointer", "LRScheduler", "TorchProfiler", "AutogradProfiler", "EvalHook",
        "PreciseBN", "TorchMemoryStats",
    ],
    ("detectron2", "solver/__init__.py"): [
        "build_lr_scheduler", "build_optimizer", "get_default_optimizer_params", "LRMultiplier",
        "LRScheduler", "WarmupCosineLR", "WarmupMultiStepLR", "WarmupParamScheduler",
    ],
    ("detectron2", "solver/build.py"): [
        "_GradientClipperInput", "_GradientClipper", "GradientClipType",
        "_create_gradient_clipper", "_generate_optimizer_class_with_gradient_clipping",
        "maybe_add_gradient_clipping", "build_optimizer", "get_default_optimizer_params",
        "_expand_param_groups", "reduce_param_groups", "build_lr_scheduler",
    ],
    ("detectron2", "solver/lr_scheduler.py"): [
        "logger", "WarmupParamScheduler", "LRMultiplier", "WarmupMultiStepLR", "WarmupCosineLR",
        "_get_warmup_factor_at_iter",
    ],
}  # fmt: skip

# (upstream, path, name) -> why hookloop does not mirror it. Each is named in differences.md.
NOT_MIRRORED: Dict[Tuple[str, str, str], str] = {}


def upstream_names(text: str) -> List[str]:
    """A module's own module-level names, in source order: functions, classes and assigned
    names (``if``/``try`` blocks included; dunders such as ``__all__`` left out), then the
    imported names it re-exports: those in a literal ``__all__``, or, where ``__all__`` is
    computed (detectron2's ``[k for k in globals() if not k.startswith("_")]``), the public
    names imported from its own package. Other imports (``torch``, ``logging``, fvcore's
    ``HistoryBuffer`` in events.py) are not the module's names."""
    defined: List[str] = []
    imported: List[Tuple[str, bool]] = []
    exported: Optional[List[str]] = None
    computed_all = False

    def visit(body: List[ast.stmt]) -> None:
        nonlocal exported, computed_all
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if not isinstance(t, ast.Name):
                        continue
                    if t.id == "__all__":
                        assert node.value is not None
                        try:
                            exported = list(ast.literal_eval(node.value))
                        except ValueError:
                            computed_all = True
                    elif not (t.id.startswith("__") and t.id.endswith("__")):
                        defined.append(t.id)
            elif isinstance(node, ast.ImportFrom):
                imported.extend((a.asname or a.name, node.level > 0) for a in node.names)
            elif isinstance(node, ast.Import):
                imported.extend(((a.asname or a.name).split(".")[0], False) for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(text).body)
    names = list(dict.fromkeys(defined))
    for name, relative in imported:
        if (exported is not None and name in exported) or (
            computed_all and relative and not name.startswith("_")
        ):
            if name not in names:
                names.append(name)
    return names


def _d2_root() -> Optional[Path]:
    for root in (os.environ.get("HOOKLOOP_D2_SRC", ""), "/tmp/d2src"):
        if root and (Path(root) / "detectron2" / "engine" / "train_loop.py").is_file():
            return Path(root)
    return None


def upstream_source(upstream: str, path: str) -> Optional[Path]:
    """The upstream file, where it is on this machine."""
    if upstream == "fvcore":
        spec = importlib.util.find_spec("fvcore")
        if spec is None or not spec.submodule_search_locations:
            return None
        f = Path(list(spec.submodule_search_locations)[0]) / path
    else:
        root = _d2_root()
        if root is None:
            return None
        f = root / "detectron2" / path
    return f if f.is_file() else None


def names_of(key: Tuple[str, str]) -> List[str]:
    src = upstream_source(*key)
    return upstream_names(src.read_text(encoding="utf-8")) if src else UPSTREAM[key]


@pytest.mark.parametrize("key", list(MIRRORS), ids=lambda k: f"{k[0]}/{k[1]}")
def test_every_upstream_name_is_importable_from_hookloop(key):
    module = importlib.import_module(MIRRORS[key])
    missing = [n for n in names_of(key) if not hasattr(module, n) and (*key, n) not in NOT_MIRRORED]
    assert not missing, (
        f"{MIRRORS[key]} lacks {missing} of {key[0]}'s {key[1]}: mirror them, or list each in "
        "NOT_MIRRORED and docs/differences.md with the reason"
    )


def test_the_kept_lists_match_the_upstream_source():
    checked = 0
    for key, kept in UPSTREAM.items():
        src = upstream_source(*key)
        if src is None:
            continue
        checked += 1
        assert upstream_names(src.read_text(encoding="utf-8")) == kept, (
            f"{src} changed: update UPSTREAM[{key}]"
        )
    if not checked:
        pytest.skip("no upstream source here")


def test_every_name_not_mirrored_is_in_differences_md():
    text = DIFFERENCES.read_text(encoding="utf-8")
    for (upstream, path, name), reason in NOT_MIRRORED.items():
        assert reason
        assert name in UPSTREAM[(upstream, path)], (upstream, path, name)
        assert f"`{name}" in text, f"docs/differences.md does not name {name} ({reason})"


def test_the_lister_reads_definitions_reexports_and_skips_other_imports():
    text = (
        "import torch\nfrom typing import List\nfrom .a import Pub, _priv\n"
        "from .b import Other\nX: int = 1\ny = z = 2\n__all__ = ['Pub', 'f']\n"
        "try:\n    from torch import Thing\nexcept ImportError:\n    Thing = None\n"
        "if True:\n    def g(): pass\nclass C: pass\ndef f(): pass\n"
    )
    assert upstream_names(text) == ["X", "y", "z", "Thing", "g", "C", "f", "Pub"]
    computed = "from .a import Pub, _priv\nimport os\n__all__ = [k for k in globals()]\n"
    assert upstream_names(computed) == ["Pub"]


# --- fvcore.common.checkpoint's helpers, against fvcore's own -----------------------------------


@pytest.fixture(scope="module")
def fv():
    return pytest.importorskip("fvcore.common.checkpoint")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _sd(keys, metadata=None):
    sd = OrderedDict((k, torch.tensor(float(i))) for i, k in enumerate(keys))
    if metadata is not None:
        sd._metadata = OrderedDict((k, {"version": i}) for i, k in enumerate(metadata))
    return sd


@pytest.mark.parametrize(
    "keys, metadata",
    [
        (["module.b", "module.a.w"], ["", "module", "module.a"]),  # DDP: sorted, root renamed
        (["module.a", ""], None),  # an empty key counts as having the prefix
        (["module.a", "b"], ["", "module"]),  # not every key: nothing changes
        ([], ["", "module", "module.x"]),  # an empty dict: its metadata is still renamed
        (["module.z"], None),
    ],
)
def test_strip_prefix_if_present_is_fvcores(fv, keys, metadata):
    from hookloop.checkpoint import _strip_prefix_if_present

    ours, theirs = _sd(keys, metadata), _sd(keys, metadata)
    _strip_prefix_if_present(ours, "module.")
    fv._strip_prefix_if_present(theirs, "module.")
    assert list(ours) == list(theirs)  # the order too
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert list(getattr(ours, "_metadata", {}).items()) == list(
        getattr(theirs, "_metadata", {}).items()
    )


class _Shared(nn.Module):
    """A module reachable under two names, and a tensor shared by two parameters' names."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = self.a  # the same module twice
        self.c = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        self.c[0].bias = self.a.bias  # a shared parameter
        self.d = None


def test_named_modules_with_dup_and_filter_reused_missing_keys_are_fvcores(fv):
    from hookloop.checkpoint import _filter_reused_missing_keys, _named_modules_with_dup

    model = _Shared()
    for prefix in ("", "root"):
        ours = [(n, id(m)) for n, m in _named_modules_with_dup(model, prefix)]
        theirs = [(n, id(m)) for n, m in fv._named_modules_with_dup(model, prefix)]
        assert ours == theirs
    assert [n for n, _ in _named_modules_with_dup(model)] == ["", "a", "b", "c", "c.0", "c.1"]
    all_keys = list(model.state_dict(keep_vars=True))
    for r in range(len(all_keys) + 1):
        for missing in itertools.combinations(all_keys, r):
            ours = _filter_reused_missing_keys(model, list(missing))
            theirs = fv._filter_reused_missing_keys(model, list(missing))
            # fvcore returns a set's order; hookloop keeps the order it was given
            assert sorted(ours) == sorted(theirs)
            assert ours == [k for k in missing if k in ours]


@pytest.mark.parametrize(
    "keys",
    [
        [],
        ["w"],
        ["backbone.conv1.weight", "backbone.conv1.bias", "head", "backbone.conv2.weight"],
        ["a.b.c", "a.b", "a.b.d", "x.y"],
    ],
)
def test_group_helpers_and_messages_are_fvcores(fv, keys):
    import hookloop.checkpoint as H

    assert dict(H._group_checkpoint_keys(keys)) == dict(fv._group_checkpoint_keys(keys))
    assert list(H._group_checkpoint_keys(keys)) == list(fv._group_checkpoint_keys(keys))
    for group in ([], ["x"], ["z", "a", "m"]):
        assert H._group_to_str(group) == fv._group_to_str(group)
    # fvcore colours each line with termcolor when stdout is a terminal; the text is the same
    for name in ("get_missing_parameters_message", "get_unexpected_parameters_message"):
        assert getattr(H, name)(keys) == _ANSI.sub("", getattr(fv, name)(keys))


def test_incompatible_keys_and_torch_version_are_fvcores(fv):
    import hookloop.checkpoint as H

    assert H.TORCH_VERSION == fv.TORCH_VERSION
    assert isinstance(H.TORCH_VERSION, tuple) and len(H.TORCH_VERSION) == 2
    assert H._IncompatibleKeys._fields == fv._IncompatibleKeys._fields
    keys = H._IncompatibleKeys(missing_keys=["a"], unexpected_keys=[], incorrect_shapes=[])
    assert keys.missing_keys == ["a"] and tuple(keys) == (["a"], [], [])


# --- detectron2.solver.build -----------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.embedding = nn.Parameter(torch.zeros(3))
        self.frozen = nn.Linear(2, 2)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.head = nn.Linear(4, 2)
        self.tied = nn.Linear(4, 2)
        self.tied.weight = self.head.weight  # a shared parameter goes in once


def _groups(params):
    """Each group's hyper-parameters and its parameters' ids."""
    out = []
    for g in params:
        hp = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        out.append((hp, [id(p) for p in g["params"]]))
    return out


def test_get_default_optimizer_params_groups_by_hyperparameters():
    from hookloop.solver import get_default_optimizer_params

    m = _Net()
    groups = get_default_optimizer_params(
        m,
        base_lr=0.1,
        weight_decay=1e-4,
        weight_decay_norm=0.0,
        bias_lr_factor=2.0,
        weight_decay_bias=0.0,
        overrides={"embedding": {"lr": 0.01}},
    )
    biases = [m.conv.bias, m.norm.bias, m.gn.bias, m.head.bias, m.tied.bias]
    assert _groups(groups) == [
        ({"lr": 0.01, "weight_decay": 1e-4}, [id(m.embedding)]),
        ({"lr": 0.1, "weight_decay": 1e-4}, [id(m.conv.weight), id(m.head.weight)]),
        ({"lr": 0.2, "weight_decay": 0.0}, [id(p) for p in biases]),
        ({"lr": 0.1, "weight_decay": 0.0}, [id(m.norm.weight), id(m.gn.weight)]),
    ]
    plain = get_default_optimizer_params(m)
    assert _groups(plain) == [({}, [id(p) for p in m.parameters() if p.requires_grad])]
    decayed = get_default_optimizer_params(
        m, base_lr=1.0, lr_factor_func=lambda name: 2.0 if name.startswith("head.") else 1.0
    )
    rest = [id(p) for n, p in m.named_parameters() if not n.startswith(("head", "frozen"))]
    assert _groups(decayed) == [
        ({"lr": 1.0}, rest),
        ({"lr": 2.0}, [id(m.head.weight), id(m.head.bias)]),
    ]
    with pytest.raises(ValueError, match="bias_lr_factor requires base_lr"):
        get_default_optimizer_params(m, bias_lr_factor=2.0)
    with pytest.raises(ValueError, match="lr_factor_func requires base_lr"):
        get_default_optimizer_params(m, lr_factor_func=lambda n: 1.0)
    with pytest.raises(ValueError, match="Conflicting overrides for 'bias'"):
        get_default_optimizer_params(m, weight_decay_bias=0.0, overrides={"bias": {}})


def test_reduce_param_groups_merges_equal_groups_and_keeps_names():
    from hookloop.solver.build import _expand_param_groups, reduce_param_groups

    a, b, c = (nn.Parameter(torch.zeros(1)) for _ in range(3))
    params = [
        {"params": [a, b], "param_names": ["a", "b"], "lr": 1.0},
        {"params": [c], "param_names": ["c"], "lr": 2.0},
        {"params": [b], "param_names": ["b2"], "lr": 2.0},  # later groups win for b
    ]
    expanded = _expand_param_groups(params)
    assert [(e["param_names"], e["lr"]) for e in expanded] == [
        (["a"], 1.0),
        (["b2"], 2.0),
        (["c"], 2.0),
    ]
    reduced = reduce_param_groups(params)
    assert [(g["lr"], g["param_names"], [id(p) for p in g["params"]]) for g in reduced] == [
        (1.0, ["a"], [id(a)]),
        (2.0, ["b2", "c"], [id(b), id(c)]),
    ]
    assert reduce_param_groups([{"params": [a], "lr": 1}, {"params": [b], "lr": 1}]) == [
        {"lr": 1, "params": [a, b]}
    ]


def _cfg(**solver):
    clip = types.SimpleNamespace(ENABLED=False, CLIP_TYPE="value", CLIP_VALUE=1.0, NORM_TYPE=2.0)
    # detectron2's defaults (config/defaults.py), for a run of 40 iterations
    s = dict(
        BASE_LR=0.01, BASE_LR_END=0.0, BIAS_LR_FACTOR=1.0, GAMMA=0.1,
        LR_SCHEDULER_NAME="WarmupMultiStepLR", MAX_ITER=40, MOMENTUM=0.9, NESTEROV=False,
        NUM_DECAYS=3, RESCALE_INTERVAL=False, STEPS=(30,), WARMUP_FACTOR=0.001,
        WARMUP_ITERS=10, WARMUP_METHOD="linear", WEIGHT_DECAY=1e-4, WEIGHT_DECAY_BIAS=None,
        WEIGHT_DECAY_NORM=0.0, CLIP_GRADIENTS=clip,
    )  # fmt: skip
    s.update(solver)
    return types.SimpleNamespace(SOLVER=types.SimpleNamespace(**s))


@pytest.mark.parametrize("clip_type", ["value", "norm"])
def test_maybe_add_gradient_clipping_clips_before_the_step(clip_type):
    from hookloop.solver.build import GradientClipType, maybe_add_gradient_clipping

    cfg = _cfg()
    assert maybe_add_gradient_clipping(cfg, torch.optim.SGD) is torch.optim.SGD
    cfg.SOLVER.CLIP_GRADIENTS = types.SimpleNamespace(
        ENABLED=True, CLIP_TYPE=clip_type, CLIP_VALUE=0.5, NORM_TYPE=2.0
    )
    cls = maybe_add_gradient_clipping(cfg, torch.optim.SGD)
    assert cls.__name__ == "SGDWithGradientClip" and issubclass(cls, torch.optim.SGD)
    p = nn.Parameter(torch.zeros(2))
    opt = cls([p], lr=1.0)
    cfg.SOLVER.CLIP_GRADIENTS.CLIP_VALUE = 100.0  # the clipper took a copy
    p.grad = torch.tensor([3.0, -4.0])
    opt.step()
    want = [-0.5, 0.5] if clip_type == "value" else [-0.3, 0.4]
    assert torch.allclose(p.detach(), torch.tensor(want))
    # an optimizer instance becomes the clipping class itself
    inst = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    assert maybe_add_gradient_clipping(cfg, inst) is inst
    assert type(inst).__name__ == "SGDWithGradientClip"
    assert GradientClipType(clip_type).value == clip_type


def test_generate_optimizer_class_with_a_global_clipper():
    from hookloop.solver.build import _generate_optimizer_class_with_gradient_clipping

    seen = []
    cls = _generate_optimizer_class_with_gradient_clipping(
        torch.optim.SGD, global_clipper=lambda ps: seen.append(len(list(ps)))
    )
    opt = cls([nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.step()
    assert seen == [2]
    with pytest.raises(ValueError, match="both per-parameter clipping and global clipping"):
        _generate_optimizer_class_with_gradient_clipping(
            torch.optim.SGD, per_param_clipper=print, global_clipper=print
        )


def _lrs(sched, opt, n):
    """The LR of the first group at each of ``n`` iterations (the scheduler steps after each
    but the last: a step to ``where = 1.0`` is out of some schedules' range, fvcore's too)."""
    out = []
    for i in range(n):
        out.append(opt.param_groups[0]["lr"])
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
        if i < n - 1:
            sched.step()
    return out


@pytest.fixture(scope="module")
def d2_build():
    """detectron2's ``solver/build.py`` and ``config.get_cfg``, from the source tree, when it
    is here (imported as tests/compat/backends.py imports the engine)."""
    root = _d2_root()
    if root is None:
        pytest.skip("no detectron2 source tree")
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from compat import backends

    saved = os.environ.get("HOOKLOOP_D2_SRC")
    os.environ["HOOKLOOP_D2_SRC"] = str(root)
    try:
        backends.backend("d2src")
    finally:
        if saved is None:
            del os.environ["HOOKLOOP_D2_SRC"]
        else:
            os.environ["HOOKLOOP_D2_SRC"] = saved
    name = "detectron2.config"
    if name not in sys.modules:
        # its __init__ imports the lazy-config machinery (omegaconf, hydra): only config.py
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / "detectron2" / "config")]
        sys.modules[name] = pkg
        pkg.CfgNode = importlib.import_module("detectron2.config.config").CfgNode  # type: ignore[attr-defined]
    config = importlib.import_module("detectron2.config.config")
    return importlib.import_module("detectron2.solver.build"), config.get_cfg


@pytest.mark.parametrize(
    "name", ["WarmupMultiStepLR", "WarmupCosineLR", "WarmupStepWithFixedGammaLR"]
)
def test_build_lr_scheduler_gives_the_lrs_of_its_config(name):
    from hookloop.solver import LRMultiplier, build_lr_scheduler

    cfg = _cfg(LR_SCHEDULER_NAME=name, BASE_LR_END=0.001)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = build_lr_scheduler(cfg, opt)
    assert isinstance(sched, LRMultiplier)
    lrs = _lrs(sched, opt, 40)
    assert lrs[0] == pytest.approx(0.01 * 0.001)
    at_10 = {
        "WarmupMultiStepLR": 0.01,
        "WarmupCosineLR": 0.001 + 0.009 * 0.5 * (1 + 0.5**0.5),  # cos(pi/4) of [0.01, 0.001]
        "WarmupStepWithFixedGammaLR": 0.001,  # one of three decays at every 40 / 4 iterations
    }
    assert lrs[10] == pytest.approx(at_10[name])
    if name == "WarmupMultiStepLR":
        assert lrs[29] == pytest.approx(0.01) and lrs[30] == pytest.approx(0.001)


def test_build_lr_scheduler_refuses_what_detectron2_refuses():
    from hookloop.solver import build_lr_scheduler

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    with pytest.raises(ValueError, match="Unknown LR scheduler: Nope"):
        build_lr_scheduler(_cfg(LR_SCHEDULER_NAME="Nope"), opt)
    with pytest.raises(ValueError, match="BASE_LR_END / SOLVER.BASE_LR must be in"):
        build_lr_scheduler(_cfg(LR_SCHEDULER_NAME="WarmupCosineLR", BASE_LR_END=0.1), opt)


@pytest.mark.parametrize(
    "name", ["WarmupMultiStepLR", "WarmupCosineLR", "WarmupStepWithFixedGammaLR"]
)
def test_builders_match_detectron2s_on_its_default_config(d2_build, name):
    from hookloop.solver import build_lr_scheduler, build_optimizer

    d2, get_cfg = d2_build
    cfg = get_cfg()
    cfg.SOLVER.MAX_ITER, cfg.SOLVER.WARMUP_ITERS, cfg.SOLVER.STEPS = 60, 10, (30, 45, 90)
    cfg.SOLVER.LR_SCHEDULER_NAME, cfg.SOLVER.BASE_LR_END = name, 0.0001
    cfg.SOLVER.BIAS_LR_FACTOR, cfg.SOLVER.WEIGHT_DECAY_BIAS = 2.0, 0.0
    cfg.SOLVER.CLIP_GRADIENTS.ENABLED = True
    torch.manual_seed(0)
    model = _Net()
    ours, theirs = build_optimizer(cfg, model), d2.build_optimizer(cfg, model)
    assert type(ours).__name__ == type(theirs).__name__ == "SGDWithGradientClip"
    assert _groups(ours.param_groups) == _groups(theirs.param_groups)
    our_sched = build_lr_scheduler(cfg, ours)
    their_sched = d2.build_lr_scheduler(cfg, theirs)
    assert _lrs(our_sched, ours, 60) == _lrs(their_sched, theirs, 60)
    from hookloop.solver import get_default_optimizer_params

    options = dict(base_lr=0.1, weight_decay_norm=0.0, lr_factor_func=lambda n: 1 + len(n) % 3)
    assert _groups(get_default_optimizer_params(model, **options)) == _groups(
        d2.get_default_optimizer_params(model, **options)
    )
