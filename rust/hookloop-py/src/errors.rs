//! The one place core errors become Python exceptions.

use hookloop_core::Error;
use pyo3::exceptions::{PyIndexError, PyKeyError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;

/// Maps a core error to the Python exception detectron2 users expect: unknown metric ->
/// `KeyError`, bad values -> `ValueError`, I/O -> `OSError(errno, message, path)`.
pub fn to_py(err: Error) -> PyErr {
    match err {
        Error::UnknownMetric(_) => PyKeyError::new_err(err.to_string()),
        Error::EmptyHistory => PyIndexError::new_err(err.to_string()),
        Error::HintChanged { .. }
        | Error::BadWindow(_)
        | Error::BadMaxLength(_)
        | Error::BadImage { .. }
        | Error::Closed { .. }
        | Error::BadSchedule { .. }
        | Error::IterOutOfRange { .. }
        | Error::MaxIterChanged { .. } => PyValueError::new_err(err.to_string()),
        // fvcore raises RuntimeError for a `where` outside a schedule's range.
        Error::WhereOutOfRange { .. } => PyRuntimeError::new_err(err.to_string()),
        Error::Io { path, source } => match source.raw_os_error() {
            // OSError(errno, strerror, filename): sets .errno/.filename, as open() would.
            Some(errno) => {
                let message = source.to_string();
                PyOSError::new_err((errno, message, path.display().to_string()))
            }
            None => PyOSError::new_err(format!("{source}: '{}'", path.display())),
        },
    }
}

/// `Result::map_err(to_py)` in method-call form.
pub trait IntoPyResult<T> {
    fn py_err(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPyResult<T> for hookloop_core::Result<T> {
    fn py_err(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
