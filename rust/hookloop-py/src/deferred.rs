//! What an `EventStorage` holds but has not read yet, and the reads that put it: the trainer's
//! deferred losses (a Python settle function, see `SimpleTrainer`) and tensors put on a device
//! (`put_scalar` of a CUDA tensor, read in one batch). Shared by the storage and by its
//! `HistoryBuffer` views, so that every read of the scalars, through either, settles first.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use hookloop_core::iter::Iter;
use hookloop_core::{Error, Storage};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyList;
use pyo3::{intern, PyTraverseError, PyVisit};

use crate::errors::{to_py, IntoPyResult};
use crate::state::SharedState;

/// The waiting values of one storage.
pub struct Deferred {
    state: SharedState,
    /// Values put but not read yet (losses kept as tensors, see `SimpleTrainer`): set by
    /// `defer` (`EventStorage._defer`), cleared by `settle`, which every read of the scalars
    /// calls first.
    pending: AtomicBool,
    /// What `settle` calls to put the pending values (a Python function).
    settler: Mutex<Option<Py<PyAny>>>,
    /// Tensors put on a device (`put_scalar` of a CUDA tensor), not read yet: read in one
    /// batch by `settle`, before the next read of the scalars. `device_pending` says whether
    /// there are any, without the lock.
    device: Mutex<DevicePuts>,
    device_pending: AtomicBool,
}

/// The deferred puts of device tensors, in the order they were made.
#[derive(Default)]
struct DevicePuts {
    puts: Vec<DevicePut>,
    /// Their full names: a put of a plain value under one of them reads them first (a
    /// history keeps its values in the order they were put).
    names: HashSet<String>,
}

/// One deferred put: its name and iteration fixed when it was made (`Storage::resolve_put`).
struct DevicePut {
    name: String,
    hint: bool,
    iter: Iter,
    value: Py<PyAny>,
}

/// At most this many device tensors wait for a read; the next put reads them all (one
/// synchronization per device), so a run that never reads its storage holds a bounded number.
const MAX_DEVICE_PUTS: usize = 1024;

impl Deferred {
    pub fn new(state: SharedState) -> Self {
        Deferred {
            state,
            pending: AtomicBool::new(false),
            settler: Mutex::new(None),
            device: Mutex::new(DevicePuts::default()),
            device_pending: AtomicBool::new(false),
        }
    }

    /// The storage's state.
    pub fn state(&self) -> &SharedState {
        &self.state
    }

    /// Runs `f` on the core storage under the lock.
    fn with<R>(&self, f: impl FnOnce(&mut Storage) -> R + Send) -> R {
        self.state.with(|s| f(&mut s.core))
    }

    /// Marks values as pending: before the next read of the scalars, `settle` is called once
    /// (it puts them).
    pub fn defer(&self, settle: Py<PyAny>) {
        self.with(Storage::mark_deferred);
        let old = self
            .settler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(settle);
        self.pending.store(true, Ordering::Release);
        drop(old);
    }

    /// Whether device tensors wait (no lock).
    pub fn device_pending(&self) -> bool {
        self.device_pending.load(Ordering::Acquire)
    }

