//! The binding side of the storage's one pending-scalar queue (core `pending`): converting the
//! Python values put, and reading them. The queue itself (what waits, when a read is due, how
//! values are stored) is the core's and lives in the storage's state; this module holds only
//! what needs Python.
//!
//! How a batch is read (`hookloop.utils._tensors`): values on the host with `item()` each
//! (cheaper than stacking small tensors); device values with one stack and one copy per
//! device (`read_scalars`); a due read of CUDA values is only *started* (`start_read`: a copy
//! into pinned memory and an event, not waited for) and finished at the next read.
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
use hookloop_core::pending::{Batch, Due, Read, Record, Started, Taken};
use hookloop_core::Storage;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{intern, PyTraverseError, PyVisit};

use crate::convert::scalar_value;
use crate::errors::{to_py, IntoPyResult};
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
        let (kept, taken) = self.with(|s, q| {
            self.any.store(false, Ordering::Release);
            match q.take_kept(thread) {
                Some(kept) => {
                    let dropped = q.take();
                    end_if_empty(s, q);
                    (Some(kept), dropped)
                }
                None => (None, q.take()),
            }
        });
        if let Some(kept) = kept {
            drop(taken); // the tensors, released after the lock
            return Err(raise_kept(py, kept));
        }
        self.read(py, taken, thread)
    }

    /// Before a checkpoint save: everything waiting is stored, then a non-finite loss found in
    /// this storage (now or earlier, on any thread) refuses the save (core
    /// `Pending::before_save`).
    pub fn settle_before_save(&self, py: Python<'_>) -> PyResult<()> {
        self.settle(py)?;
        let thread = thread::current().id();
        self.with(|_, q| q.before_save(thread)).py_err()
    }

    /// A due read: CUDA values start their copy to the host (not waited for) while fewer
    /// than the limit's started reads wait; anything else is read now.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let Some(_guard) = self.lock_settling(py) else {
            return Ok(());
        };
        // `any` cleared with the take, under the lock (as `settle` does): a record made by
        // another thread meanwhile sets it again.
        let (may_start, taken) = self.with(|_, q| {
            self.any.store(false, Ordering::Release);
            (q.may_start(), q.take())
        });
        let Taken {
            mut started,
            waiting,
        } = taken;
        if may_start && !waiting.values.is_empty() {
            // A read that cannot be started (not CUDA, or start_read failed) is done now, in
            // order, after the reads started earlier: nothing taken is dropped unread.
            let read = PyList::new(py, waiting.values.iter().map(|v| v.bind(py)))
                .and_then(|values| {
                    tensors(py)?
                        .getattr(intern!(py, "start_read"))?
                        .call1((values,))
                })
                .ok()
                .filter(|r| !r.is_none());
            if let Some(read) = read {
                started.push(Started {
                    records: waiting.records,
                    read: read.unbind(),
                });
                self.with(|_, q| {
                    q.restore_started(started);
                    self.any.store(true, Ordering::Release);
                });
                return Ok(()); // waiting.values (the tensors) released here, after the lock
            }
        }
        self.read(py, Taken { started, waiting }, thread::current().id())
    }

    /// Reads and stores what was taken, on `thread`: the started reads, then the waiting
    /// batch. The first error stops it (what comes after is dropped) and is raised; when the
    /// batch that failed held a trainer's losses, it is logged first as detectron2's
    /// `_write_metrics` logs it. A non-finite loss that the core keeps for the thread that
    /// records the losses stops it too, without an error here.
    fn read(
        &self,
        py: Python<'_>,
        taken: Taken<Py<PyAny>, Py<PyAny>>,
        thread: ThreadId,
    ) -> PyResult<()> {
        let Taken { started, waiting } = taken;
        let mut result = Ok(Read::Stored);
        for s in &started {
            result = s
                .read
                .bind(py)
                .call_method0(intern!(py, "values"))
                .and_then(|v| v.extract::<Vec<f64>>())
                .and_then(|values| {
                    self.with(|st, q| q.store(st, &s.records, &values, thread))
                        .py_err()
                });
            if let Err(e) = &result {
                log_failed_write(py, &s.records, e);
            }
            if !matches!(result, Ok(Read::Stored)) {
                break;
            }
        }
        let mut ended = false;
        if matches!(result, Ok(Read::Stored)) && !waiting.records.is_empty() {
            // Stored, and the deferred place ended when nothing waits, under one lock.
            result = read_values(py, &waiting).and_then(|values| {
                self.with(|st, q| {
                    let stored = q.store(st, &waiting.records, &values, thread);
                    ended = self.end_read(st, q);
                    stored
                })
                .py_err()
            });
            if let Err(e) = &result {
                log_failed_write(py, &waiting.records, e);
            }
        }
        if !ended {
            self.with(|st, q| self.end_read(st, q));
        }
        drop((started, waiting)); // the tensors, released after the lock
        result.map(drop)
    }

    /// After a read, under the lock: every later read must reach the queue while a failure
    /// waits there for the owner; the deferred place ends when nothing waits.
    fn end_read(&self, storage: &mut Storage, queue: &mut Queue) -> bool {
        if queue.keeps_failure() {
            self.any.store(true, Ordering::Release);
        }
        end_if_empty(storage, queue)
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

/// Ends the storage's deferred place when nothing waits (names put later go at the end).
fn end_if_empty(storage: &mut Storage, queue: &mut Queue) -> bool {
    let empty = queue.is_empty();
    if empty {
        storage.end_deferred();
    }
    empty
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
    let logged = tensors(py)
        .and_then(|m| m.getattr(intern!(py, "write_failed")))
        .and_then(|f| f.call1((error.value(py),)));
    if let Err(e) = logged {
        e.write_unraisable(py, None);
    }
}

/// `hookloop.utils._tensors`, imported once.
fn tensors(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static TENSORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    TENSORS
        .get_or_try_init(py, || {
            py.import(intern!(py, "hookloop.utils._tensors"))
                .map(Bound::unbind)
        })
        .map(|m| m.bind(py))
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
    tensors(py)?
        .getattr(intern!(py, "read_scalars"))?
        .call1((values,))?
        .extract()
}

/// Whether a value is read on the host: anything but a tensor whose `is_cpu` is false.
fn on_host(value: &Bound<'_, PyAny>) -> bool {
    match value.getattr(intern!(value.py(), "is_cpu")) {
        Ok(cpu) => cpu.is_truthy().unwrap_or(true),
        Err(_) => true,
    }
}
