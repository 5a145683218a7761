//! The binding side of the storage's one pending-scalar queue (core `pending`): converting the
//! Python values put, and executing what the queue decides. The queue itself (what waits,
//! when a read is due, what a read does now and in which order, how values are stored) is the
//! core's and lives in the storage's state; this module converts values, handles the GIL and
//! the locks, and runs the core's [`Action`]s and [`Step`]s.
//!
//! How a batch is read (the functions `hookloop.utils._tensors` registers at its import with
//! `_register_tensor_reads`; the extension imports nothing of the package): values on the
//! host with `item()` each (cheaper than stacking small tensors); device values with one stack
//! and one copy per device (`read_scalars`); a due read of CUDA values is only *started*
//! (`start_read`: a copy into pinned memory and an event, not waited for) and finished at the
//! next read.
//!
//! Shared by the storage and its `HistoryBuffer` views, so that every read of the scalars,
//! through either, settles first.
//!
//! Each read tells the core which thread it is on (`std::thread::current().id()`): the core
//! keeps a non-finite loss found on a thread other than the one recording the losses for that
//! thread (core `Pending::store`, `Pending::recording`).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::thread::{self, ThreadId};

use hookloop_core::iter::Iter;
use hookloop_core::pending::{Action, Batch, Due, Read, Reading, Record, Step, Taken};
use hookloop_core::Storage;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{intern, PyTraverseError, PyVisit};

use crate::convert::scalar_value;
use crate::errors::{to_py, unregistered, IntoPyResult};
use crate::state::{Queue, SharedState};

thread_local! {
    /// Whether this thread is inside a settle (a value's `item()` that reads the storage again
    /// finds nothing to wait for, instead of a deadlock).
    static SETTLING: Cell<bool> = const { Cell::new(false) };
}

/// A loss dict's key objects and their names.
type KeyNames = (Vec<Py<PyString>>, Arc<[String]>);

/// A storage's state with its pending values.
pub struct Waiting {
    state: SharedState,
    /// Whether anything may wait in the queue: every read checks this without the lock.
    any: AtomicBool,
    /// One settle at a time: a reader on another thread waits for a settle under way, so it
    /// never sees the storage without the values that settle took.
    settling: Mutex<()>,
    /// The last loss dict's keys and their names (`names_of`).
    names: Mutex<KeyNames>,
}

impl Waiting {
    pub fn new(state: SharedState) -> Self {
        Waiting {
            state,
            any: AtomicBool::new(false),
            settling: Mutex::new(()),
            names: Mutex::new((Vec::new(), Arc::from([]))),
        }
    }

    /// The storage's state.
    pub fn state(&self) -> &SharedState {
        &self.state
    }

    fn with<R>(&self, f: impl FnOnce(&mut Storage, &mut Queue) -> R + Send) -> R {
        self.state.with(|s| f(&mut s.core, &mut s.pending))
    }

    /// Queues one iteration's losses (`SimpleTrainer`'s, read later by `write_metrics`' rule).
    pub fn record_losses(
        &self,
        py: Python<'_>,
        iter: Iter,
        data_time: f64,
        losses: &Bound<'_, PyDict>,
        prefix: &str,
    ) -> PyResult<()> {
        let names = self.names_of(losses)?;
        let values: Vec<Py<PyAny>> = losses.iter().map(|(_, v)| v.unbind()).collect();
        let prefix = prefix.to_owned();
        let thread = thread::current().id();
        let pushed = self.with(move |s, q| match q.recording(thread) {
            // A failure a read on another thread kept for this one: raised, nothing queued.
            Err(kept) => Err((kept, values)),
            Ok(()) => {
                let due = q.push_losses(s, iter, data_time, prefix, names, values);
                self.any.store(true, Ordering::Release);
                Ok(due)
            }
        });
        let due = match pushed {
            Ok(due) => due.py_err()?,
            Err((kept, values)) => {
                drop(values); // the tensors, released after the lock
                return Err(raise_kept(py, kept));
            }
        };
        self.on_due(py, due)
    }

