//! `EventStorage`: detectron2's metric storage with its state in Rust.
//!
//! Thread safety: all state sits behind one `Shared` lock (see `state.rs`), taken once per
//! Python call; values are converted before locking, and Python objects removed from the state
//! are released after unlocking.

use std::sync::Arc;

use hookloop_core::iter::Iter;
use hookloop_core::media::MediaQueue;
use hookloop_core::metrics::{write_metrics, Reduced};
use hookloop_core::record::HistogramPoint;
use hookloop_core::storage::{ScalarState, Storage, StorageState};
use hookloop_core::tfevents::check_chw;
use hookloop_core::{error::positive, Error, History};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use pyo3::{intern, PyTraverseError, PyVisit};

use crate::convert::{int64, is_device_scalar, iter_to_py, iteration, scalar_value};
use crate::errors::{to_py, IntoPyResult};
use crate::history::{history_state_from_py, history_to_py, item, PyHistoryBuffer};
use crate::pending::Waiting;
use crate::state::{PendingImage, Shared, SharedState, State};

/// detectron2's `EventStorage`; `hookloop.utils.events.EventStorage` subclasses it to add the
/// context manager, `name_scope` and tensor handling.
#[pyclass(
    name = "EventStorage",
    module = "hookloop._core",
    frozen,
    subclass,
    weakref
)]
pub struct PyEventStorage {
    /// The state (`Waiting::state`) with what is put but not read yet, shared with the
    /// storage's `HistoryBuffer` views (a view read later settles it too).
    pub waiting: Arc<Waiting>,
}

impl PyEventStorage {
    /// Stores the pending values (core `pending`) before anything reads the scalars: every read (histories, latest values, writers) sees the same storage
    /// as without deferral.
    pub fn settle(&self, py: Python<'_>) -> PyResult<()> {
        self.waiting.settle(py)
    }

    /// The storage's state, behind its one lock.
    pub fn state(&self) -> &SharedState {
        self.waiting.state()
    }

    /// Runs `f` on the core storage under the lock.
    pub fn with<R>(&self, f: impl FnOnce(&mut Storage) -> R + Send) -> R {
        self.state().with(|s| f(&mut s.core))
    }

    /// Sets the iteration: the training loop's per-step call, without a Python frame.
    pub fn set_iter(&self, iter: i64) -> PyResult<()> {
        self.with(|s| s.set_iter(iter)).py_err()
    }
}

