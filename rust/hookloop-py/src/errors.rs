//! The one place core errors become Python exceptions.

use hookloop_core::Error;
use pyo3::exceptions::{
    PyFloatingPointError, PyIndexError, PyKeyError, PyOSError, PyOverflowError, PyRuntimeError,
    PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::PyErr;

/// Maps a core error to the Python exception detectron2 users expect: unknown metric ->
/// `KeyError`, wrong type -> `TypeError`, bad value -> `ValueError`, out of range ->
/// `OverflowError`, a non-finite loss -> `FloatingPointError`, I/O -> `OSError(errno,
/// message, path)`.
pub fn to_py(err: Error) -> PyErr {
    match err {
        Error::UnknownMetric(_) => PyKeyError::new_err(err.to_string()),
        Error::EmptyHistory | Error::StepPastEnd { .. } => PyIndexError::new_err(err.to_string()),
        Error::WrongType { .. } | Error::NotPicklable { .. } => {
            PyTypeError::new_err(err.to_string())
        }
        Error::OutOfRange { .. } => PyOverflowError::new_err(err.to_string()),
        Error::HintChanged { .. }
        | Error::BadWindow(_)
        | Error::BadMaxLength(_)
        | Error::BadValue { .. }
        | Error::BadState { .. }
        | Error::Image { .. }
        | Error::Closed { .. }
        | Error::BadSchedule { .. }
        | Error::BadScheduleArg { .. }
        | Error::IterOutOfRange { .. } => PyValueError::new_err(err.to_string()),
        // fvcore raises RuntimeError for a `where` outside a schedule's range.
        Error::WhereOutOfRange { .. } => PyRuntimeError::new_err(err.to_string()),
        Error::NonFiniteLoss { ref losses, .. } => {
            // detectron2's message shows the losses as the dict of numpy means it built:
            // numpy.float64 values (`np.float64(nan)` in numpy 2's repr, `nan` before).
            let dict = Python::attach(|py| -> PyResult<String> {
                let float64 = py.import("numpy").and_then(|np| np.getattr("float64")).ok();
                let d = PyDict::new(py);
                for (k, v) in losses {
                    match &float64 {
                        Some(f) => d.set_item(k, f.call1((*v,))?)?,
                        None => d.set_item(k, v)?,
                    }
                }
                Ok(d.repr()?.to_string())
            })
            .unwrap_or_else(|_| format!("{losses:?}"));
            PyFloatingPointError::new_err(format!("{err}\nloss_dict = {dict}"))
        }
        Error::ForkedChild { .. } | Error::WriterPanicked { .. } => {
            PyOSError::new_err(err.to_string())
        }
        Error::Blocked { ref path, .. } => {
            let path = path.display().to_string();
            PyOSError::new_err((110, err.to_string(), path))
        }
        Error::Deleted { ref path } => {
            let path = path.display().to_string();
            let message = "deleted (or its directory removed) while open; nothing written to it \
                           since is kept";
            PyOSError::new_err((2, message, path))
        }
        Error::WriteDropped {
            ref path,
            ref source,
            dropped,
            total,
            unit,
        } => {
            let message = format!("{source} ({dropped} of {total} {unit} not written)");
            let path = path.display().to_string();
            match source.raw_os_error() {
                Some(errno) => PyOSError::new_err((errno, message, path)),
                None => PyOSError::new_err(format!("{message}: '{path}'")),
            }
        }
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

/// A function the package hands to the extension at the import of the module that owns it
/// (`_register_*`), needed before that import: `RuntimeError` naming the module.
pub fn unregistered(what: &str, module: &str) -> PyErr {
    PyRuntimeError::new_err(format!(
        "{what} are not registered with hookloop._core: import {module} first (it registers \
         them at its import)"
    ))
}

/// `Result::map_err(to_py)` in method-call form.
pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for hookloop_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
