//! Hook dispatch and the training loop: the binding over the core's `dispatch::Table`.
//!
//! The trainer's hook list stays a plain Python list. The dispatcher keeps a copy of it next
//! to the table built from it, and at each stage compares the two (one C-level list comparison,
//! identity first): any in-place edit of `trainer._hooks` rebuilds the table before the stage
//! runs, as detectron2's `for h in self._hooks` would see it. The table holds each hook's bound
//! stage methods, resolved when it is built, and calls them with vectorcall; a periodic hook is
//! skipped between its periods by the core's one period rule. Every call is timed (one clock
//! read per call, about 5 ns over the call itself; `timing = False` turns it off): this is the
//! one dispatch path, for periods and timing alike.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use hookloop_core::dispatch::{now_ticks, start_clock, Stage, Table, STAGES};
use hookloop_core::Error;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyList;
use pyo3::{PyTraverseError, PyVisit};

use crate::convert::int64;
use crate::errors::to_py;
use crate::errors::IntoPyResult;
use crate::storage::PyEventStorage;

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
    /// Python callable: `build(hooks) -> [(hook_index, stage_index, function, self, period)]`.
    build: Py<PyAny>,
    built: Mutex<Arc<Built>>,
    storage: Mutex<Option<Py<PyEventStorage>>>,
    max_iter: AtomicI64,
    /// The iteration of the step in progress (for `after_backward`'s period filter).
    iter: AtomicI64,
    timing: AtomicBool,
}

impl PyDispatcher {
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The table for the hook list as it is now, rebuilt if the list changed.
    fn current(&self, py: Python<'_>) -> PyResult<Arc<Built>> {
        let built = Self::lock(&self.built).clone();
        self.checked(py, built)
    }

    /// The table unless there are no hooks at all (none listed, none in the table): what a
    /// stage call needs, under one lock and without taking the table out when it is empty
    /// (len() runs no Python code).
    fn current_hooks(&self, py: Python<'_>) -> PyResult<Option<Arc<Built>>> {
        let built = {
            let built = Self::lock(&self.built);
            if built.hooks.bind(py).is_empty() && built.copy.bind(py).is_empty() {
                return Ok(None);
            }
            built.clone()
        };
        self.checked(py, built).map(Some)
    }

    /// `built`, or a table rebuilt for the list if it changed since `built` was made.
    fn checked(&self, py: Python<'_>, built: Arc<Built>) -> PyResult<Arc<Built>> {
        // The list is read at each stage, as detectron2's `for h in self._hooks` reads it: an
        // edit in the middle of a run shows at the next stage. Lists of different lengths
        // differ, two empty ones do not (no comparison); else list `==`, which is identity per
        // hook for unchanged items.
        let (hooks, copy) = (built.hooks.bind(py), built.copy.bind(py));
        if hooks.len() == copy.len() && (hooks.is_empty() || hooks.eq(copy)?) {
            return Ok(built);
        }
        let hooks = built.hooks.clone_ref(py);
        drop(built);
        self.rebuild(py, hooks, true)
    }

