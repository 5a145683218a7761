//! `EventStorage`: detectron2's metric storage with its state in Rust.
//!
//! Thread safety: all state sits behind one `Mutex`, taken once per Python call and never held
//! while Python code runs (values are converted before locking; Python objects removed from the
//! state are dropped after unlocking, since a `__del__` could call back into the storage).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use hookloop_core::history::Iter;
use hookloop_core::storage::Storage;
use hookloop_core::tfevents::HistogramPoint;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{intern, PyTraverseError, PyVisit};

use crate::convert::{iter_to_py, iteration, positive, scalar_value, type_name};
use crate::errors::IntoPyResult;
use crate::history::PyHistoryBuffer;

/// Locks `m`, ignoring poisoning: no code path panics while holding these locks, and a
/// poisoned storage is still more useful than an exception on every later call.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An image put with `put_image`, held as the caller's object until a writer converts it
/// (reading a CUDA tensor would wait for the device).
pub struct PendingImage {
    pub name: String,
    pub image: Py<PyAny>,
    pub iter: i64,
}

/// Everything behind the storage's lock.
pub struct State {
    pub core: Storage,
    pub images: VecDeque<PendingImage>,
    pub max_images: usize,
    pub dropped_images: u64,
}

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
    pub state: Arc<Mutex<State>>,
}

impl PyEventStorage {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Sets the iteration: the training loop's per-step call, without a Python frame.
    pub fn set_iter(&self, iter: i64) {
        self.lock().core.set_iter(iter);
    }
}

#[pymethods]
impl PyEventStorage {
    #[new]
    #[pyo3(signature = (start_iter = 0, *, max_length = 1_000_000, max_images = 256, max_histograms = 256))]
    fn new(
        start_iter: i64,
        max_length: i64,
        max_images: i64,
        max_histograms: i64,
    ) -> PyResult<Self> {
        let max_length = positive("max_length", max_length)? as usize;
        let max_images = positive("max_images", max_images)? as usize;
        let max_histograms = positive("max_histograms", max_histograms)? as usize;
        let core = Storage::new(start_iter, max_length, max_histograms).py_err()?;
        let state = State {
            core,
            images: VecDeque::new(),
            max_images,
            dropped_images: 0,
        };
        Ok(PyEventStorage {
            state: Arc::new(Mutex::new(state)),
        })
    }

    /// Adds a scalar `value` for `name` at the current iteration (or `cur_iter`).
    #[pyo3(signature = (name, value, smoothing_hint = true, cur_iter = None))]
    fn put_scalar(
        &self,
        name: &str,
        value: &Bound<'_, PyAny>,
        smoothing_hint: bool,
        cur_iter: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let v = scalar_value(name, value)?;
        let it = iteration("cur_iter", cur_iter)?;
        self.lock()
            .core
            .put_scalar(name, v, smoothing_hint, it)
            .py_err()
    }

