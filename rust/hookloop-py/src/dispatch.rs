//! Hook dispatch: per stage, the hooks that override it, called in registration order with one
//! crossing into Rust per stage; and the training loop itself.
//!
//! The table is rebuilt whenever the trainer's hook list changes (`_HookList` in Python calls
//! `set_hooks`). Calls copy the table's `Arc` out of the lock first, so a hook may register
//! more hooks (or do anything else) while it runs; the change applies from the next stage.

use std::sync::{Arc, Mutex};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{PyTraverseError, PyVisit};

use crate::storage::{lock, PyEventStorage};

/// The five stages of `HookBase`, in the order of the table.
pub const STAGES: [&str; 5] = [
    "before_train",
    "after_train",
    "before_step",
    "after_step",
    "after_backward",
];

const BEFORE_TRAIN: usize = 0;
const AFTER_TRAIN: usize = 1;
const BEFORE_STEP: usize = 2;
const AFTER_STEP: usize = 3;
const AFTER_BACKWARD: usize = 4;

/// Per stage, the hooks to call.
#[derive(Default)]
struct Table {
    stages: [Vec<Py<PyAny>>; 5],
}

/// The hook table of one trainer.
#[pyclass(name = "Dispatcher", module = "hookloop._core", frozen)]
pub struct PyDispatcher {
    table: Mutex<Arc<Table>>,
}

impl PyDispatcher {
    fn snapshot(&self) -> Arc<Table> {
        lock(&self.table).clone()
    }

    fn call_stage(&self, py: Python<'_>, stage: usize) -> PyResult<()> {
        let table = self.snapshot();
        call_all(py, &table.stages[stage], stage)
    }
}

fn stage_name<'py>(py: Python<'py>, stage: usize) -> &'py Bound<'py, PyString> {
    match stage {
        BEFORE_TRAIN => intern!(py, "before_train"),
        AFTER_TRAIN => intern!(py, "after_train"),
        BEFORE_STEP => intern!(py, "before_step"),
        AFTER_STEP => intern!(py, "after_step"),
        _ => intern!(py, "after_backward"),
    }
}

/// Calls `hook.<stage>()` on each hook. Looked up by name at each call (as detectron2 does), so
/// a method replaced on an instance after registration is still honoured.
fn call_all(py: Python<'_>, hooks: &[Py<PyAny>], stage: usize) -> PyResult<()> {
    if hooks.is_empty() {
        return Ok(());
    }
    let name = stage_name(py, stage);
    for hook in hooks {
        hook.bind(py).call_method0(name)?;
    }
    Ok(())
}

#[pymethods]
impl PyDispatcher {
    #[new]
    fn new() -> Self {
        PyDispatcher {
            table: Mutex::new(Arc::new(Table::default())),
        }
    }

    /// Rebuilds the table from `hooks`: a hook is listed for a stage unless that stage's
    /// method is `base`'s own (inherited unchanged) and not replaced on the instance.
    fn set_hooks(
        &self,
        py: Python<'_>,
        hooks: &Bound<'_, PyList>,
        base: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut table = Table::default();
        for hook in hooks.iter() {
            let cls = hook.get_type();
            let inst_dict = hook
                .getattr(intern!(py, "__dict__"))
                .ok()
                .and_then(|d| d.cast_into::<PyDict>().ok());
            for (i, name_str) in STAGES.iter().copied().enumerate() {
                let on_instance = match &inst_dict {
                    Some(d) => d.contains(name_str)?,
                    None => false,
                };
                let inherited = match (cls.getattr(name_str), base.getattr(name_str)) {
                    (Ok(a), Ok(b)) => a.is(&b),
                    // No such attribute: list it, so the call fails as it would in detectron2.
                    _ => false,
                };
                if on_instance || !inherited {
                    table.stages[i].push(hook.clone().unbind());
                }
            }
        }
        let old = std::mem::replace(&mut *lock(&self.table), Arc::new(table));
        drop(old); // after unlocking: dropping hooks may run Python code (__del__)
        Ok(())
    }

    /// The hooks listed for `stage` (for tests and introspection).
    fn hooks_for<'py>(&self, py: Python<'py>, stage: &str) -> PyResult<Bound<'py, PyList>> {
        let idx = STAGES.iter().position(|s| *s == stage).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "unknown stage '{stage}', expected one of {STAGES:?}"
            ))
        })?;
        let table = self.snapshot();
        PyList::new(py, table.stages[idx].iter().map(|h| h.clone_ref(py)))
    }

    fn before_train(&self, py: Python<'_>) -> PyResult<()> {
        self.call_stage(py, BEFORE_TRAIN)
    }

    fn after_train(&self, py: Python<'_>) -> PyResult<()> {
        self.call_stage(py, AFTER_TRAIN)
    }

    fn before_step(&self, py: Python<'_>) -> PyResult<()> {
        self.call_stage(py, BEFORE_STEP)
    }

    fn after_step(&self, py: Python<'_>) -> PyResult<()> {
        self.call_stage(py, AFTER_STEP)
    }

    fn after_backward(&self, py: Python<'_>) -> PyResult<()> {
        self.call_stage(py, AFTER_BACKWARD)
    }

    /// The loop of `TrainerBase.train`: for each iteration, set `trainer.iter`, run
    /// before_step, `run_step()`, after_step. `before_step`/`after_step` are the trainer's own
    /// methods when a subclass overrides them (then called instead of the fast path); `None`
    /// means TrainerBase's: set `storage.iter` and call the hooks from here.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (trainer, storage, start_iter, max_iter, run_step, before_step = None, after_step = None))]
    fn run_loop(
        &self,
        py: Python<'_>,
        trainer: &Bound<'_, PyAny>,
        storage: &Bound<'_, PyEventStorage>,
        start_iter: i64,
        max_iter: i64,
        run_step: &Bound<'_, PyAny>,
        before_step: Option<&Bound<'_, PyAny>>,
        after_step: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let iter_name = intern!(py, "iter");
        let storage = storage.get();
        for i in start_iter..max_iter {
            trainer.setattr(iter_name, i)?;
            match before_step {
                Some(f) => {
                    f.call0()?;
                }
                None => {
                    storage.set_iter(i);
                    let table = self.snapshot();
                    call_all(py, &table.stages[BEFORE_STEP], BEFORE_STEP)?;
                }
            }
            run_step.call0()?;
            match after_step {
                Some(f) => {
                    f.call0()?;
                }
                None => {
                    let table = self.snapshot();
                    call_all(py, &table.stages[AFTER_STEP], AFTER_STEP)?;
                }
            }
            // A Ctrl-C while only Rust and C code ran would otherwise wait for Python bytecode.
            py.check_signals()?;
        }
        Ok(())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(table) = self.table.try_lock() {
            for stage in &table.stages {
                for hook in stage {
                    visit.call(hook)?;
                }
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let old = self
            .table
            .try_lock()
            .map(|mut t| std::mem::replace(&mut *t, Arc::new(Table::default())))
            .ok();
        drop(old); // after unlocking, as in set_hooks
    }
}