    /// Builds the table for `hooks`. With `carry`, a hook's statistics for a stage continue
    /// from the table it replaces (an edit of the list in the middle of a run, a stop's hook);
    /// `begin` starts them again for each run.
    fn rebuild(&self, py: Python<'_>, hooks: Py<PyList>, carry: bool) -> PyResult<Arc<Built>> {
        let copy = PyList::new(py, hooks.bind(py).iter())?.unbind();
        let entries = self.build.bind(py).call1((hooks.bind(py),))?;
        let mut table = Table::default();
        for entry in entries.try_iter()? {
            let (hook, stage, func, this, period): (
                usize,
                usize,
                Bound<'_, PyAny>,
                Option<Bound<'_, PyAny>>,
                i64,
            ) = entry?.extract()?;
            let stage = Stage::from_index(stage).ok_or_else(|| {
                to_py(Error::bad_value(
                    "stage index",
                    format!("{stage} is not a stage"),
                ))
            })?;
            let call = match this {
                Some(this) => Call::Method(func.unbind(), this.unbind()),
                None => Call::Plain(func.unbind()),
            };
            table.push(stage, hook, call, u64::try_from(period).unwrap_or(0));
        }
        if carry {
            // Identity of a hook: its object, held by both lists' copies while this runs.
            let old = Self::lock(&self.built).clone();
            let old_copy = old.copy.bind(py);
            let mut counts = HashMap::new();
            for (stage, entry) in old.table.all() {
                let hook = old_copy.get_item(entry.hook)?.as_ptr() as usize;
                counts.insert((hook, stage as usize), entry.stats.ticks());
            }
            let new_copy = copy.bind(py);
            for (stage, entry) in table.all() {
                let hook = new_copy.get_item(entry.hook)?.as_ptr() as usize;
                if let Some(&ticks) = counts.get(&(hook, stage as usize)) {
                    entry.stats.restore(ticks);
                }
            }
        }
        let built = Arc::new(Built { table, hooks, copy });
        let old = std::mem::replace(&mut *Self::lock(&self.built), built.clone());
        drop(old); // after unlocking: dropping hooks may run Python code (__del__)
        Ok(built)
    }

    fn call(&self, py: Python<'_>, stage: Stage, iter: i64) -> PyResult<()> {
        let Some(built) = self.current_hooks(py)? else {
            return Ok(()); // a trainer without hooks
        };
        if built.table.entries(stage).is_empty() {
            return Ok(()); // no hook overrides it: no clock to read
        }
        let max_iter = self.max_iter.load(Ordering::Relaxed);
        if !self.timing.load(Ordering::Relaxed) {
            for entry in built.table.due(stage, iter, max_iter) {
                entry.call.call(py)?;
            }
            return Ok(());
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
        Ok(())
    }

    fn set_storage_iter(&self, py: Python<'_>, iter: i64) -> PyResult<()> {
        let storage = Self::lock(&self.storage).as_ref().map(|s| s.clone_ref(py));
        match storage {
            Some(storage) => storage.get().set_iter(iter),
            None => Ok(()),
        }
    }

    /// TrainerBase's `before_step`: the storage's iteration follows the trainer's, then the
    /// hooks run. The one implementation, for the loop and for a subclass's `super()` call.
    fn do_before_step(&self, py: Python<'_>, iter: i64) -> PyResult<()> {
        self.iter.store(iter, Ordering::Relaxed);
        self.set_storage_iter(py, iter)?;
        self.call(py, Stage::BeforeStep, iter)
    }

    fn do_after_step(&self, py: Python<'_>, iter: i64) -> PyResult<()> {
        self.call(py, Stage::AfterStep, iter)
    }
}

#[pymethods]
impl PyDispatcher {
    /// `build(hooks)` lists, for the hooks in `hooks` (the trainer's list), the stage methods
    /// to call: `(hook_index, stage_index, function, self, period)`, calling `function(self)`
    /// (or `function()` when `self` is None), with period 0 for "every time".
    #[new]
    fn new(py: Python<'_>, hooks: Bound<'_, PyList>, build: Py<PyAny>) -> PyResult<Self> {
        start_clock();
        let built = Built {
            table: Table::default(),
            hooks: hooks.unbind(),
            copy: PyList::empty(py).unbind(),
        };
        Ok(PyDispatcher {
            build,
            built: Mutex::new(Arc::new(built)),
            storage: Mutex::new(None),
            max_iter: AtomicI64::new(i64::MAX),
            iter: AtomicI64::new(0),
            timing: AtomicBool::new(true),
        })
    }

