//! `HistoryBuffer`: fvcore's API over a core `History`, either owned or a live view of one
//! metric inside an `EventStorage` (what `storage.history(name)` returns, as in detectron2 where
//! the buffer object is the storage's own).

use std::sync::Arc;

use hookloop_core::error::positive;
use hookloop_core::history::{History, Iter};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::convert::{iter_to_py, scalar_value};
use crate::deferred::Deferred;
use crate::errors::IntoPyResult;
use crate::state::Shared;
use crate::storage::{history_state_from_py, history_to_py};

enum Source {
    Owned(Shared<History>),
    /// One scalar of a storage: a read settles what the storage has not read yet first, as
    /// a read through the storage does.
    View {
        deferred: Arc<Deferred>,
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
    pub fn view(deferred: Arc<Deferred>, name: String) -> Self {
        PyHistoryBuffer {
            source: Source::View { deferred, name },
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
            Source::View { deferred, name } => {
                deferred.settle(py)?;
                deferred
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
