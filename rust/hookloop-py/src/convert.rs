//! Argument conversion shared by the binding classes: scalar values and iterations. Failures
//! are core errors (`WrongType`, `OutOfRange`), mapped to Python in `errors.rs`.

use hookloop_core::iter::Iter;
use hookloop_core::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString, PyType};
use pyo3::{intern, IntoPyObjectExt};

use crate::errors::to_py;

const SCALAR: &str = "a number or a single-element tensor/array";

/// Converts a metric value to f64: Python float/int/bool, numpy scalars, and tensors or arrays
/// holding one element (any shape, as `float()` accepts; read with `item()`, which for a CUDA
/// tensor waits for the device). Anything else is a `TypeError` naming `what` (the metric).
/// NaN and inf pass through: a NaN loss is recordable.
pub fn scalar_value(what: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if let Ok(f) = value.cast_exact::<PyFloat>() {
        return Ok(f.value());
    }
    let py = value.py();
    // The losses' case: a plain torch tensor read with item() at once, without the checks
    // below (which an item() that fails still reaches, for their message).
    if tensor_type(py).is_some_and(|t| value.get_type().is(t)) {
        if let Ok(f) = value
            .call_method0(intern!(py, "item"))
            .and_then(|item| item.extract::<f64>())
        {
            return Ok(f);
        }
    }
    if value.is_instance_of::<PyInt>() {
        return value.extract::<f64>().map_err(|_| {
            to_py(Error::OutOfRange {
                what: format!("value for '{what}'"),
                value: value.str().map(|s| s.to_string()).unwrap_or_default(),
                range: "a float64",
            })
        });
    }
    if value.is_none() || value.is_instance_of::<PyString>() {
        return Err(wrong_type(what, value, None));
    }
    // Tensors and arrays: one element, read with item() (not float(): torch warns on float() of
    // a tensor that requires grad).
    if let Ok(ndim) = value.getattr(intern!(py, "ndim")) {
        let count = if ndim.extract::<i64>().is_ok_and(|n| n == 0) {
            Some(1)
        } else {
            element_count(value)
        };
        if count == Some(1) {
            if let Ok(item) = value.call_method0(intern!(py, "item")) {
                if let Ok(f) = item.extract::<f64>() {
                    return Ok(f);
                }
            }
        }
        let shape = value
            .getattr(intern!(py, "shape"))
            .and_then(|s| s.str().map(|s| s.to_string()))
            .unwrap_or_else(|_| "?".into());
        return Err(wrong_type(what, value, Some(shape)));
    }
    value
        .extract::<f64>()
        .map_err(|_| wrong_type(what, value, None))
}

/// `torch.Tensor`, once torch has been imported (looked up in `sys.modules`: a process that
/// never imported torch does not import it here).
fn tensor_type(py: Python<'_>) -> Option<&Bound<'_, PyType>> {
    static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    if let Some(t) = TENSOR.get(py) {
        return Some(t.bind(py));
    }
    let torch = py
        .import(intern!(py, "sys"))
        .and_then(|sys| sys.getattr(intern!(py, "modules")))
        .and_then(|m| m.get_item(intern!(py, "torch")))
        .ok()?;
    let tensor = torch
        .getattr(intern!(py, "Tensor"))
        .ok()?
        .cast_into::<PyType>()
        .ok()?;
    let _ = TENSOR.set(py, tensor.unbind());
    TENSOR.get(py).map(|t| t.bind(py))
}

/// Whether `value` is a one-element, non-complex, dense torch tensor with data on a device
/// (not the CPU, not `meta`): what `put_scalar` keeps unread until the next read, since
/// reading it now would wait for the device. Anything else (floats first, at the cost of one
/// type check) is read at once, and errors as it would.
pub fn is_device_scalar(value: &Bound<'_, PyAny>) -> bool {
    if value.is_exact_instance_of::<PyFloat>() || value.is_instance_of::<PyInt>() {
        return false;
    }
    let py = value.py();
    if !tensor_type(py).is_some_and(|t| value.is_instance(t).unwrap_or(false)) {
        return false;
    }
    let flag = |name: &Bound<'_, PyString>| {
        value
            .getattr(name)
            .and_then(|v| v.is_truthy())
            .unwrap_or(true)
    };
    if flag(intern!(py, "is_cpu")) || flag(intern!(py, "is_meta")) || flag(intern!(py, "is_sparse"))
    {
        return false;
    }
    let one = value
        .call_method0(intern!(py, "numel"))
        .and_then(|n| n.extract::<i64>())
        .is_ok_and(|n| n == 1);
    one && !value
        .call_method0(intern!(py, "is_complex"))
        .and_then(|c| c.is_truthy())
        .unwrap_or(true)
}

