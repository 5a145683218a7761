//! The per-step halves of the hooks that run at every iteration: `IterationTimer`'s
//! before_step/after_step and `LRScheduler`'s after_step. The rules are the core's
//! (`hookloop_core::hooks`); these bases hold them with what they need, configured once per run
//! through typed methods (in `_core.pyi`), so no step reads a Python attribute by name. The
//! Python classes in `hookloop.engine.hooks` subclass these bases and `HookBase`, keep
//! detectron2's constructors, and do the rare stages in Python.

use std::sync::Mutex;
use std::time::Instant;

use hookloop_core::hooks::{put_lr, IterationTimer};
use hookloop_core::Error;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};

use crate::convert::scalar_value;
use crate::errors::{to_py, IntoPyResult};
use crate::storage::PyEventStorage;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The error for a per-step call before the Python side configured the base.
fn not_started(hook: &str, stage: &str) -> PyErr {
    to_py(Error::bad_value(
        format!("{hook}.{stage}()"),
        format!(
            "ran before {hook}.before_train(): a subclass that overrides __init__ or before_train \
             must call super().__init__() and super().before_train()"
        ),
    ))
}

/// `trainer.storage`, which must be a hookloop `EventStorage`.
fn trainer_storage(trainer: &Bound<'_, PyAny>) -> PyResult<Py<PyEventStorage>> {
    let storage = trainer.getattr(intern!(trainer.py(), "storage"))?;
    let storage = storage.cast_into::<PyEventStorage>().map_err(|e| {
        to_py(Error::bad_value(
            "trainer.storage",
            format!(
                "must be a hookloop EventStorage, got {}",
                e.into_inner()
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ),
        ))
    })?;
    Ok(storage.unbind())
}

struct TimerState {
    timer: IterationTimer,
    /// Set by `__init__` through `_configure`: a subclass that skips it gets a clear error.
    configured: bool,
    storage: Option<Py<PyEventStorage>>,
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
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        PyIterationTimerBase {
            state: Mutex::new(TimerState {
                timer: IterationTimer::new(3),
                configured: false,
                storage: None,
            }),
        }
    }

    fn _configure(&self, warmup_iter: i64) {
        let mut s = lock(&self.state);
        s.timer.warmup_iter = warmup_iter;
        s.configured = true;
    }

    /// The number of iterations excluded from timing at the start.
    #[getter]
    fn _warmup_iter(&self) -> i64 {
        lock(&self.state).timer.warmup_iter
    }

    /// detectron2's `_warmup_iter` is a plain attribute that subclasses may set.
    #[setter(_warmup_iter)]
    fn set_warmup_iter(&self, warmup_iter: i64) {
        lock(&self.state).timer.warmup_iter = warmup_iter;
    }

    /// `before_train`: restarts both clocks and keeps the storage the step times go to. Without
    /// one (a hook driven before any trainer or storage exists, as detectron2's Lightning
    /// example does), each `after_step` reads `trainer.storage` and `trainer.start_iter`, as
    /// detectron2's does.
    #[pyo3(signature = (storage, start_iter))]
    fn _start(&self, storage: Option<Py<PyEventStorage>>, start_iter: i64) -> PyResult<()> {
        let mut s = lock(&self.state);
        if !s.configured {
            return Err(to_py(Error::bad_value(
                "IterationTimer",
                "was not configured: a subclass's __init__ must call super().__init__()",
            )));
        }
        s.timer.start(start_iter, Instant::now());
        let old = std::mem::replace(&mut s.storage, storage);
        drop(s);
        drop(old);
        Ok(())
    }

    /// (seconds since start, seconds inside steps): what `after_train` reports.
    fn _elapsed(&self) -> (f64, f64) {
        lock(&self.state).timer.elapsed(Instant::now())
    }

    fn before_step(&self) {
        lock(&self.state).timer.before_step(Instant::now());
    }

    fn after_step(slf: &Bound<'_, Self>) -> PyResult<()> {
        let now = Instant::now();
        let py = slf.py();
        let this = slf.get();
        let bound = lock(&this.state)
            .storage
            .as_ref()
            .map(|st| st.clone_ref(py));
        let (storage, start_iter) = match bound {
            Some(storage) => (storage, None),
            None => {
                // No storage from before_train: the trainer's, read now (no lock held).
                let trainer = slf.getattr(intern!(py, "trainer"))?;
                let storage = trainer_storage(&trainer)?;
                let start_iter: i64 = trainer.getattr(intern!(py, "start_iter"))?.extract()?;
                (storage, Some(start_iter))
            }
        };
        let mut s = lock(&this.state);
        if !s.configured {
            return Err(not_started("IterationTimer", "after_step"));
        }
        if let Some(start_iter) = start_iter {
            s.timer.set_start_iter(start_iter);
        }
        let timer = &mut s.timer;
        storage
            .get()
            .with(|core| timer.after_step_into(core, now))
            .py_err()
    }
}

