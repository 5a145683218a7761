//! The per-step halves of hooks that run at every iteration, in Rust: `IterationTimer`'s
//! before_step/after_step and `PeriodicWriter`'s after_step. The Python classes in
//! `hookloop.engine.hooks` subclass these bases and `HookBase`, keep detectron2's
//! constructors, and do the rare stages (before_train, after_train) in Python.
//!
//! Python code between training steps runs with cold caches (the step evicted them), so a
//! few hundred nanoseconds of Python per hook measured in a tight loop cost microseconds in a
//! real loop; these bases keep the per-step work to a handful of C-API calls.

use std::sync::Mutex;
use std::time::Instant;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors::IntoPyResult;
use crate::storage::{lock, PyEventStorage};

/// fvcore's pausable `Timer`, reduced to what `IterationTimer` reads.
#[derive(Debug)]
struct Stopwatch {
    total: f64,
    running_since: Option<Instant>,
}

impl Stopwatch {
    fn paused() -> Self {
        Stopwatch {
            total: 0.0,
            running_since: None,
        }
    }

    fn resume(&mut self, now: Instant) {
        if self.running_since.is_none() {
            self.running_since = Some(now);
        }
    }

    fn pause(&mut self, now: Instant) {
        if let Some(since) = self.running_since.take() {
            self.total += now.duration_since(since).as_secs_f64();
        }
    }

    fn seconds(&self, now: Instant) -> f64 {
        self.total
            + self
                .running_since
                .map_or(0.0, |s| now.duration_since(s).as_secs_f64())
    }
}

#[derive(Debug)]
struct TimerState {
    /// Iterations at the start excluded from timing.
    warmup_iter: i64,
    /// When training (or, during warmup, the last warmup step) started.
    start: Instant,
    /// When the current step's before_step ran.
    step_start: Instant,
    /// Time inside steps after warmup (between this hook's before_step and after_step).
    in_steps: Stopwatch,
}

/// Base of `hookloop.engine.hooks.IterationTimer`.
#[pyclass(
    name = "_IterationTimerBase",
    module = "hookloop._core",
    subclass,
    frozen
)]
pub struct PyIterationTimerBase {
    state: Mutex<TimerState>,
}

#[pymethods]
impl PyIterationTimerBase {
    /// Takes any arguments, so that subclasses keep their own constructor signatures; the
    /// Python `__init__` configures it with `_configure`.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(
        _args: &Bound<'_, pyo3::types::PyTuple>,
        _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> Self {
        let now = Instant::now();
        let state = TimerState {
            warmup_iter: 3,
            start: now,
            step_start: now,
            in_steps: Stopwatch::paused(),
        };
        PyIterationTimerBase {
            state: Mutex::new(state),
        }
    }

    fn _configure(&self, warmup_iter: i64) {
        lock(&self.state).warmup_iter = warmup_iter;
    }

    /// The number of iterations excluded from timing at the start.
    #[getter]
    fn _warmup_iter(&self) -> i64 {
        lock(&self.state).warmup_iter
    }

    /// Restarts both clocks (called from `before_train`).
    fn _start(&self) {
        let mut s = lock(&self.state);
        s.start = Instant::now();
        s.in_steps = Stopwatch::paused();
    }

    /// (seconds since start, seconds inside steps): what `after_train` reports.
    fn _elapsed(&self) -> (f64, f64) {
        let s = lock(&self.state);
        let now = Instant::now();
        (
            now.duration_since(s.start).as_secs_f64(),
            s.in_steps.seconds(now),
        )
    }

    fn before_step(&self) {
        let now = Instant::now();
        let mut s = lock(&self.state);
        s.step_start = now;
        s.in_steps.resume(now);
    }

    fn after_step(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let now = Instant::now();
        let trainer = slf.getattr(intern!(py, "trainer"))?;
        let storage = trainer.getattr(intern!(py, "storage"))?;
        let storage = storage.cast::<PyEventStorage>()?.get();
        let start_iter: i64 = trainer.getattr(intern!(py, "start_iter"))?.extract()?;
        let this = slf.get();
        let mut s = lock(&this.state);
        let mut state = storage.lock();
        // +1 because we're in after_step, the current step is done but not yet counted
        let iter_done = state.core.iter() - start_iter + 1;
        if iter_done >= s.warmup_iter {
            let sec = now.duration_since(s.step_start).as_secs_f64();
            state.core.put_scalar("time", sec, true, None).py_err()?;
            s.in_steps.pause(now);
        } else {
            s.start = now;
            s.in_steps = Stopwatch::paused();
        }
        Ok(())
    }
}

