//! torch's `MultiStepLR` and `StepLR` stepped without their Python between the steps that
//! change the LR.
//!
//! Between milestones their `step()` (`LRScheduler.step` → `_update_lr` → `get_lr`) leaves
//! every `group["lr"]` as it is and changes three of the scheduler's attributes:
//! `_step_count += 1`, `last_epoch += 1`, and `_last_lr`, a new list of the groups' LRs. That
//! costs ~20k instructions of Python per step (a context manager, the warnings checks, three
//! list comprehensions), more than the rest of the default stack's bookkeeping. Here those
//! three attributes are set directly, the same values torch's step sets.
//!
//! Only when the outcome is certain: the scheduler is exactly torch's class (not a subclass,
//! no method replaced on the instance), it is past its first `step()` (whose warnings about
//! the call order stay torch's), the next epoch changes no LR (not a milestone of
//! `MultiStepLR`, not a multiple of `StepLR`'s `step_size`), and every LR is a Python number
//! (a tensor LR is torch's to copy). Otherwise torch's `step()` runs. The attributes read here
//! are torch's, read from the instance's `__dict__`; tests compare the scheduler's
//! `state_dict()` and the LRs with torch's own stepping at every step.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyFloat, PyInt, PyList, PyType};

#[derive(Clone, Copy)]
enum Kind {
    MultiStep,
    Step,
}

/// torch's `MultiStepLR` and `StepLR`, once `torch.optim.lr_scheduler` is imported (looked
/// up in `sys.modules`; never imported here).
fn classes(py: Python<'_>) -> Option<&(Py<PyType>, Py<PyType>)> {
    static CLASSES: PyOnceLock<(Py<PyType>, Py<PyType>)> = PyOnceLock::new();
    if let Some(c) = CLASSES.get(py) {
        return Some(c);
    }
    let module = py
        .import(intern!(py, "sys"))
        .and_then(|sys| sys.getattr(intern!(py, "modules")))
        .and_then(|m| m.get_item(intern!(py, "torch.optim.lr_scheduler")))
        .ok()?;
    let class = |name: &Bound<'_, pyo3::types::PyString>| {
        module
            .getattr(name)
            .ok()
            .and_then(|c| c.cast_into::<PyType>().ok())
            .map(Bound::unbind)
    };
    let pair = (
        class(intern!(py, "MultiStepLR"))?,
        class(intern!(py, "StepLR"))?,
    );
    let _ = CLASSES.set(py, pair);
    CLASSES.get(py)
}

fn kind(scheduler: &Bound<'_, PyAny>) -> Option<Kind> {
    let py = scheduler.py();
    let (multi_step, step) = classes(py)?;
    let ty = scheduler.get_type();
    if ty.is(multi_step.bind(py)) {
        Some(Kind::MultiStep)
    } else if ty.is(step.bind(py)) {
        Some(Kind::Step)
    } else {
        None
    }
}

/// `scheduler.step()`: the attributes set here when the step changes no LR, else torch's.
pub fn step(scheduler: &Bound<'_, PyAny>) -> PyResult<()> {
    if let Some(kind) = kind(scheduler) {
        if between_changes(scheduler, kind)? {
            return Ok(());
        }
    }
    scheduler.call_method0(intern!(scheduler.py(), "step"))?;
    Ok(())
}

/// Sets `_step_count`, `last_epoch` and `_last_lr` as torch's `step()` would, and returns
/// true, when that step changes no LR; returns false (nothing set) when torch's must run.
fn between_changes(scheduler: &Bound<'_, PyAny>, kind: Kind) -> PyResult<bool> {
    let py = scheduler.py();
    let Ok(d) = scheduler
        .getattr(intern!(py, "__dict__"))?
        .cast_into::<PyDict>()
    else {
        return Ok(false);
    };
    for replaced in [
        intern!(py, "step"),
        intern!(py, "get_lr"),
        intern!(py, "_update_lr"),
    ] {
        if d.contains(replaced)? {
            return Ok(false);
        }
    }
    let int = |name: &Bound<'_, pyo3::types::PyString>| -> PyResult<Option<i64>> {
        match d.get_item(name)? {
            Some(v) if v.is_exact_instance_of::<PyInt>() => Ok(v.extract::<i64>().ok()),
            _ => Ok(None),
        }
    };
    let (Some(count), Some(last)) = (
        int(intern!(py, "_step_count"))?,
        int(intern!(py, "last_epoch"))?,
    ) else {
        return Ok(false);
    };
    // The first step is torch's: it checks the order of optimizer.step() and scheduler.step().
    if count <= 1 {
        return Ok(false);
    }
    let (Some(next_count), Some(next)) = (count.checked_add(1), last.checked_add(1)) else {
        return Ok(false);
    };
    let changes = match kind {
        Kind::MultiStep => match d.get_item(intern!(py, "milestones"))? {
            Some(milestones) => milestones.contains(next)?,
            None => return Ok(false),
        },
        Kind::Step => match int(intern!(py, "step_size"))? {
            Some(size) if size > 0 => next != 0 && next.rem_euclid(size) == 0,
            _ => return Ok(false),
        },
    };
    if changes {
        return Ok(false);
    }
    let Some(optimizer) = d.get_item(intern!(py, "optimizer"))? else {
        return Ok(false);
    };
    let Ok(groups) = optimizer
        .getattr(intern!(py, "param_groups"))?
        .cast_into::<PyList>()
    else {
        return Ok(false);
    };
    let last_lr = PyList::empty(py);
    for group in groups.iter() {
        let lr = group.get_item(intern!(py, "lr"))?;
        if !(lr.is_exact_instance_of::<PyFloat>() || lr.is_exact_instance_of::<PyInt>()) {
            return Ok(false);
        }
        last_lr.append(lr)?;
    }
    d.set_item(intern!(py, "_step_count"), next_count)?;
    d.set_item(intern!(py, "last_epoch"), next)?;
    d.set_item(intern!(py, "_last_lr"), last_lr)?;
    Ok(true)
}