#[pymethods]
impl PyEventStorage {
    #[new]
    #[pyo3(signature = (start_iter = None, *, max_length = History::DEFAULT_MAX_LENGTH as i64, max_images = 256, max_histograms = 256))]
    fn new(
        start_iter: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = crate::convert::arg::max_length)] max_length: i64,
        #[pyo3(from_py_with = crate::convert::arg::max_images)] max_images: i64,
        #[pyo3(from_py_with = crate::convert::arg::max_histograms)] max_histograms: i64,
    ) -> PyResult<Self> {
        let start_iter = start_iter.map_or(Ok(0), |s| int64("start_iter", s))?;
        let max_length = positive("max_length", max_length).py_err()?;
        let max_images = positive("max_images", max_images).py_err()?;
        let max_histograms = positive("max_histograms", max_histograms).py_err()?;
        let core = Storage::new(start_iter, max_length, max_histograms).py_err()?;
        let state = State {
            core,
            pending: Default::default(),
            images: MediaQueue::new(max_images),
        };
        Ok(PyEventStorage {
            waiting: Arc::new(Waiting::new(Arc::new(Shared::new(state)))),
        })
    }

    /// Adds a scalar `value` for `name` at the current iteration (or `cur_iter`). A tensor on
    /// a device is kept and read at the next read of the scalars (no synchronization now).
    #[pyo3(signature = (name, value, smoothing_hint = true, cur_iter = None))]
    fn put_scalar(
        &self,
        py: Python<'_>,
        name: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::convert::arg::smoothing_hint)] smoothing_hint: bool,
        cur_iter: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let name = crate::convert::str_arg("put_scalar() name", name)?;
        if is_device_scalar(value) {
            let it = iteration("cur_iter", cur_iter)?;
            return self
                .waiting
                .put_device(py, vec![(name, value.clone())], smoothing_hint, it);
        }
        let v = scalar_value(name, value)?;
        let it = iteration("cur_iter", cur_iter)?;
        self.waiting.settle_of(py, &[name])?;
        self.with(|s| s.put_scalar(name, v, smoothing_hint, it))
            .py_err()
    }

    /// Adds several scalars with the same hint and iteration; one crossing for all of them.
    #[pyo3(signature = (*, smoothing_hint = true, cur_iter = None, **kwargs))]
    fn put_scalars(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::convert::arg::smoothing_hint)] smoothing_hint: bool,
        cur_iter: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let Some(kwargs) = kwargs else { return Ok(()) };
        let it = iteration("cur_iter", cur_iter)?;
        // Convert first (Python code may run), then store under one lock. As in detectron2's
        // loop of put_scalar calls, the values before a bad one are kept; device tensors are
        // kept for the next read.
        let mut items: Vec<(String, f64)> = Vec::with_capacity(kwargs.len());
        let mut device: Vec<(String, Bound<'_, PyAny>)> = Vec::new();
        let mut failure = None;
        for (k, v) in kwargs.iter() {
            let k = k.cast_into::<PyString>()?;
            let k = k.to_str()?;
            if is_device_scalar(&v) {
                device.push((k.to_owned(), v));
                continue;
            }
            match scalar_value(k, &v) {
                Ok(value) => items.push((k.to_owned(), value)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if !device.is_empty() {
            let device = device
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect();
            self.waiting.put_device(py, device, smoothing_hint, it)?;
        }
        let names: Vec<&str> = items.iter().map(|(k, _)| k.as_str()).collect();
        self.waiting.settle_of(py, &names)?;
        self.with(|s| {
            items
                .iter()
                .try_for_each(|(k, v)| s.put_scalar(k, *v, smoothing_hint, it))
        })
        .py_err()?;
        failure.map_or(Ok(()), Err)
    }

    /// Queues one iteration's losses of one process (`loss_dict` kept as given: tensors are
    /// not read) for `write_metrics`' rule at the next read of the storage, which comes at
    /// the latest after `read_every` recorded iterations (`_set_pending_limits`). One crossing
    /// per step.
    #[pyo3(signature = (cur_iter, data_time, losses, prefix = ""))]
    fn _record_losses(
        &self,
        py: Python<'_>,
        cur_iter: &Bound<'_, PyAny>,
        data_time: f64,
        losses: &Bound<'_, PyDict>,
        prefix: &str,
    ) -> PyResult<()> {
        let it = iteration("cur_iter", Some(cur_iter))?.unwrap_or(Iter::Int(0));
        self.waiting
            .record_losses(py, it, data_time, losses, prefix)
    }

    /// The pending queue's limits (core `pending::Limits`): a read is due every `read_every`
    /// recorded iterations; at most `max_started` reads are started without being waited
    /// for; at `max_values` waiting values a read is due whatever they are.
    #[pyo3(signature = (*, read_every, max_started, max_values))]
    fn _set_pending_limits(
        &self,
        read_every: i64,
        max_started: i64,
        max_values: i64,
    ) -> PyResult<()> {
        let read_every = positive("read_every", read_every).py_err()?;
        // 0 started reads: every due read is done at once.
        let max_started = usize::try_from(max_started).map_err(|_| {
            to_py(Error::bad_value(
                "max_started",
                format!("must be a non-negative integer, got {max_started}"),
            ))
        })?;
        let max_values = positive("max_values", max_values).py_err()?;
        self.state().with(|s| {
            s.pending.limits = hookloop_core::pending::Limits {
                read_every,
                max_started,
                max_values,
            }
        });
        Ok(())
    }

    /// How many values and started reads wait (for tests and diagnostics).
    fn _pending_counts(&self) -> (usize, usize) {
        self.state().with(|s| s.pending.counts())
    }

    /// Stores what is pending now (what every read does first).
    fn _settle(&self, py: Python<'_>) -> PyResult<()> {
        self.settle(py)
    }

    /// Before a checkpoint save: stores what is pending, then raises `FloatingPointError` if
    /// this storage ever found a non-finite loss (on any thread), naming its iteration.
    fn _settle_before_save(&self, py: Python<'_>) -> PyResult<()> {
        self.waiting.settle_before_save(py)
    }

    /// `SimpleTrainer.write_metrics`'s rule (core `metrics::write_metrics`) in one crossing.
    /// `losses` (None on ranks other than the main one) maps names to floats or to tensors,
    /// which are read with `item()`; `data_time` is the reduced data time (with one process,
    /// the same as `rank_data_time`). A non-finite total raises `FloatingPointError`.
    #[pyo3(signature = (losses, rank_data_time, data_time, cur_iter, prefix = ""))]
    fn _write_metrics(
        &self,
        losses: Option<&Bound<'_, PyDict>>,
        rank_data_time: f64,
        data_time: Option<f64>,
        cur_iter: &Bound<'_, PyAny>,
        prefix: &str,
    ) -> PyResult<()> {
        let it = iteration("cur_iter", Some(cur_iter))?.unwrap_or(Iter::Int(0));
        let values = match losses {
            Some(losses) => read_losses(losses, None)?,
            None => Vec::new(),
        };
        let refs = names_of(&values)?;
        let reduced = match (losses, data_time) {
            (Some(_), Some(data_time)) => Some(Reduced {
                data_time,
                losses: &refs,
            }),
            _ => None,
        };
        self.with(|s| write_metrics(s, it, prefix, rank_data_time, reduced))
            .py_err()
    }

    /// Queues an image (kept as given: a CUDA tensor is not read) for the TensorBoard writer,
    /// after checking its shape. Returns True the first time the bound dropped one.
    fn _put_image(&self, img_name: String, img_tensor: &Bound<'_, PyAny>) -> PyResult<bool> {
        let shape: Vec<i64> = img_tensor
            .getattr(intern!(img_tensor.py(), "shape"))
            .and_then(|s| s.extract())
            .map_err(|_| {
                to_py(Error::wrong_type(
                    format!("put_image('{img_name}') image"),
                    "a tensor or array of shape (C, H, W)",
                    crate::convert::type_name(img_tensor),
                ))
            })?;
        check_chw(&shape).map_err(|source| {
            to_py(Error::Image {
                tag: img_name.clone(),
                step: None,
                source,
            })
        })?;
        let image = Arc::new(img_tensor.clone().unbind());
        let (dropped, first) = self.state().with(move |s| {
            let iter = s.core.iter();
            let image = PendingImage {
                name: img_name,
                image,
                iter,
            };
            s.images.push(image, iter)
        });
        // Released after unlocking: the object's __del__ may call back into this storage.
        drop(dropped);
        Ok(first)
    }

    /// Queues a histogram computed by the Python layer (detectron2's `add_histogram_raw`
    /// parameters). Returns True the first time the queue bound dropped one.
    #[expect(clippy::too_many_arguments, reason = "add_histogram_raw's parameters")]
    #[pyo3(signature = (tag, min, max, num, sum, sum_squares, bucket_limits, bucket_counts, global_step = None))]
    fn _put_histogram(
        &self,
        tag: String,
        min: f64,
        max: f64,
        num: f64,
        sum: f64,
        sum_squares: f64,
        bucket_limits: Vec<f64>,
        bucket_counts: Vec<f64>,
        global_step: Option<i64>,
    ) -> PyResult<bool> {
        let hist = HistogramPoint::new(
            tag,
            global_step.unwrap_or(0),
            [min, max, num, sum, sum_squares],
            bucket_limits,
            bucket_counts,
        )
        .map_err(Error::from)
        .py_err()?;
        Ok(self.with(move |s| {
            let mut hist = hist;
            if global_step.is_none() {
                hist.step = s.iter();
            }
            s.put_histogram(hist)
        }))
    }

    /// The `HistoryBuffer` of `name` (a live view). `KeyError` if never put (nor read with
    /// `_read_history`).
    fn history(&self, py: Python<'_>, name: &str) -> PyResult<PyHistoryBuffer> {
        self.settle(py)?;
        if !self.with(|s| s.has_history(name)) {
            return Err(to_py(Error::UnknownMetric(name.to_owned())));
        }
        Ok(PyHistoryBuffer::view(self.waiting.clone(), name.to_owned()))
    }

    /// `histories()[name]` of a name never put: an empty history of the storage's own, listed
    /// at this place from now on (detectron2's `defaultdict`); a live view of it.
    fn _read_history(&self, name: &str) -> PyResult<PyHistoryBuffer> {
        self.with(|s| s.read_history(name)).py_err()?;
        Ok(PyHistoryBuffer::view(self.waiting.clone(), name.to_owned()))
    }

    /// `{name: HistoryBuffer}` for every history, in detectron2's `histories()` order.
    fn histories<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.settle(py)?;
        let names = self.with(|s| s.history_names());
        let out = PyDict::new(py);
        for name in names {
            let view = PyHistoryBuffer::view(self.waiting.clone(), name.to_string());
            out.set_item(&*name, Py::new(py, view)?)?;
        }
        Ok(out)
    }

    /// `{name: (latest value, iteration)}` in first-put order (a snapshot).
    fn latest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.settle(py)?;
        let items: Vec<(String, f64, Iter)> = self.with(|s| {
            s.scalars()
                .map(|(k, s)| (k.to_owned(), s.latest.0, s.latest.1))
                .collect()
        });
        let out = PyDict::new(py);
        for (k, v, it) in items {
            out.set_item(k, (v, iter_to_py(py, it)?))?;
        }
        Ok(out)
    }

    /// Per scalar: the median over the last `window_size` iterations when its smoothing hint
    /// is set, else its latest value; with the latest iteration.
    #[pyo3(signature = (window_size = 20))]
    fn latest_with_smoothing_hint<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::convert::arg::window_size)] window_size: i64,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.settle(py)?;
        let items = self
            .with(|s| s.latest_with_smoothing_hint(window_size))
            .py_err()?;
        let out = PyDict::new(py);
        for s in items {
            out.set_item(&*s.name, (s.value, iter_to_py(py, s.iter)?))?;
        }
        Ok(out)
    }

    /// How many recent values of `name` lie in the last `window_size` iterations. Unknown
    /// names raise `KeyError` and create nothing (detectron2 would create an empty history).
    #[pyo3(signature = (name, window_size = 20))]
    fn count_samples(
        &self,
        py: Python<'_>,
        name: &str,
        #[pyo3(from_py_with = crate::convert::arg::window_size)] window_size: i64,
    ) -> PyResult<usize> {
        self.settle(py)?;
        self.with(|s| s.count_samples(name, window_size)).py_err()
    }

    /// `{name: smoothing_hint}` in first-put order (forgotten names' last).
    fn smoothing_hints<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.settle(py)?;
        let items = self.with(|s| s.smoothing_hints());
        let out = PyDict::new(py);
        for (k, hint) in items {
            out.set_item(&*k, hint)?;
        }
        Ok(out)
    }

    /// Forgets each name's latest value and history (its smoothing hint stays): what
    /// assigning `_latest_scalars` or `_history` a dict without the name does. Settles first.
    fn _forget(&self, py: Python<'_>, names: Vec<String>) -> PyResult<()> {
        self.settle(py)?;
        self.with(move |s| {
            for name in &names {
                s.forget(name);
            }
        });
        Ok(())
    }

    /// Advances the iteration by one (`OverflowError` at the top of int64).
    fn step(&self) -> PyResult<()> {
        self.with(Storage::step).py_err()
    }

    /// The current iteration.
    #[getter(iter)]
    fn get_iter(&self) -> i64 {
        self.with(|s| s.iter())
    }

    #[setter(iter)]
    fn set_iter_py(&self, val: &Bound<'_, PyAny>) -> PyResult<()> {
        // Integral floats are accepted, as Python's own range arithmetic produces them.
        let it = match val.cast::<pyo3::types::PyFloat>() {
            Ok(f) => {
                let f = f.value();
                if f.fract() != 0.0 || !f.is_finite() {
                    return Err(to_py(Error::wrong_type(
                        "EventStorage.iter",
                        "an int (or an integral float)",
                        format!("{f}"),
                    )));
                }
                if !(-9.223_372_036_854_776e18..9.223_372_036_854_776e18).contains(&f) {
                    return Err(to_py(Error::OutOfRange {
                        what: "EventStorage.iter".into(),
                        value: format!("{f}"),
                        range: "int64",
                    }));
                }
                f as i64
            }
            Err(_) => int64("EventStorage.iter", val)?,
        };
        self.set_iter(it)
    }

    /// The current iteration (detectron2's backward-compatible alias of `iter`).
    #[getter]
    fn iteration(&self) -> i64 {
        self.get_iter()
    }

    /// detectron2's private `_iter`, which real code reads and sets: the same as `iter`.
    #[getter(_iter)]
    fn get_private_iter(&self) -> i64 {
        self.get_iter()
    }

    #[setter(_iter)]
    fn set_private_iter(&self, val: &Bound<'_, PyAny>) -> PyResult<()> {
        self.set_iter_py(val)
    }

    /// Makes `buffer`'s contents the history of `name` (`storage.histories()[name] = buf`):
    /// later reads and writers see it. A name seen before keeps its smoothing hint and latest
    /// value (as detectron2's `_latest_scalars`); a new one is smoothed, with the buffer's
    /// newest entry as its latest value.
    fn _set_history(&self, name: String, buffer: &Bound<'_, PyHistoryBuffer>) -> PyResult<()> {
        if buffer.get().is_view_of(&self.waiting, &name) {
            return Ok(()); // the storage's own history of that name: nothing to copy
        }
        let state = buffer.get().state(buffer.py())?;
        let history = History::from_state(state).py_err()?;
        self.with(move |s| s.set_history(&name, history)).py_err()
    }

    /// The current name prefix ("" outside `name_scope`).
    #[getter]
    fn _current_prefix(&self) -> String {
        self.with(|s| s.prefix().to_owned())
    }

    #[setter(_current_prefix)]
    fn set_current_prefix(&self, prefix: String) {
        self.with(move |s| s.set_prefix(prefix));
    }

    /// detectron2's `_vis_data`: a list of (name, image, iteration) waiting for a writer.
    #[getter]
    fn _vis_data<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self.state().with(|s| {
            s.images
                .iter()
                .map(|p| (p.name.clone(), p.image.clone(), p.iter))
                .collect::<Vec<_>>()
        });
        PyList::new(
            py,
            items
                .into_iter()
                .map(|(name, image, iter)| (name, image.clone_ref(py), iter)),
        )
    }

    /// detectron2's `_histograms`: a list of `add_histogram_raw` keyword dicts.
    #[getter]
    fn _histograms<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let hists: Vec<HistogramPoint> = self.with(|s| s.histograms().cloned().collect());
        let out = PyList::empty(py);
        for h in hists {
            out.append(histogram_dict(py, h)?)?;
        }
        Ok(out)
    }

    /// The queued images as (name, image, iteration) tuples: with `reader`, those that writer
    /// has not read yet (each stays queued until every writer reading images has it, see
    /// `hookloop_core::media`); without, every queued one, taken out for everyone.
    #[pyo3(signature = (reader = None))]
    fn _take_images<'py>(
        &self,
        py: Python<'py>,
        reader: Option<u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let (taken, released) = self.state().with(|s| match reader {
            Some(reader) => {
                let iter = s.core.iter();
                s.images
                    .read(reader, iter, |p| (p.name.clone(), p.image.clone(), p.iter))
            }
            None => {
                let (waiting, all) = s.images.take();
                let taken = all[..waiting]
                    .iter()
                    .map(|p| (p.name.clone(), p.image.clone(), p.iter))
                    .collect();
                (taken, all)
            }
        });
        drop(released); // after unlocking, see the module comment
        PyList::new(
            py,
            taken
                .into_iter()
                .map(|(name, image, iter)| (name, image.clone_ref(py), iter)),
        )
    }

    /// The number of images waiting for a writer.
    fn _pending_images(&self) -> usize {
        self.state().with(|s| s.images.len())
    }

    /// The queued histograms as keyword dicts: with `reader`, those that writer has not read
    /// yet (as `_take_images`); without, every queued one, taken out for everyone.
    #[pyo3(signature = (reader = None))]
    fn _take_histograms<'py>(
        &self,
        py: Python<'py>,
        reader: Option<u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let taken = match reader {
            Some(reader) => self.with(|s| s.read_histograms(reader)),
            None => self.with(Storage::take_histograms),
        };
        let out = PyList::empty(py);
        for h in taken {
            out.append(histogram_dict(py, h)?)?;
        }
        Ok(out)
    }

    /// Registers a writer (its `reader` id) that will read the images and histograms: from
    /// now on each one put stays queued until that writer has it too (bounded by
    /// `max_images`/`max_histograms`). `PeriodicWriter` subscribes its writers before
    /// training; a writer is also registered by its first read.
    fn _subscribe(&self, reader: u64) {
        self.state().with(|s| {
            let iter = s.core.iter();
            s.images.subscribe(reader, iter);
            s.core.subscribe_histograms(reader);
        });
    }

    /// Forgets a writer's `reader` (a closed writer): nothing waits for it any more.
    fn _unsubscribe(&self, reader: u64) {
        self.state().with(|s| {
            let iter = s.core.iter();
            s.images.unsubscribe(reader, iter);
            s.core.unsubscribe_histograms(reader);
        });
    }

    /// Drops the queued images (the TensorBoard writer calls this after writing them).
    fn clear_images(&self) {
        let taken = self.state().with(|s| s.images.take());
        drop(taken); // after unlocking, see the module comment
    }

    /// Drops the queued histograms.
    fn clear_histograms(&self) {
        self.with(Storage::take_histograms);
    }

    /// Heap bytes held by the scalar histories.
    fn _heap_bytes(&self) -> usize {
        self.with(|s| s.heap_bytes())
    }

    /// The scalar state as plain data (`keep`: the newest entries kept per history, all with
    /// None); what pickling and checkpoints save. Images and histograms are not included.
    #[pyo3(signature = (keep = None))]
    fn _state<'py>(&self, py: Python<'py>, keep: Option<i64>) -> PyResult<Bound<'py, PyDict>> {
        self.settle(py)?;
        let keep = keep.map(|k| positive("keep", k)).transpose().py_err()?;
        let state = self.with(|s| s.state(keep));
        storage_state_to_py(py, &state)
    }

    /// Replaces the scalars and the iteration with a `_state()` dict's.
    fn _load_state(&self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let state = storage_state_from_py(state)?;
        self.with(move |s| s.load_state(state)).py_err()
    }

    fn __getstate__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self._state(py, None)
    }

    fn __setstate__(&self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        self._load_state(state)
    }

    fn __getnewargs__<'py>(&self, py: Python<'py>) -> Bound<'py, PyTuple> {
        PyTuple::empty(py)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // try_with: the lock is never held across Python code, so this only fails while
        // another thread is inside a Rust call, and then the images are reachable next time.
        let images = self
            .state()
            .try_with(|s| {
                s.images
                    .iter_all()
                    .map(|p| p.image.clone())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        for image in &images {
            visit.call(&**image)?;
        }
        self.waiting.traverse(&visit)
    }

    fn __clear__(&self) {
        let taken = self
            .state()
            .try_with(|s| s.images.take())
            .unwrap_or_default();
        drop(taken);
        self.waiting.clear();
    }
}

