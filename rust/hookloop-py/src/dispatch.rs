//! Hook dispatch: the binding over the core's `dispatch::Table`.
//!
//! Python builds the table (`hookloop.engine.dispatch.table_for`: per stage, which hook
//! methods to call, with their periods, in order) and hands it over with `set_table`, together
//! with the hook list it was built from. Each stage call passes the trainer's hook list as it
//! is now; the dispatcher compares it with the one the table was built from (identity, then a
//! C-level comparison of the items with the copy it kept): when `trainer._hooks` was replaced
//! or edited, the stage runs nothing and returns False, and Python sets a table for the new
//! list and calls again, as detectron2's `for h in self._hooks` would see the edit. The
//! dispatcher never calls Python to build a table, and holds no other state of a run than
//! `max_iter` (for the period filter) and the iteration of the step in progress (for
//! `after_backward`'s). Every call is timed (one clock read per call, about 5 ns over the call
//! itself; `timing = False` turns it off).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use hookloop_core::dispatch::{now_ticks, start_clock, Stage, Table, STAGES};
use hookloop_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyList;
use pyo3::{PyTraverseError, PyVisit};

use crate::convert::int64;
use crate::errors::to_py;
use crate::errors::IntoPyResult;

/// What an entry calls: a function with the hook as its one argument (a Python method,
/// unbound: one vectorcall, no bound-method object), or any other callable with none.
enum Call {
    Method(Py<PyAny>, Py<PyAny>),
    Plain(Py<PyAny>),
}

impl Call {
    fn call(&self, py: Python<'_>) -> PyResult<()> {
        match self {
            Call::Method(func, hook) => func.bind(py).call1((hook.bind(py),)).map(drop),
            Call::Plain(f) => f.bind(py).call0().map(drop),
        }
    }
}

/// A table and the hook list it was built from.
struct Built {
    table: Table<Call>,
    /// The live list (`trainer._hooks`).
    hooks: Py<PyList>,
    /// A copy of it at build time.
    copy: Py<PyList>,
}

/// The hook table of one trainer.
#[pyclass(name = "Dispatcher", module = "hookloop._core", frozen)]
pub struct PyDispatcher {
    built: Mutex<Arc<Built>>,
    max_iter: AtomicI64,
    /// The iteration of the step in progress (for `after_backward`'s period filter).
    iter: AtomicI64,
    timing: AtomicBool,
}

/// One entry of a table from Python: `(hook_index, stage_index, function, self, period)`.
type TableEntry<'py> = (
    usize,
    usize,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    i64,
);

impl PyDispatcher {
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The table, or None when `hooks` (the trainer's list now) is not the list the table was
    /// built from, or was edited since (a new table is due).
    fn current(&self, py: Python<'_>, hooks: &Bound<'_, PyAny>) -> PyResult<Option<Arc<Built>>> {
        let built = Self::lock(&self.built).clone();
        // The list is read at each stage, as detectron2's `for h in self._hooks` reads it: an
        // edit in the middle of a run shows at the next stage. Lists of different lengths
        // differ, two empty ones do not (no comparison); else list `==`, which is identity per
        // hook for unchanged items.
        if !hooks.is(built.hooks.bind(py)) {
            return Ok(None);
        }
        let (hooks, copy) = (built.hooks.bind(py), built.copy.bind(py));
        if hooks.len() == copy.len() && (hooks.is_empty() || hooks.eq(copy)?) {
            return Ok(Some(built));
        }
        Ok(None)
    }

    /// Runs the hooks of `stage` due at `iter`. False: the hook list changed since the table
    /// was set, and nothing ran.
    fn call(
        &self,
        py: Python<'_>,
        hooks: &Bound<'_, PyAny>,
        stage: Stage,
        iter: i64,
    ) -> PyResult<bool> {
        let Some(built) = self.current(py, hooks)? else {
            return Ok(false);
        };
        if built.table.entries(stage).is_empty() {
            return Ok(true); // no hook overrides it: no clock to read
        }
        let max_iter = self.max_iter.load(Ordering::Relaxed);
        if !self.timing.load(Ordering::Relaxed) {
            for entry in built.table.due(stage, iter, max_iter) {
                entry.call.call(py)?;
            }
            return Ok(true);
        }
        // One clock read per call: each call ends where the next one's time starts.
        let mut start = now_ticks();
        for entry in built.table.due(stage, iter, max_iter) {
            let result = entry.call.call(py);
            let end = now_ticks();
            entry.stats.record(end.wrapping_sub(start));
            start = end;
            result?;
        }
        Ok(true)
    }
}

#[pymethods]
impl PyDispatcher {
    #[new]
    fn new(py: Python<'_>) -> Self {
        start_clock();
        let built = Built {
            table: Table::default(),
            hooks: PyList::empty(py).unbind(),
            copy: PyList::empty(py).unbind(),
        };
        PyDispatcher {
            built: Mutex::new(Arc::new(built)),
            max_iter: AtomicI64::new(i64::MAX),
            iter: AtomicI64::new(0),
            timing: AtomicBool::new(true),
        }
    }