    /// Puts what waits: the waiting device tensors, then the values deferred with `defer`
    /// (the trainer's losses).
    pub fn settle(&self, py: Python<'_>) -> PyResult<()> {
        if self.device_pending.load(Ordering::Acquire) {
            self.settle_device(py)?;
        }
        if !self.pending.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let settler = self
            .settler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|s| s.clone_ref(py));
        let settled = match settler {
            Some(f) => f.bind(py).call0().map(drop),
            None => Ok(()),
        };
        self.with(Storage::end_deferred);
        settled
    }

    /// Reads every deferred device tensor (`hookloop.utils._tensors.read_scalars`: one stack
    /// and one copy to the host per device) and puts the values under the names and
    /// iterations fixed when they were put. A failed read drops them and raises its error.
    pub fn settle_device(&self, py: Python<'_>) -> PyResult<()> {
        let puts = {
            let mut q = self.device.lock().unwrap_or_else(|e| e.into_inner());
            self.device_pending.store(false, Ordering::Release);
            q.names.clear();
            std::mem::take(&mut q.puts)
        };
        if puts.is_empty() {
            return Ok(());
        }
        // The module is kept, its function looked up at each read (once per batch).
        static TENSORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
        let module = TENSORS.get_or_try_init(py, || {
            py.import(intern!(py, "hookloop.utils._tensors"))
                .map(Bound::unbind)
        })?;
        let read = module.bind(py).getattr(intern!(py, "read_scalars"))?;
        let tensors = PyList::new(py, puts.iter().map(|p| p.value.bind(py)))?;
        let values: Vec<f64> = read.call1((tensors,))?.extract()?;
        if values.len() != puts.len() {
            return Err(to_py(Error::bad_value(
                "read_scalars",
                format!(
                    "returned {} values for {} tensors",
                    values.len(),
                    puts.len()
                ),
            )));
        }
        let result = self.with(|s| {
            puts.iter()
                .zip(&values)
                .try_for_each(|(p, v)| s.put_at(&p.name, *v, p.hint, p.iter))
        });
        drop(puts); // the tensors, released after the lock
        result.py_err()
    }

    /// Keeps device tensors for the next read instead of reading them now (a read would
    /// wait for the device): each with the name and iteration of this moment.
    pub fn defer_device(
        &self,
        py: Python<'_>,
        items: Vec<(&str, Bound<'_, PyAny>)>,
        hint: bool,
        it: Option<Iter>,
    ) -> PyResult<()> {
        let names: Vec<&str> = items.iter().map(|(name, _)| *name).collect();
        let resolved = self
            .with(|s| {
                names
                    .iter()
                    .map(|name| s.resolve_put(name, hint, it))
                    .collect::<Result<Vec<_>, _>>()
            })
            .py_err()?;
        // Kept detached: a tensor that requires grad would keep its autograd graph (and the
        // activations it saved) alive until the read.
        let values = items
            .iter()
            .map(|(_, v)| {
                if v.getattr(intern!(py, "requires_grad"))?.is_truthy()? {
                    v.call_method0(intern!(py, "detach")).map(Bound::unbind)
                } else {
                    Ok(v.clone().unbind())
                }
            })
            .collect::<PyResult<Vec<_>>>()?;
        let full = {
            let mut q = self.device.lock().unwrap_or_else(|e| e.into_inner());
            for ((name, iter), value) in resolved.into_iter().zip(values) {
                q.names.insert(name.clone());
                q.puts.push(DevicePut {
                    name,
                    hint,
                    iter,
                    value,
                });
            }
            self.device_pending.store(true, Ordering::Release);
            q.puts.len() >= MAX_DEVICE_PUTS
        };
        if full {
            self.settle_device(py)?;
        }
        Ok(())
    }

    /// Before a plain value is put under `name`: the device tensors deferred under the same
    /// full name are read first, so its history keeps the order of the puts.
    #[inline]
    pub fn settle_device_of(&self, py: Python<'_>, names: &[&str]) -> PyResult<()> {
        if !self.device_pending.load(Ordering::Acquire) {
            return Ok(()); // every put of a plain number (no device tensor waits)
        }
        self.settle_waiting_device_of(py, names)
    }

    fn settle_waiting_device_of(&self, py: Python<'_>, names: &[&str]) -> PyResult<()> {
        let full: Vec<String> = self.with(|s| names.iter().map(|n| s.full_name(n)).collect());
        let waiting = {
            let q = self.device.lock().unwrap_or_else(|e| e.into_inner());
            full.iter().any(|n| q.names.contains(n))
        };
        if waiting {
            self.settle_device(py)?;
        }
        Ok(())
    }

    /// The Python objects held: the settle function and the waiting tensors.
    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(settler) = self.settler.try_lock() {
            if let Some(s) = settler.as_ref() {
                visit.call(s)?;
            }
        }
        if let Ok(q) = self.device.try_lock() {
            for p in &q.puts {
                visit.call(&p.value)?;
            }
        }
        Ok(())
    }

    /// Drops the Python objects held (garbage collection's clear).
    pub fn clear(&self) {
        let settler = self.settler.try_lock().ok().and_then(|mut s| s.take());
        drop(settler);
        let device = self.device.try_lock().ok().map(|mut q| {
            q.names.clear();
            std::mem::take(&mut q.puts)
        });
        drop(device);
    }
}