/// A loss dict's `(name, value)` pairs in order: each value read from the dict (`item()` for
/// a tensor), or taken from `given` (values read by the caller; the count for the error).
fn read_losses<'py>(
    losses: &Bound<'py, PyDict>,
    mut given: Option<(&mut std::vec::IntoIter<f64>, usize)>,
) -> PyResult<Vec<(Bound<'py, PyString>, f64)>> {
    let mut out = Vec::with_capacity(losses.len());
    for (k, v) in losses.iter() {
        let k = k
            .cast_into::<PyString>()
            .map_err(|_| to_py(Error::wrong_type("loss_dict keys", "str", "another type")))?;
        let value = match given.as_mut() {
            Some((values, count)) => values.next().ok_or_else(|| {
                to_py(Error::bad_value(
                    "_write_metrics_batch values",
                    format!("{count} values for more losses than that"),
                ))
            })?,
            None => scalar_value(k.to_str()?, &v)?,
        };
        out.push((k, value));
    }
    Ok(out)
}

/// The losses' names borrowed from their Python strings.
fn names_of<'a>(losses: &'a [(Bound<'_, PyString>, f64)]) -> PyResult<Vec<(&'a str, f64)>> {
    losses.iter().map(|(k, v)| Ok((k.to_str()?, *v))).collect()
}

fn storage_state_to_py<'py>(py: Python<'py>, s: &StorageState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("iter", s.iter)?;
    d.set_item("max_length", s.max_length)?;
    let scalars = PyList::empty(py);
    for sc in &s.scalars {
        scalars.append((
            &sc.name,
            sc.smoothing_hint,
            sc.latest.0,
            iter_to_py(py, sc.latest.1)?,
            history_to_py(py, &sc.history)?,
        ))?;
    }
    d.set_item("scalars", scalars)?;
    Ok(d)
}