    /// The names of a loss dict's keys, shared with the previous record when its keys are the
    /// same string objects (a model's dict keys usually are): no `String` per loss per step.
    fn names_of(&self, losses: &Bound<'_, PyDict>) -> PyResult<Arc<[String]>> {
        let mut cache = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let (keys, names) = &*cache;
        if keys.len() == losses.len() && losses.iter().zip(keys).all(|((k, _), c)| k.is(c)) {
            return Ok(names.clone());
        }
        let mut keys = Vec::with_capacity(losses.len());
        let mut names = Vec::with_capacity(losses.len());
        for k in losses.keys() {
            let k = k.cast_into::<PyString>().map_err(|_| {
                to_py(hookloop_core::Error::wrong_type(
                    "loss_dict keys",
                    "str",
                    "another type",
                ))
            })?;
            names.push(k.to_str()?.to_owned());
            keys.push(k.unbind());
        }
        let names: Arc<[String]> = names.into();
        *cache = (keys, names.clone());
        Ok(names)
    }

    /// Queues device tensors put with `put_scalar`, each with the name and iteration of this
    /// moment (a read now would wait for the device).
    pub fn put_device(
        &self,
        py: Python<'_>,
        items: Vec<(&str, Bound<'_, PyAny>)>,
        hint: bool,
        it: Option<Iter>,
    ) -> PyResult<()> {
        // Kept detached: a tensor that requires grad would keep its autograd graph (and the
        // activations it saved) alive until the read.
        let mut puts = Vec::with_capacity(items.len());
        for (name, v) in items {
            let v = if v.getattr(intern!(py, "requires_grad"))?.is_truthy()? {
                v.call_method0(intern!(py, "detach"))?
            } else {
                v
            };
            puts.push((name, v.unbind()));
        }
        let due = self
            .with(|s, q| {
                let mut due = Due::Nothing;
                for (name, value) in puts {
                    let (full, iter) = s.resolve_put(name, hint, it)?;
                    due = q.push_put(s, full, hint, iter, value);
                    self.any.store(true, Ordering::Release);
                }
                Ok(due)
            })
            .py_err()?;
        self.on_due(py, due)
    }

    /// Before plain values are put under `names`: a waiting put of the same full name is read
    /// first, so its history keeps the order of the puts.
    #[inline]
    pub fn settle_of(&self, py: Python<'_>, names: &[&str]) -> PyResult<()> {
        if !self.any.load(Ordering::Acquire) {
            return Ok(()); // every put of a plain number while nothing waits
        }
        let waits = self.with(|s, q| names.iter().any(|n| q.waits_for(&s.full_name(n))));
        if waits {
            self.settle(py)?;
        }
        Ok(())
    }

    fn on_due(&self, py: Python<'_>, due: Due) -> PyResult<()> {
        match due {
            Due::Nothing => Ok(()),
            Due::Read => self.settle(py),
            Due::Start => self.start(py),
        }
    }

    /// Stores everything that waits (what every read of the scalars calls first). On the
    /// thread that records the losses, a failure another thread's read kept is raised instead
    /// (what waits came after it and is dropped).
    pub fn settle(&self, py: Python<'_>) -> PyResult<()> {
        if !self.any.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some(_guard) = self.lock_settling(py) else {
            return Ok(());
        };
        let thread = thread::current().id();
        let action = self.with(|s, q| {
            self.any.store(false, Ordering::Release);
            q.settle(s, thread)
        });
        self.execute(py, action, thread)
    }

    /// Before a checkpoint save: everything waiting is stored, then a non-finite loss found in
    /// this storage (now or earlier, on any thread) refuses the save (core
    /// `Pending::before_save`).
    pub fn settle_before_save(&self, py: Python<'_>) -> PyResult<()> {
        self.settle(py)?;
        let thread = thread::current().id();
        self.with(|_, q| q.before_save(thread)).py_err()
    }

    /// A due read (`Due::Start`): what the core decides (start the batch's read, or read
    /// everything now), executed.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let Some(_guard) = self.lock_settling(py) else {
            return Ok(());
        };
        // `any` cleared with the take, under the lock (as `settle` does): a record made by
        // another thread meanwhile sets it again.
        let action = self.with(|_, q| {
            self.any.store(false, Ordering::Release);
            q.due_read()
        });
        self.execute(py, action, thread::current().id())
    }

    /// Executes the core's `action` on `thread`, with the settle lock held.
    fn execute(
        &self,
        py: Python<'_>,
        action: Action<Py<PyAny>, Py<PyAny>>,
        thread: ThreadId,
    ) -> PyResult<()> {
        match action {
            Action::Raise { error, dropped } => {
                drop(dropped); // the tensors, released after the lock
                Err(raise_kept(py, error))
            }
            Action::Read(taken) => self.read(py, taken, thread),
            Action::Start { started, batch } => match start_read(py, &batch.values) {
                Some(read) => {
                    let values = self.with(|_, q| {
                        let values = q.started(started, batch, read);
                        self.any.store(true, Ordering::Release);
                        values
                    });
                    drop(values); // the tensors, released after the lock
                    Ok(())
                }
                // Not CUDA, or start_read failed: read now, in order, after the reads started
                // earlier (nothing taken is dropped unread).
                None => self.read(
                    py,
                    Taken {
                        started,
                        waiting: batch,
                    },
                    thread,
                ),
            },
        }
    }

    /// Reads and stores what was taken, on `thread`, in the core's order (`Reading`): the
    /// started reads, then the waiting batch, until a step is not stored. The first error is
    /// raised; when the batch that failed held a trainer's losses, it is logged first as
    /// detectron2's `_write_metrics` logs it. A non-finite loss that the core keeps for the
    /// thread that records the losses stops it too, without an error here.
    fn read(
        &self,
        py: Python<'_>,
        taken: Taken<Py<PyAny>, Py<PyAny>>,
        thread: ThreadId,
    ) -> PyResult<()> {
        let mut reading = Reading::new(taken);
        let mut result = Ok(());
        let mut ended = false;
        while let Some(step) = reading.next_step() {
            let (records, stored) = match &step {
                Step::Finish(s) => (
                    &s.records,
                    finish_read(py, &s.read).and_then(|values| {
                        self.with(|st, q| q.store(st, &s.records, &values, thread))
                            .py_err()
                    }),
                ),
                // Stored, and the read ended, under one lock.
                Step::Read(batch) => (
                    &batch.records,
                    read_values(py, batch).and_then(|values| {
                        self.with(|st, q| {
                            let stored = q.store(st, &batch.records, &values, thread);
                            self.ended(q.end_read(st));
                            ended = true;
                            stored
                        })
                        .py_err()
                    }),
                ),
            };
            if let Err(e) = &stored {
                log_failed_write(py, records, e);
            }
            reading.after_step(matches!(stored, Ok(Read::Stored)));
            result = stored.map(drop);
            drop(step); // the tensors, released after the lock
        }
        if !ended {
            self.with(|st, q| self.ended(q.end_read(st)));
        }
        drop(reading);
        result
    }

    /// After a read: every later read must reach the queue while a failure waits there for the
    /// owner (`kept`).
    fn ended(&self, kept: bool) {
        if kept {
            self.any.store(true, Ordering::Release);
        }
    }

    /// The settle lock, waited for without the GIL (the holder may need it to finish); None on
    /// a thread already settling.
    fn lock_settling(&self, py: Python<'_>) -> Option<SettleGuard<'_>> {
        if SETTLING.with(Cell::get) {
            return None;
        }
        let guard = loop {
            match self.settling.try_lock() {
                Ok(g) => break g,
                Err(TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(TryLockError::WouldBlock) => py.detach(|| {
                    drop(self.settling.lock());
                }),
            }
        };
        SETTLING.with(|s| s.set(true));
        Some(SettleGuard { _lock: guard })
    }

    /// The Python objects held: the waiting values and started reads.
    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.state
            .try_visit(|s| {
                let (values, reads) = s.pending.held();
                values.chain(reads).try_for_each(|v| visit.call(v))
            })
            .unwrap_or(Ok(()))
    }

    /// Drops the Python objects held (garbage collection's clear).
    pub fn clear(&self) {
        let taken = self.state.try_with(|s| s.pending.take());
        self.any.store(false, Ordering::Release);
        drop(taken);
    }
}