    /// Adds several scalars with the same hint and iteration; one crossing for all of them.
    #[pyo3(signature = (*, smoothing_hint = true, cur_iter = None, **kwargs))]
    fn put_scalars(
        &self,
        smoothing_hint: bool,
        cur_iter: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let Some(kwargs) = kwargs else { return Ok(()) };
        let it = iteration("cur_iter", cur_iter)?;
        // Convert first (Python code may run), then store under one lock. As in detectron2's
        // loop of put_scalar calls, the values before a bad one are kept.
        let mut items: Vec<(Bound<'_, PyString>, f64)> = Vec::with_capacity(kwargs.len());
        let mut failure = None;
        for (k, v) in kwargs.iter() {
            let k = k.cast_into::<PyString>()?;
            match scalar_value(k.to_str()?, &v) {
                Ok(value) => items.push((k, value)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let mut state = self.lock();
        for (k, v) in &items {
            state
                .core
                .put_scalar(k.to_str()?, *v, smoothing_hint, it)
                .py_err()?;
        }
        drop(state);
        if let Some(e) = failure {
            return Err(e);
        }
        Ok(())
    }

    /// The single-process body of `SimpleTrainer.write_metrics` in one crossing: reads each
    /// loss with `.item()`, puts `rank_data_time`, `data_time`, `{prefix}total_loss` and (for
    /// several losses) each loss at `cur_iter`. Returns None, or, when the total is not finite,
    /// the `{name: value}` dict for the caller's `FloatingPointError` (then, as in detectron2,
    /// only the two data times were put).
    fn _put_losses<'py>(
        &self,
        py: Python<'py>,
        loss_dict: &Bound<'py, PyDict>,
        data_time: f64,
        cur_iter: i64,
        prefix: &str,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let item = intern!(py, "item");
        let mut losses: Vec<(Bound<'py, PyString>, f64)> = Vec::with_capacity(loss_dict.len());
        // Python's sum() starts from the int 0, and 0 + x == x for every float but -0.0,
        // which 0.0 + x turns into 0.0 exactly as 0 + x does.
        let mut total = 0.0;
        for (k, v) in loss_dict.iter() {
            let k = k.cast_into::<PyString>()?;
            let value = scalar_value(k.to_str()?, &v.call_method0(item)?)?;
            total += value;
            losses.push((k, value));
        }
        let it = Some(Iter::Int(cur_iter));
        let mut state = self.lock();
        let core = &mut state.core;
        core.put_scalar("rank_data_time", data_time, true, it)
            .py_err()?;
        core.put_scalar("data_time", data_time, true, it).py_err()?;
        if !total.is_finite() {
            drop(state);
            let out = PyDict::new(py);
            for (k, v) in &losses {
                out.set_item(k, v)?;
            }
            return Ok(Some(out));
        }
        core.put_scalar(&format!("{prefix}total_loss"), total, true, it)
            .py_err()?;
        if losses.len() > 1 {
            for (k, v) in &losses {
                core.put_scalar(k.to_str()?, *v, true, it).py_err()?;
            }
        }
        Ok(None)
    }

    /// Queues an image (kept as given) for the TensorBoard writer. Validation and conversion
    /// happen in Python (`hookloop.utils.events`); this only stores it.
    fn _put_image(&self, img_name: String, img_tensor: Py<PyAny>) -> PyResult<bool> {
        let (dropped, first_drop) = {
            let mut state = self.lock();
            let iter = state.core.iter();
            state.images.push_back(PendingImage {
                name: img_name,
                image: img_tensor,
                iter,
            });
            if state.images.len() > state.max_images {
                state.dropped_images += 1;
                (state.images.pop_front(), state.dropped_images == 1)
            } else {
                (None, false)
            }
        };
        // Dropped after unlocking: the object's __del__ may call back into this storage.
        drop(dropped);
        Ok(first_drop)
    }

    /// Queues a histogram computed by the Python layer (detectron2's `add_histogram_raw`
    /// parameters). Returns True the first time the queue bound dropped one.
    #[allow(clippy::too_many_arguments)]
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
        if bucket_limits.len() != bucket_counts.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "histogram '{tag}': {} bucket limits but {} bucket counts",
                bucket_limits.len(),
                bucket_counts.len()
            )));
        }
        let mut state = self.lock();
        let step = global_step.unwrap_or(state.core.iter());
        let hist = HistogramPoint {
            tag,
            step,
            min,
            max,
            num,
            sum,
            sum_squares,
            bucket_limits,
            bucket_counts,
        };
        Ok(state.core.put_histogram(hist))
    }

    /// The `HistoryBuffer` of `name` (a live view). `KeyError` if never put.
    fn history(slf: &Bound<'_, Self>, name: &str) -> PyResult<PyHistoryBuffer> {
        let this = slf.get();
        this.lock().core.scalar(name).py_err()?;
        Ok(PyHistoryBuffer::view(this.state.clone(), name.to_owned()))
    }

    /// `{name: HistoryBuffer}` for every scalar, in first-put order.
    fn histories<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let names: Vec<String> = self
            .lock()
            .core
            .scalars()
            .map(|(k, _)| k.to_owned())
            .collect();
        let out = PyDict::new(py);
        for name in names {
            let view = PyHistoryBuffer::view(self.state.clone(), name.clone());
            out.set_item(name, Py::new(py, view)?)?;
        }
        Ok(out)
    }

    /// `{name: (latest value, iteration)}` in first-put order (a snapshot).
    fn latest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let items: Vec<(String, f64, Iter)> = self
            .lock()
            .core
            .scalars()
            .map(|(k, s)| (k.to_owned(), s.latest.0, s.latest.1))
            .collect();
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
        window_size: i64,
    ) -> PyResult<Bound<'py, PyDict>> {
        positive("window_size", window_size)?;
        let items = self
            .lock()
            .core
            .latest_with_smoothing_hint(window_size)
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
    fn count_samples(&self, name: &str, window_size: i64) -> PyResult<usize> {
        positive("window_size", window_size)?;
        self.lock().core.count_samples(name, window_size).py_err()
    }

    /// `{name: smoothing_hint}` in first-put order.
    fn smoothing_hints<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let items: Vec<(String, bool)> = self
            .lock()
            .core
            .scalars()
            .map(|(k, s)| (k.to_owned(), s.smoothing_hint))
            .collect();
        let out = PyDict::new(py);
        for (k, hint) in items {
            out.set_item(k, hint)?;
        }
        Ok(out)
    }

    /// Advances the iteration by one.
    fn step(&self) {
        self.lock().core.step();
    }

    /// The current iteration.
    #[getter(iter)]
    fn get_iter(&self) -> i64 {
        self.lock().core.iter()
    }

    #[setter(iter)]
    fn set_iter_py(&self, val: &Bound<'_, PyAny>) -> PyResult<()> {
        let it = match val.extract::<i64>() {
            Ok(i) => i,
            Err(_) => match val.extract::<f64>() {
                Ok(f) if f.fract() == 0.0 && f.is_finite() => f as i64,
                _ => {
                    return Err(PyTypeError::new_err(format!(
                        "iter must be an int, got {}",
                        type_name(val)
                    )))
                }
            },
        };
        self.set_iter(it);
        Ok(())
    }

    /// The current iteration (detectron2's backward-compatible alias of `iter`).
    #[getter]
    fn iteration(&self) -> i64 {
        self.lock().core.iter()
    }

    /// The current name prefix ("" outside `name_scope`).
    #[getter]
    fn _current_prefix(&self) -> String {
        self.lock().core.prefix().to_owned()
    }

    #[setter(_current_prefix)]
    fn set_current_prefix(&self, prefix: String) {
        self.lock().core.set_prefix(prefix);
    }

    /// detectron2's `_vis_data`: a list of (name, image, iteration) waiting for a writer.
    #[getter]
    fn _vis_data<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items: Vec<(String, Py<PyAny>, i64)> = self
            .lock()
            .images
            .iter()
            .map(|p| (p.name.clone(), p.image.clone_ref(py), p.iter))
            .collect();
        PyList::new(py, items)
    }

    /// detectron2's `_histograms`: a list of `add_histogram_raw` keyword dicts.
    #[getter]
    fn _histograms<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let hists: Vec<HistogramPoint> = self.lock().core.histograms().cloned().collect();
        let out = PyList::empty(py);
        for h in hists {
            out.append(histogram_dict(py, h)?)?;
        }
        Ok(out)
    }

    /// Removes and returns the queued images as (name, image, iteration) tuples.
    fn _take_images<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let taken: Vec<PendingImage> = self.lock().images.drain(..).collect();
        PyList::new(py, taken.into_iter().map(|p| (p.name, p.image, p.iter)))
    }

    /// Removes and returns the queued histograms as keyword dicts.
    fn _take_histograms<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let taken = self.lock().core.take_histograms();
        let out = PyList::empty(py);
        for h in taken {
            out.append(histogram_dict(py, h)?)?;
        }
        Ok(out)
    }

    /// Drops the queued images (the TensorBoard writer calls this after writing them).
    fn clear_images(&self) {
        let taken: Vec<PendingImage> = self.lock().images.drain(..).collect();
        drop(taken); // after unlocking, see the module comment
    }

    /// Drops the queued histograms.
    fn clear_histograms(&self) {
        self.lock().core.take_histograms();
    }

    /// Heap bytes held by the scalar histories.
    fn _heap_bytes(&self) -> usize {
        self.lock().core.heap_bytes()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // try_lock: the lock is never held across Python code, so this only fails while
        // another thread is inside a Rust call, and then the images are reachable next time.
        if let Ok(state) = self.state.try_lock() {
            for p in &state.images {
                visit.call(&p.image)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let taken: Vec<PendingImage> = self
            .state
            .try_lock()
            .map(|mut s| s.images.drain(..).collect())
            .unwrap_or_default();
        drop(taken);
    }
}

fn histogram_dict<'py>(py: Python<'py>, h: HistogramPoint) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tag", h.tag)?;
    d.set_item("min", h.min)?;
    d.set_item("max", h.max)?;
    d.set_item("num", h.num)?;
    d.set_item("sum", h.sum)?;
    d.set_item("sum_squares", h.sum_squares)?;
    d.set_item("bucket_limits", h.bucket_limits)?;
    d.set_item("bucket_counts", h.bucket_counts)?;
    d.set_item("global_step", h.step)?;
    Ok(d)
}
