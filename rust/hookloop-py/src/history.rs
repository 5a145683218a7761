//! `HistoryBuffer`: fvcore's API over a core `History`, either owned or a live view of one
//! metric inside an `EventStorage` (what `storage.history(name)` returns, as in detectron2 where
//! the buffer object is the storage's own).

use std::sync::Arc;

use hookloop_core::error::positive;
use hookloop_core::history::{History, HistoryState};
use hookloop_core::iter::Iter;
use hookloop_core::Error;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::convert::{iter_to_py, scalar_value};
use crate::errors::{to_py, IntoPyResult};
use crate::pending::Waiting;
use crate::state::Shared;

enum Source {
    Owned(Shared<History>),
    /// One scalar of a storage: a read settles what the storage has not read yet first, as
    /// a read through the storage does.
    View {
        waiting: Arc<Waiting>,
        name: String,
    },
}

/// The last `max_length` values of one scalar, with median/avg over windows and a global
/// average over every value ever added.
#[pyclass(name = "HistoryBuffer", module = "hookloop._core", frozen, subclass)]
pub struct PyHistoryBuffer {
    source: Source,
}

impl PyHistoryBuffer {
    /// A live view of `name` inside a storage.
    pub fn view(waiting: Arc<Waiting>, name: String) -> Self {
        PyHistoryBuffer {
            source: Source::View { waiting, name },
        }
    }

    /// Runs `f` on the history with its lock held (a view's storage settled first).
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut History) -> T + Send,
    ) -> PyResult<T> {
        match &self.source {
            Source::Owned(h) => Ok(h.with(f)),
            Source::View { waiting, name } => {
                waiting.settle(py)?;
                waiting
                    .state()
                    .with(|s| s.core.history_mut(name).map(f))
                    .py_err()
            }
        }
    }

    /// The whole state (for `EventStorage._set_history`).
    pub fn state(&self, py: Python<'_>) -> PyResult<hookloop_core::history::HistoryState> {
        self.with(py, |h| h.state(None))
    }

    /// Whether this is the live view of `name` in the storage that `waiting` belongs to.
    pub fn is_view_of(&self, waiting: &Arc<Waiting>, name: &str) -> bool {
        match &self.source {
            Source::View {
                waiting: w,
                name: n,
            } => Arc::ptr_eq(w, waiting) && n == name,
            Source::Owned(_) => false,
        }
    }

    fn label(&self) -> &str {
        match &self.source {
            Source::Owned(_) => "HistoryBuffer",
            Source::View { name, .. } => name,
        }
    }
}

#[pymethods]
impl PyHistoryBuffer {
    #[new]
    #[pyo3(signature = (max_length = History::DEFAULT_MAX_LENGTH as i64))]
    fn new(
        #[pyo3(from_py_with = crate::convert::arg::max_length)] max_length: i64,
    ) -> PyResult<Self> {
        let max_length = positive("max_length", max_length).py_err()?;
        let history = History::new(max_length).py_err()?;
        Ok(PyHistoryBuffer {
            source: Source::Owned(Shared::new(history)),
        })
    }