/// Held while settling: the lock, and this thread's flag (cleared on drop).
struct SettleGuard<'a> {
    _lock: MutexGuard<'a, ()>,
}

impl Drop for SettleGuard<'_> {
    fn drop(&mut self) {
        SETTLING.with(|s| s.set(false));
    }
}

/// A failure another thread's read kept for this one, as the error to raise: logged first, as
/// the read that found it would have logged it on this thread.
fn raise_kept(py: Python<'_>, kept: hookloop_core::Error) -> PyErr {
    let error = to_py(kept);
    write_failed(py, &error);
    error
}

/// Logs a failed read of a batch that held a trainer's losses.
fn log_failed_write(py: Python<'_>, records: &[Record], error: &PyErr) {
    if records.iter().any(|r| matches!(r, Record::Losses { .. })) {
        write_failed(py, error);
    }
}

/// Logs a failed store of a trainer's losses as detectron2's `_write_metrics` logs it
/// (`_tensors.write_failed`); a failure to log is reported as unraisable, never instead of the
/// error itself.
fn write_failed(py: Python<'_>, error: &PyErr) {
    let logged = tensor_reads(py).and_then(|r| r.failed.bind(py).call1((error.value(py),)));
    if let Err(e) = logged {
        e.write_unraisable(py, None);
    }
}