    /// The table for `hooks` (the trainer's live list; a copy is kept to notice edits):
    /// `entries` are `(hook_index, stage_index, function, self, period)`, in call order,
    /// calling `function(self)` (or `function()` when `self` is None), with period 0 for
    /// "every time". With `carry`, each hook's statistics continue from the table replaced.
    #[pyo3(signature = (hooks, entries, carry = true))]
    fn set_table(
        &self,
        py: Python<'_>,
        hooks: Bound<'_, PyList>,
        entries: Vec<TableEntry<'_>>,
        carry: bool,
    ) -> PyResult<()> {
        let copy = PyList::new(py, hooks.iter())?;
        let mut table = Table::default();
        for (hook, stage, func, this, period) in entries {
            let stage = Stage::from_index(stage).ok_or_else(|| {
                to_py(Error::bad_value(
                    "stage index",
                    format!("{stage} is not a stage"),
                ))
            })?;
            let key = copy.get_item(hook)?.as_ptr() as u64;
            let call = match this {
                Some(this) => Call::Method(func.unbind(), this.unbind()),
                None => Call::Plain(func.unbind()),
            };
            table.push(stage, hook, key, call, u64::try_from(period).unwrap_or(0));
        }
        let old = Self::lock(&self.built).clone();
        if carry {
            // Both lists hold their hooks while this runs: the addresses are identities.
            table.carry_stats_from(&old.table);
        }
        let built = Arc::new(Built {
            table,
            hooks: hooks.unbind(),
            copy: copy.unbind(),
        });
        let replaced = std::mem::replace(&mut *Self::lock(&self.built), built);
        drop(old);
        drop(replaced); // after unlocking: dropping hooks may run Python code (__del__)
        Ok(())
    }

    /// Starts a run: `max_iter` for the period filters (the last iteration, `max_iter - 1`,
    /// is due for every periodic hook).
    fn begin(&self, max_iter: &Bound<'_, PyAny>) -> PyResult<()> {
        // The last iteration is max_iter - 1: it must be exact like every iteration.
        let max_iter = int64("max_iter", max_iter)?;
        hookloop_core::iter::exact_iter("max_iter", max_iter)
            .map_err(Error::from)
            .py_err()?;
        self.max_iter.store(max_iter, Ordering::Relaxed);
        Ok(())
    }

    // The stages, each given the trainer's hook list as it is now: each returns False, having
    // run nothing, when that list is not the one the table was set for.

    fn before_train(&self, py: Python<'_>, hooks: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.call(py, hooks, Stage::BeforeTrain, 0)
    }

    fn after_train(&self, py: Python<'_>, hooks: &Bound<'_, PyAny>, iter: i64) -> PyResult<bool> {
        self.call(py, hooks, Stage::AfterTrain, iter)
    }

    /// The hooks' `before_step` at `iter`, which is also the iteration `after_backward`'s
    /// period filter uses until the next call.
    fn before_step(&self, py: Python<'_>, hooks: &Bound<'_, PyAny>, iter: i64) -> PyResult<bool> {
        self.iter.store(iter, Ordering::Relaxed);
        self.call(py, hooks, Stage::BeforeStep, iter)
    }

    fn after_step(&self, py: Python<'_>, hooks: &Bound<'_, PyAny>, iter: i64) -> PyResult<bool> {
        self.call(py, hooks, Stage::AfterStep, iter)
    }

    fn after_backward(&self, py: Python<'_>, hooks: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.call(
            py,
            hooks,
            Stage::AfterBackward,
            self.iter.load(Ordering::Relaxed),
        )
    }

    /// The hooks the table lists for `stage`, in call order (for tests and introspection).
    fn hooks_for<'py>(&self, py: Python<'py>, stage: &str) -> PyResult<Bound<'py, PyList>> {
        let idx = STAGES.iter().position(|s| *s == stage).ok_or_else(|| {
            to_py(Error::bad_value(
                format!("stage '{stage}'"),
                format!("is not one of {STAGES:?}"),
            ))
        })?;
        let stage = Stage::from_index(idx).unwrap_or(Stage::AfterStep);
        let built = Self::lock(&self.built).clone();
        let copy = built.copy.bind(py);
        let hooks = built
            .table
            .entries(stage)
            .iter()
            .map(|e| copy.get_item(e.hook))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, hooks)
    }

    /// Whether each hook call is timed (on by default: one clock read after each call, whose
    /// time runs from the previous read).
    #[getter]
    fn timing(&self) -> bool {
        self.timing.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_timing(&self, on: bool) {
        self.timing.store(on, Ordering::Relaxed);
    }

    /// Per hook and stage: `(hook, stage, calls, total_s, max_s)`, in table order. Counts start
    /// again at each `begin` (each `train()`) and carry over edits of the hook list.
    fn hook_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let built = Self::lock(&self.built).clone();
        let copy = built.copy.bind(py);
        let out = PyList::empty(py);
        for (stage, entry) in built.table.all() {
            let s = entry.stats.snapshot();
            out.append((
                copy.get_item(entry.hook)?,
                stage.name(),
                s.calls,
                s.total_ns as f64 * 1e-9,
                s.max_ns as f64 * 1e-9,
            ))?;
        }
        Ok(out)
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(to_py(Error::NotPicklable {
            what: "hookloop Dispatcher",
            why: "it belongs to one trainer (save trainer.state_dict() instead)",
        }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(built) = self.built.try_lock() {
            visit.call(&built.hooks)?;
            visit.call(&built.copy)?;
            for (_, entry) in built.table.all() {
                match &entry.call {
                    Call::Method(f, h) => {
                        visit.call(f)?;
                        visit.call(h)?;
                    }
                    Call::Plain(f) => visit.call(f)?,
                }
            }
        }
        Ok(())
    }
}