    /// Pickles (and copies) as an owned buffer with the same contents; a view of a storage's
    /// history becomes an independent copy.
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
        let py = slf.py();
        let this = slf.get();
        let state = this.with(py, |h| h.state(None))?;
        let args = PyTuple::new(py, [state.max_length])?;
        Ok((slf.get_type().into_any(), args, history_to_py(py, &state)?))
    }

    /// Restores what `__reduce__` saved.
    fn __setstate__(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let state = history_state_from_py(state)?;
        let history = History::from_state(state).py_err()?;
        self.with(py, move |slot| *slot = history)
    }

    /// Adds a value at `iteration` (default: the number of updates so far).
    #[pyo3(signature = (value, iteration = None))]
    fn update(
        &self,
        value: &Bound<'_, PyAny>,
        iteration: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let v = scalar_value(self.label(), value)?;
        let it = crate::convert::iteration("iteration", iteration)?;
        self.with(value.py(), |h| h.update(v, it))
    }

    /// The most recent value (`IndexError` when empty).
    fn latest(&self, py: Python<'_>) -> PyResult<f64> {
        self.with(py, |h| h.latest())?.py_err()
    }

    /// The median of the last `window_size` values (numpy's median).
    fn median(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::convert::arg::window_size)] window_size: i64,
    ) -> PyResult<f64> {
        self.with(py, |h| h.median(window_size))?.py_err()
    }

    /// The mean of the last `window_size` values (numpy's mean).
    fn avg(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::convert::arg::window_size)] window_size: i64,
    ) -> PyResult<f64> {
        self.with(py, |h| h.avg(window_size))?.py_err()
    }

    /// The mean of every value ever added, evicted ones included.
    fn global_avg(&self, py: Python<'_>) -> PyResult<f64> {
        self.with(py, |h| h.global_avg())
    }

    /// All (value, iteration) pairs held, oldest first.
    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let values = self.with(py, |h| h.values())?;
        let items = values
            .into_iter()
            .map(|(v, it)| Ok((v, iter_to_py(py, it)?)))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// fvcore's `_data`: the (value, iteration) pairs held, oldest first (a copy).
    #[getter]
    fn _data<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.values(py)
    }

    /// The maximum number of entries kept.
    #[getter]
    fn max_length(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |h| h.max_length())
    }

    /// fvcore's private spelling, read by some callers.
    #[getter]
    fn _max_length(&self, py: Python<'_>) -> PyResult<usize> {
        self.max_length(py)
    }

    /// Number of updates ever made (fvcore's `_count`).
    #[getter]
    fn _count(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |h| h.count())
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |h| h.len())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (len, max, latest) = self.with(py, |h| (h.len(), h.max_length(), h.latest_entry()))?;
        let latest = match latest {
            Some((v, Iter::Int(i))) => format!(", latest=({v:?}, {i})"),
            Some((v, Iter::Float(i))) => format!(", latest=({v:?}, {i:?})"),
            None => String::new(),
        };
        Ok(format!(
            "HistoryBuffer({}: {len}/{max}{latest})",
            self.label()
        ))
    }
}

// The state of one history as a Python dict (the values and iterations as little-endian f64
// bytes): HistoryBuffer's pickle and each scalar's entry in EventStorage's state.

pub fn history_to_py<'py>(py: Python<'py>, h: &HistoryState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let values: Vec<u8> = h.entries.iter().flat_map(|e| e.0.to_le_bytes()).collect();
    let iters: Vec<u8> = h.entries.iter().flat_map(|e| e.1.to_le_bytes()).collect();
    d.set_item("max_length", h.max_length)?;
    d.set_item("values", PyBytes::new(py, &values))?;
    d.set_item("iterations", PyBytes::new(py, &iters))?;
    d.set_item("count", h.count)?;
    d.set_item("global_avg", h.global_avg)?;
    d.set_item("int_iterations", h.int_iterations)?;
    Ok(d)
}

pub fn history_state_from_py(d: &Bound<'_, PyDict>) -> PyResult<HistoryState> {
    let values = f64s("values", item(d, "values")?.cast::<PyBytes>()?.as_bytes())?;
    let iters = f64s(
        "iterations",
        item(d, "iterations")?.cast::<PyBytes>()?.as_bytes(),
    )?;
    if values.len() != iters.len() {
        return Err(to_py(Error::BadState {
            what: "HistoryBuffer",
            reason: format!("{} values but {} iterations", values.len(), iters.len()),
        }));
    }
    Ok(HistoryState {
        max_length: item(d, "max_length")?.extract()?,
        entries: values.into_iter().zip(iters).collect(),
        count: item(d, "count")?.extract()?,
        global_avg: item(d, "global_avg")?.extract()?,
        int_iterations: item(d, "int_iterations")?.extract()?,
    })
}

fn f64s(what: &str, bytes: &[u8]) -> PyResult<Vec<f64>> {
    if bytes.len() % 8 != 0 {
        return Err(to_py(Error::BadState {
            what: "HistoryBuffer",
            reason: format!("{what} holds {} bytes, not a multiple of 8", bytes.len()),
        }));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect())
}

pub(crate) fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?.ok_or_else(|| {
        to_py(Error::BadState {
            what: "EventStorage/HistoryBuffer",
            reason: format!("the state has no '{key}'"),
        })
    })
}