fn storage_state_from_py(d: &Bound<'_, PyDict>) -> PyResult<StorageState> {
    let mut scalars = Vec::new();
    for entry in item(d, "scalars")?.try_iter()? {
        let (name, hint, value, it, hist): (
            String,
            bool,
            f64,
            Bound<'_, PyAny>,
            Bound<'_, PyDict>,
        ) = entry?.extract()?;
        let it = iteration("iteration", Some(&it))?.unwrap_or(Iter::Int(0));
        scalars.push(ScalarState {
            name,
            smoothing_hint: hint,
            latest: (value, it),
            history: history_state_from_py(&hist)?,
        });
    }
    Ok(StorageState {
        iter: int64("iter", &item(d, "iter")?)?,
        max_length: item(d, "max_length")?.extract()?,
        scalars,
    })
}

fn histogram_dict<'py>(py: Python<'py>, h: HistogramPoint) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tag", h.tag)?;
    d.set_item("min", h.min)?;
    d.set_item("max", h.max)?;
    // detectron2 stores num as an int (numel of the tensor).
    d.set_item("num", h.num as i64)?;
    d.set_item("sum", h.sum)?;
    d.set_item("sum_squares", h.sum_squares)?;
    d.set_item("bucket_limits", h.bucket_limits)?;
    d.set_item("bucket_counts", h.bucket_counts)?;
    d.set_item("global_step", h.step)?;
    Ok(d)
}