/// The reads of tensors the queue runs, handed over by `hookloop.utils._tensors` at its import.
struct TensorReads {
    /// `read_scalars(values) -> list[float]`: one batched read.
    read: Py<PyAny>,
    /// `start_read(values) -> handle | None`: a started read, finished by `handle.values()`.
    start: Py<PyAny>,
    /// `write_failed(error)`: logs a failed store of a trainer's losses.
    failed: Py<PyAny>,
}

static TENSOR_READS: PyOnceLock<TensorReads> = PyOnceLock::new();

/// Registers the functions the storage's pending queue reads tensors with (called once, by
/// `hookloop.utils._tensors` at its import). The first registration stands: a reload of the
/// module registers functions that look the same names up in the same module.
#[pyfunction]
pub fn _register_tensor_reads(
    py: Python<'_>,
    read_scalars: Py<PyAny>,
    start_read: Py<PyAny>,
    write_failed: Py<PyAny>,
) {
    let reads = TensorReads {
        read: read_scalars,
        start: start_read,
        failed: write_failed,
    };
    drop(TENSOR_READS.set(py, reads));
}

fn tensor_reads(py: Python<'_>) -> PyResult<&TensorReads> {
    TENSOR_READS
        .get(py)
        .ok_or_else(|| unregistered("the storage's tensor reads", "hookloop.utils._tensors"))
}

/// A started read of `values` (`start_read`); None when it cannot start (not CUDA values, or
/// the start failed): the caller reads them now.
fn start_read(py: Python<'_>, values: &[Py<PyAny>]) -> Option<Py<PyAny>> {
    let start = &tensor_reads(py).ok()?.start;
    PyList::new(py, values.iter().map(|v| v.bind(py)))
        .and_then(|values| start.bind(py).call1((values,)))
        .ok()
        .filter(|r| !r.is_none())
        .map(Bound::unbind)
}

/// The values of a started read (its `values()`, which waits for the copy).
fn finish_read(py: Python<'_>, read: &Py<PyAny>) -> PyResult<Vec<f64>> {
    read.bind(py)
        .call_method0(intern!(py, "values"))?
        .extract::<Vec<f64>>()
}

/// The values of a waiting batch, in order. Read on the host (the first value is a number or
/// a CPU tensor): `item()` each, an error naming the value's metric; else one batched read.
fn read_values(py: Python<'_>, batch: &Batch<Py<PyAny>>) -> PyResult<Vec<f64>> {
    let Some(first) = batch.values.first() else {
        return Ok(Vec::new());
    };
    if on_host(first.bind(py)) {
        let mut out = Vec::with_capacity(batch.values.len());
        let mut values = batch.values.iter();
        let mut read = |name: &str| match values.next() {
            Some(v) => scalar_value(name, v.bind(py)).map(|v| out.push(v)),
            None => Ok(()), // fewer values than names: apply() reports it
        };
        for r in &batch.records {
            match r {
                Record::Losses { names, .. } => names.iter().try_for_each(|n| read(n))?,
                Record::Put { name, .. } => read(name)?,
            }
        }
        return Ok(out);
    }
    let values = PyList::new(py, batch.values.iter().map(|v| v.bind(py)))?;
    tensor_reads(py)?.read.bind(py).call1((values,))?.extract()
}

/// Whether a value is read on the host: anything but a tensor whose `is_cpu` is false.
fn on_host(value: &Bound<'_, PyAny>) -> bool {
    match value.getattr(intern!(value.py(), "is_cpu")) {
        Ok(cpu) => cpu.is_truthy().unwrap_or(true),
        Err(_) => true,
    }
}
