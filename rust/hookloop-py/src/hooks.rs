//! The per-step half of `IterationTimer` (before_step/after_step). The rules are the core's
//! (`hookloop_core::hooks`); the base holds them with what they need, configured once per run
//! through typed methods (in `_core.pyi`), so no step reads a Python attribute by name. The
//! Python class in `hookloop.engine.hooks` subclasses this base and `HookBase`, keeps
//! detectron2's constructor, and does the rare stages in Python. (`LRScheduler` is all Python:
//! its step is torch's or `LRMultiplier`'s, which calls its native schedule once.)

use std::sync::Mutex;
use std::time::Instant;

use hookloop_core::hooks::IterationTimer;
use hookloop_core::Error;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

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