/// The number of elements of a tensor (`numel()`) or array (`size`).
fn element_count(value: &Bound<'_, PyAny>) -> Option<i64> {
    let py = value.py();
    if let Ok(n) = value.call_method0(intern!(py, "numel")) {
        return n.extract().ok();
    }
    value.getattr(intern!(py, "size")).ok()?.extract().ok()
}

fn wrong_type(what: &str, value: &Bound<'_, PyAny>, shape: Option<String>) -> PyErr {
    let got = match shape {
        Some(shape) => format!("a {} of shape {shape}", type_name(value)),
        None => type_name(value),
    };
    to_py(Error::wrong_type(
        format!("value for '{what}'"),
        SCALAR,
        got,
    ))
}

/// The type name of `value`, for messages.
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "<unknown type>".into())
}

/// A str argument, borrowed: any other type is a `TypeError` naming `what` (pyo3's own
/// extraction names no argument).
pub fn str_arg<'a>(what: &str, value: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
    match value.cast::<PyString>() {
        Ok(s) => s.to_str(),
        Err(_) => Err(to_py(Error::wrong_type(what, "a str", type_name(value)))),
    }
}

/// An integer argument (ints, numpy ints, anything with `__index__`; not bool) as i64: a
/// `TypeError` for other types, an `OverflowError` naming `what` beyond int64.
pub fn int64(what: &str, value: &Bound<'_, PyAny>) -> PyResult<i64> {
    if value.is_instance_of::<PyBool>() {
        return Err(to_py(Error::wrong_type(what, "an int", "bool")));
    }
    match value.extract::<i64>() {
        Ok(i) => Ok(i),
        Err(_)
            if value.is_instance_of::<PyInt>() || value.hasattr("__index__").unwrap_or(false) =>
        {
            Err(to_py(Error::OutOfRange {
                what: what.to_owned(),
                value: value.str().map(|s| s.to_string()).unwrap_or_default(),
                range: "int64",
            }))
        }
        Err(_) => Err(to_py(Error::wrong_type(what, "an int", type_name(value)))),
    }
}

/// An iteration argument: an int (numpy ints included) or a float; `None` maps to `None`.
pub fn iteration(what: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Iter>> {
    let Some(value) = value else { return Ok(None) };
    if value.is_none() {
        return Ok(None);
    }
    // A plain int, the common case, first: exact type checks cost no subtype walk.
    let i = if value.is_exact_instance_of::<PyInt>() {
        match value.extract::<i64>() {
            Ok(i) => i,
            Err(_) => int64(what, value)?, // beyond int64: its error
        }
    } else if let Ok(f) = value.cast::<PyFloat>() {
        return Ok(Some(Iter::Float(f.value())));
    } else {
        int64(what, value)?
    };
    let i = hookloop_core::iter::exact_iter(what, i).map_err(|e| to_py(e.into()))?;
    Ok(Some(Iter::Int(i)))
}

/// Converts an iteration back to a Python int or float.
pub fn iter_to_py<'py>(py: Python<'py>, it: Iter) -> PyResult<Bound<'py, PyAny>> {
    match it {
        Iter::Int(i) => i.into_bound_py_any(py),
        Iter::Float(f) => f.into_bound_py_any(py),
    }
}

/// `from_py_with` readers for integer arguments: an int beyond int64 is an `OverflowError`
/// naming the argument (pyo3's own extraction names none).
pub mod arg {
    use pyo3::prelude::*;

    pub fn window_size(v: &Bound<'_, PyAny>) -> PyResult<i64> {
        super::int64("window_size", v)
    }

    pub fn max_length(v: &Bound<'_, PyAny>) -> PyResult<i64> {
        super::int64("max_length", v)
    }

    pub fn max_images(v: &Bound<'_, PyAny>) -> PyResult<i64> {
        super::int64("max_images", v)
    }

    pub fn max_histograms(v: &Bound<'_, PyAny>) -> PyResult<i64> {
        super::int64("max_histograms", v)
    }

    /// `smoothing_hint`: its truth value, as detectron2 reads the hint (`None` is False).
    pub fn smoothing_hint(v: &Bound<'_, PyAny>) -> PyResult<bool> {
        v.is_truthy()
    }
}