    /// Starts a run: the hook list (`trainer._hooks`, re-read in case it was rebound), the
    /// storage whose iteration follows the trainer's, and `max_iter` for period filters. The
    /// table is rebuilt, so stage methods set on hook instances since are seen.
    fn begin(
        &self,
        py: Python<'_>,
        hooks: Bound<'_, PyList>,
        storage: Py<PyEventStorage>,
        max_iter: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        // The last iteration is max_iter - 1: it must be exact like every iteration.
        let max_iter = int64("max_iter", max_iter)?;
        hookloop_core::iter::exact_iter("max_iter", max_iter)
            .map_err(Error::from)
            .py_err()?;
        self.max_iter.store(max_iter, Ordering::Relaxed);
        let old = Self::lock(&self.storage).replace(storage);
        drop(old);
        self.rebuild(py, hooks.unbind(), false)?;
        Ok(())
    }

    fn before_train(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, Stage::BeforeTrain, 0)
    }

    /// TrainerBase's `after_train`: the storage's iteration is set to `iter`, then the hooks.
    fn after_train(&self, py: Python<'_>, iter: i64) -> PyResult<()> {
        self.set_storage_iter(py, iter)?;
        self.call(py, Stage::AfterTrain, iter)
    }

    fn before_step(&self, py: Python<'_>, iter: i64) -> PyResult<()> {
        self.do_before_step(py, iter)
    }

    fn after_step(&self, py: Python<'_>, iter: i64) -> PyResult<()> {
        self.do_after_step(py, iter)
    }

    fn after_backward(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, Stage::AfterBackward, self.iter.load(Ordering::Relaxed))
    }

    /// The hooks listed for `stage`, in call order (for tests and introspection).
    fn hooks_for<'py>(&self, py: Python<'py>, stage: &str) -> PyResult<Bound<'py, PyList>> {
        let idx = STAGES.iter().position(|s| *s == stage).ok_or_else(|| {
            to_py(Error::bad_value(
                format!("stage '{stage}'"),
                format!("is not one of {STAGES:?}"),
            ))
        })?;
        let stage = Stage::from_index(idx).unwrap_or(Stage::AfterStep);
        let built = self.current(py)?;
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

    /// The loop of `TrainerBase.train`: for each iteration, set `trainer.iter`, run
    /// before_step, `run_step()`, after_step. `before_step`/`after_step` are the trainer's own
    /// methods when a subclass overrides them; `None` means TrainerBase's, run here directly
    /// (the same code as `Dispatcher.before_step`/`after_step`).
    #[expect(clippy::too_many_arguments, reason = "mirrors the Python call")]
    #[pyo3(signature = (trainer, start_iter, max_iter, run_step, before_step = None, after_step = None))]
    fn run_loop(
        &self,
        py: Python<'_>,
        trainer: &Bound<'_, PyAny>,
        start_iter: i64,
        max_iter: i64,
        run_step: &Bound<'_, PyAny>,
        before_step: Option<&Bound<'_, PyAny>>,
        after_step: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let iter_name = intern!(py, "iter");
        // The run's storage, looked up once (begin set it): do_before_step's work without
        // its lock per iteration.
        let storage = Self::lock(&self.storage).as_ref().map(|s| s.clone_ref(py));
        for i in start_iter..max_iter {
            trainer.setattr(iter_name, i)?;
            match before_step {
                Some(f) => {
                    f.call0()?;
                }
                None => {
                    self.iter.store(i, Ordering::Relaxed);
                    if let Some(storage) = &storage {
                        storage.get().set_iter(i)?;
                    }
                    self.call(py, Stage::BeforeStep, i)?;
                }
            }
            run_step.call0()?;
            match after_step {
                Some(f) => {
                    f.call0()?;
                }
                None => self.do_after_step(py, i)?,
            }
            // A Ctrl-C while only Rust and C code ran would otherwise wait for Python bytecode.
            py.check_signals()?;
        }
        Ok(())
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(to_py(Error::NotPicklable {
            what: "hookloop Dispatcher",
            why: "it belongs to one trainer (save trainer.state_dict() instead)",
        }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.build)?;
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
        if let Ok(storage) = self.storage.try_lock() {
            if let Some(s) = storage.as_ref() {
                visit.call(s)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let storage = self.storage.try_lock().ok().and_then(|mut s| s.take());
        drop(storage);
    }
}
