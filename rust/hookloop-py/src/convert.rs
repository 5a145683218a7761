//! Argument conversion shared by the binding classes: scalar values, iterations, windows.

use hookloop_core::history::Iter;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt};
use pyo3::{intern, IntoPyObjectExt};

/// Converts a metric value to f64: Python float/int/bool, numpy scalars, 0-d arrays and 0-d
/// tensors (via `__float__`, which for a CUDA tensor waits for the device). Anything else is a
/// `TypeError` naming `what` (the metric). NaN and inf pass through: a NaN loss is recordable.
pub fn scalar_value(what: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if let Ok(f) = value.cast_exact::<PyFloat>() {
        return Ok(f.value());
    }
    if value.is_instance_of::<PyInt>() {
        return value.extract::<f64>().map_err(|e| {
            PyValueError::new_err(format!("value for '{what}' does not fit a float: {e}"))
        });
    }
    if value.is_none() || value.is_instance_of::<pyo3::types::PyString>() {
        return Err(type_error(what, value));
    }
    // Tensors and arrays: only 0-d ones are scalars (float() would accept shape [1, 1]).
    if let Ok(ndim) = value.getattr(intern!(value.py(), "ndim")) {
        if ndim.extract::<i64>().is_ok_and(|n| n == 0) {
            // item(), not float(): torch warns on float() of a tensor that requires grad.
            if let Ok(item) = value.call_method0(intern!(value.py(), "item")) {
                return item.extract::<f64>().map_err(|_| type_error(what, value));
            }
        } else {
            let shape = value
                .getattr(intern!(value.py(), "shape"))
                .and_then(|s| s.str().map(|s| s.to_string()))
                .unwrap_or_else(|_| "?".into());
            return Err(PyTypeError::new_err(format!(
                "value for '{what}' must be a number or a 0-d tensor/array, got a {} of shape {shape}",
                type_name(value)
            )));
        }
    }
    value.extract::<f64>().map_err(|_| type_error(what, value))
}

fn type_error(what: &str, value: &Bound<'_, PyAny>) -> PyErr {
    PyTypeError::new_err(format!(
        "value for '{what}' must be a number or a 0-d tensor/array, got {}",
        type_name(value)
    ))
}

/// The qualified type name of `value`, for messages.
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "<unknown type>".into())
}

/// An iteration argument: an int (numpy ints included) or a float; `None` maps to `None`.
pub fn iteration(what: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Iter>> {
    let Some(value) = value else { return Ok(None) };
    if value.is_none() {
        return Ok(None);
    }
    if value.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, got bool"
        )));
    }
    if let Ok(i) = value.extract::<i64>() {
        return Ok(Some(Iter::Int(i)));
    }
    if let Ok(f) = value.cast::<PyFloat>() {
        return Ok(Some(Iter::Float(f.value())));
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be an int, got {}",
        type_name(value)
    )))
}

/// An integer argument that must be positive (window sizes, lengths).
pub fn positive(what: &str, value: i64) -> PyResult<i64> {
    if value <= 0 {
        return Err(PyValueError::new_err(format!(
            "{what} must be a positive integer, got {value}"
        )));
    }
    Ok(value)
}

/// Converts an iteration back to a Python int or float.
pub fn iter_to_py<'py>(py: Python<'py>, it: Iter) -> PyResult<Bound<'py, PyAny>> {
    match it {
        Iter::Int(i) => i.into_bound_py_any(py),
        Iter::Float(f) => f.into_bound_py_any(py),
    }
}