/// Base of `hookloop.engine.hooks.PeriodicWriter`: the per-step period check.
#[pyclass(
    name = "_PeriodicWriterBase",
    module = "hookloop._core",
    subclass,
    frozen
)]
pub struct PyPeriodicWriterBase {
    config: Mutex<(Py<PyList>, i64)>,
}

#[pymethods]
impl PyPeriodicWriterBase {
    /// Takes any arguments, so that subclasses keep their own constructor signatures; the
    /// Python `__init__` configures it with `_configure`.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(
        py: Python<'_>,
        _args: &Bound<'_, pyo3::types::PyTuple>,
        _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> Self {
        PyPeriodicWriterBase {
            config: Mutex::new((PyList::empty(py).unbind(), 20)),
        }
    }

    /// Sets the writers (any iterable, kept as a list) and the period (positive).
    fn _configure(&self, writers: &Bound<'_, PyAny>, period: i64) -> PyResult<()> {
        if period <= 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "PeriodicWriter period must be a positive int, got {period}"
            )));
        }
        let list = PyList::new(
            writers.py(),
            writers.try_iter()?.collect::<PyResult<Vec<_>>>()?,
        )?;
        let old = std::mem::replace(&mut *lock(&self.config), (list.unbind(), period));
        drop(old); // after unlocking: dropping the old list may run Python code
        Ok(())
    }

    /// The writers, in order (a list; edits are honoured).
    #[getter]
    fn _writers(&self, py: Python<'_>) -> Py<PyList> {
        lock(&self.config).0.clone_ref(py)
    }

    #[getter]
    fn _period(&self) -> i64 {
        lock(&self.config).1
    }

    fn after_step(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let (writers, period) = {
            let config = lock(&slf.get().config);
            (config.0.clone_ref(py), config.1)
        };
        let trainer = slf.getattr(intern!(py, "trainer"))?;
        let iter: i64 = trainer.getattr(intern!(py, "iter"))?.extract()?;
        let due = (iter + 1) % period == 0 || {
            let max_iter: i64 = trainer.getattr(intern!(py, "max_iter"))?.extract()?;
            iter == max_iter - 1
        };
        if due {
            // The lock is not held here: a writer may reconfigure this hook.
            for w in writers.bind(py).iter() {
                w.call_method0(intern!(py, "write"))?;
            }
        }
        Ok(())
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Ok(config) = self.config.try_lock() {
            visit.call(&config.0)?;
        }
        Ok(())
    }
}

/// Base of `hookloop.engine.hooks.LRScheduler`: its per-step half. The Python class keeps
/// `_optimizer`, `_scheduler` and `_best_param_group_id` as attributes (detectron2's names);
/// this reads them at each step, so changing them takes effect at the next step.
#[pyclass(name = "_LRSchedulerBase", module = "hookloop._core", subclass, frozen)]
pub struct PyLRSchedulerBase;

#[pymethods]
impl PyLRSchedulerBase {
    /// Takes any arguments, so that subclasses keep their own constructor signatures.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(
        _args: &Bound<'_, pyo3::types::PyTuple>,
        _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> Self {
        PyLRSchedulerBase
    }

    /// Puts the LR of the summarized param group as "lr" (not smoothed), then steps the
    /// scheduler (`_scheduler`, else `trainer.scheduler`).
    fn after_step(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let group = slf.getattr(intern!(py, "_best_param_group_id"))?;
        let lr = slf
            .getattr(intern!(py, "_optimizer"))?
            .getattr(intern!(py, "param_groups"))?
            .get_item(group)?
            .get_item(intern!(py, "lr"))?;
        let lr = crate::convert::scalar_value("lr", &lr)?;
        let trainer = slf.getattr(intern!(py, "trainer"))?;
        let storage = trainer.getattr(intern!(py, "storage"))?;
        storage
            .cast::<PyEventStorage>()?
            .get()
            .lock()
            .core
            .put_scalar("lr", lr, false, None)
            .py_err()?;
        let scheduler = slf.getattr(intern!(py, "_scheduler"))?;
        let scheduler = if scheduler.is_truthy()? {
            scheduler
        } else {
            trainer.getattr(intern!(py, "scheduler"))?
        };
        scheduler.call_method0(intern!(py, "step"))?;
        Ok(())
    }
}