struct LrState {
    optimizer: Option<Py<PyAny>>,
    scheduler: Option<Py<PyAny>>,
    group: usize,
    storage: Option<Py<PyEventStorage>>,
}

/// Base of `hookloop.engine.hooks.LRScheduler`: its per-step half. The optimizer, scheduler and
/// summarized param group live here (the Python attributes `_optimizer`, `_scheduler` and
/// `_best_param_group_id` are properties over them).
#[pyclass(name = "_LRSchedulerBase", module = "hookloop._core", subclass, frozen)]
pub struct PyLRSchedulerBase {
    state: Mutex<LrState>,
}

#[pymethods]
impl PyLRSchedulerBase {
    /// Takes any arguments, so that subclasses keep their own constructor signatures.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        PyLRSchedulerBase {
            state: Mutex::new(LrState {
                optimizer: None,
                scheduler: None,
                group: 0,
                storage: None,
            }),
        }
    }

    #[getter]
    fn _optimizer(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        lock(&self.state)
            .optimizer
            .as_ref()
            .map(|o| o.clone_ref(py))
    }

    #[setter(_optimizer)]
    fn set_optimizer(&self, optimizer: Option<Py<PyAny>>) {
        let old = std::mem::replace(&mut lock(&self.state).optimizer, optimizer);
        drop(old);
    }

    #[getter]
    fn _scheduler(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        lock(&self.state)
            .scheduler
            .as_ref()
            .map(|o| o.clone_ref(py))
    }

    #[setter(_scheduler)]
    fn set_scheduler(&self, scheduler: Option<Py<PyAny>>) {
        let old = std::mem::replace(&mut lock(&self.state).scheduler, scheduler);
        drop(old);
    }

    #[getter]
    fn _best_param_group_id(&self) -> usize {
        lock(&self.state).group
    }

    #[setter(_best_param_group_id)]
    fn set_best_param_group_id(&self, group: usize) {
        lock(&self.state).group = group;
    }

    /// `before_train`: the storage the LR goes to, for this run; without one, each `after_step`
    /// puts it into `trainer.storage`, read then (as detectron2's does).
    #[pyo3(signature = (storage))]
    fn _start(&self, storage: Option<Py<PyEventStorage>>) {
        let old = std::mem::replace(&mut lock(&self.state).storage, storage);
        drop(old);
    }

    /// Puts the LR of the summarized param group as "lr" (not smoothed), then steps the
    /// scheduler.
    fn after_step(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let (optimizer, scheduler, group, storage) = {
            let s = lock(&slf.get().state);
            (
                s.optimizer.as_ref().map(|o| o.clone_ref(py)),
                s.scheduler.as_ref().map(|o| o.clone_ref(py)),
                s.group,
                s.storage.as_ref().map(|o| o.clone_ref(py)),
            )
        };
        let (Some(optimizer), Some(scheduler)) = (optimizer, scheduler) else {
            return Err(not_started("LRScheduler", "after_step"));
        };
        let storage = match storage {
            Some(storage) => storage,
            None => trainer_storage(&slf.getattr(intern!(py, "trainer"))?)?,
        };
        let lr = optimizer
            .bind(py)
            .getattr(intern!(py, "param_groups"))?
            .get_item(group)?
            .get_item(intern!(py, "lr"))?;
        let lr = scalar_value("lr", &lr)?;
        storage.get().with(|core| put_lr(core, lr)).py_err()?;
        // scheduler.step(), through the one Python function that may skip torch's Python
        // between milestones (hookloop.solver.torch_step).
        static STEP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let step = STEP.get_or_try_init(py, || {
            py.import(intern!(py, "hookloop.solver.torch_step"))?
                .getattr(intern!(py, "step"))
                .map(Bound::unbind)
        })?;
        step.bind(py).call1((scheduler,))?;
        Ok(())
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Ok(s) = self.state.try_lock() {
            for o in [&s.optimizer, &s.scheduler].into_iter().flatten() {
                visit.call(o)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let taken = self
            .state
            .try_lock()
            .ok()
            .map(|mut s| (s.optimizer.take(), s.scheduler.take()));
        drop(taken);
    }
}
