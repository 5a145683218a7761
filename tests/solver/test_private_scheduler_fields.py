"""torch's private fields of an LR scheduler (``_step_count``, ``last_epoch``, ``_last_lr``,
``_get_lr_called_within_step``) are written in one function of the package,
``hookloop.solver.torch_step.advance``; everything else that steps a scheduler calls it (or
torch's own ``step()``). A write is an assignment to ``x.<field>`` or ``x["<field>"]`` (an
instance's ``__dict__``), augmented or not, or a ``setattr(x, "<field>", ...)``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Tuple

import torch
from hookloop.solver import LRMultiplier, WarmupParamScheduler
from hookloop.solver.param_scheduler import MultiStepParamScheduler

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "hookloop"
FIELDS = {"_step_count", "last_epoch", "_last_lr", "_get_lr_called_within_step"}
WRITER = ("solver/torch_step.py", "advance")


def _field(target: ast.expr) -> str | None:
    if isinstance(target, ast.Attribute) and target.attr in FIELDS:
        return target.attr
    if (
        isinstance(target, ast.Subscript)
        and isinstance(target.slice, ast.Constant)
        and target.slice.value in FIELDS
    ):
        return str(target.slice.value)
    return None


def _written(node: ast.AST) -> str | None:
    """The field ``node`` writes, if any."""
    if isinstance(node, ast.Assign):
        return next((f for f in map(_field, node.targets) if f is not None), None)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return _field(node.target)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in FIELDS
    ):
        return str(node.args[1].value)
    return None


def writes() -> List[Tuple[str, str, str]]:
    """(file, innermost enclosing function, field) for every write of a field in the
    package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))

        def visit(node: ast.AST, where: str, rel: str = rel) -> None:
            field = _written(node)
            if field is not None:
                found.append((rel, where, field))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = node.name
            for child in ast.iter_child_nodes(node):
                visit(child, where)

        visit(ast.parse(path.read_text(), str(path)), "<module>")
    return sorted(set(found))


def test_torch_step_advance_is_the_only_writer_of_torchs_private_scheduler_fields():
    found = writes()
    assert {(f, fn) for f, fn, _ in found} == {WRITER}, found
    assert {field for _, _, field in found} == {"_step_count", "last_epoch", "_last_lr"}


def test_advance_leaves_the_state_of_torchs_own_step():
    """LRMultiplier's native step (through advance) and torch's step leave the same state."""

    def build():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        inner = MultiStepParamScheduler([1.0, 0.1], milestones=[5], num_updates=10)
        return opt, LRMultiplier(opt, WarmupParamScheduler(inner, 0.1, 0.2), 10)

    (opt_a, fast), (opt_b, slow) = build(), build()
    slow._fast = False  # torch's LRScheduler.step
    for _ in range(10):
        opt_a.step()
        opt_b.step()
        fast.step()
        slow.step()
        assert fast.state_dict() == slow.state_dict()
        assert fast.get_last_lr() == slow.get_last_lr() == [opt_a.param_groups[0]["lr"]]
