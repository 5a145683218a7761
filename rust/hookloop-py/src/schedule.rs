//! `NativeSchedule` and `CompositeSpans`: the shells over the core's fvcore schedules
//! (`hookloop-core/src/schedule.rs`), and `LRMultiplier`'s per-step work in one call.

use hookloop_core::pyexact::SumMode;
use hookloop_core::schedule::{self, Kind, Scaling, Schedule, Spans, WarmupParts};
use hookloop_core::Error;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyTuple};

use crate::convert::type_name;
use crate::errors::{to_py, IntoPyResult};

/// How this interpreter's `sum()` adds floats (CPython 3.12 changed it).
fn sum_mode(py: Python<'_>) -> SumMode {
    SumMode::for_python_minor(py.version_info().minor)
}

/// fvcore's integer arguments (`isinstance(k, int)`, else `ValueError`).
fn int_arg(what: &'static str, name: &str, value: &Bound<'_, PyAny>) -> PyResult<i64> {
    if value.is_instance_of::<PyInt>() {
        if let Ok(v) = value.extract::<i64>() {
            return Ok(v);
        }
    }
    Err(to_py(Error::BadSchedule {
        what,
        reason: format!(
            "num_decays and num_updates must be positive integers: {name}={} ({})",
            value.repr().map(|r| r.to_string()).unwrap_or_default(),
            type_name(value)
        ),
    }))
}

/// A parameter schedule evaluated in Rust: fvcore's schedules, composites of them and
/// detectron2's warmup. Immutable; built by the static constructors named after the fvcore
/// classes. Calling it (or `value`) gives the value at training progress `where`.
#[pyclass(name = "NativeSchedule", module = "hookloop._core", frozen, eq)]
#[derive(PartialEq)]
pub struct PyNativeSchedule {
    core: Schedule,
}

impl PyNativeSchedule {
    fn wrap(core: Schedule) -> Self {
        PyNativeSchedule { core }
    }
}

/// The intervals of a composite schedule (fvcore's `lengths` and `interval_scaling`,
/// validated and normalized), usable on their own by a composite of Python schedules.
#[pyclass(name = "CompositeSpans", module = "hookloop._core", frozen, eq)]
#[derive(PartialEq)]
pub struct PyCompositeSpans {
    core: Spans,
}

fn scaling_list(values: &[String]) -> PyResult<Vec<Scaling>> {
    values.iter().map(|s| Scaling::parse(s).py_err()).collect()
}

#[pymethods]
impl PyCompositeSpans {
    #[new]
    fn new(py: Python<'_>, lengths: Vec<f64>, interval_scaling: Vec<String>) -> PyResult<Self> {
        let scaling = scaling_list(&interval_scaling)?;
        let core = Spans::new(&lengths, scaling, sum_mode(py)).py_err()?;
        Ok(PyCompositeSpans { core })
    }

    /// `(index, where)`: the interval `where` falls in and the `where` its schedule sees.
    #[pyo3(signature = (r#where))]
    fn locate(&self, r#where: f64) -> PyResult<(usize, f64)> {
        self.core.locate(r#where).py_err()
    }

    /// The lengths, the last one normalized as fvcore does.
    #[getter]
    fn lengths(&self) -> Vec<f64> {
        self.core.lengths().to_vec()
    }

    #[getter]
    fn interval_scaling(&self) -> Vec<&'static str> {
        self.core.scaling().iter().map(|s| s.as_str()).collect()
    }

    fn __len__(&self) -> usize {
        self.core.len()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "CompositeSpans(lengths={}, interval_scaling={})",
            self.lengths().into_pyobject(py)?.repr()?,
            self.interval_scaling().into_pyobject(py)?.repr()?
        ))
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let me = slf.get();
        let args = PyTuple::new(
            py,
            [
                me.lengths().into_pyobject(py)?.into_any(),
                me.interval_scaling().into_pyobject(py)?.into_any(),
            ],
        )?;
        Ok((slf.get_type().into_any(), args))
    }
}

/// A learning rate from `base_lrs`: a float or an int. Tensors are refused (setting a float
/// would replace the optimizer's tensor LR); `LRMultiplier` steps those in Python.
fn base_lr(index: usize, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if let Ok(f) = value.cast_exact::<PyFloat>() {
        return Ok(f.value());
    }
    if value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>() {
        return value.extract::<f64>();
    }
    if let Ok(f) = value.cast::<PyFloat>() {
        return Ok(f.value());
    }
    Err(to_py(Error::wrong_type(
        format!("base_lrs[{index}]"),
        "a float",
        type_name(value),
    )))
}

fn to_params<'py>(py: Python<'py>, s: &Schedule) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match s.kind() {
        Kind::Constant { value } => {
            d.set_item("kind", "constant")?;
            d.set_item("value", value)?;
        }
        Kind::Cosine {
            start_value,
            end_value,
        } => {
            d.set_item("kind", "cosine")?;
            d.set_item("start_value", start_value)?;
            d.set_item("end_value", end_value)?;
        }
        Kind::Exponential { start_value, decay } => {
            d.set_item("kind", "exponential")?;
            d.set_item("start_value", start_value)?;
            d.set_item("decay", decay)?;
        }
        Kind::Linear {
            start_value,
            end_value,
        } => {
            d.set_item("kind", "linear")?;
            d.set_item("start_value", start_value)?;
            d.set_item("end_value", end_value)?;
        }
        Kind::MultiStep {
            values,
            num_updates,
            milestones,
        } => {
            d.set_item("kind", "multi_step")?;
            d.set_item("values", values)?;
            d.set_item("num_updates", num_updates)?;
            d.set_item("milestones", milestones)?;
        }
        Kind::PolynomialDecay { base_value, power } => {
            d.set_item("kind", "polynomial_decay")?;
            d.set_item("base_value", base_value)?;
            d.set_item("power", power)?;
        }
        Kind::Step {
            num_updates,
            values,
        } => {
            d.set_item("kind", "step")?;
            d.set_item("num_updates", num_updates)?;
            d.set_item("values", values)?;
        }
        Kind::StepWithFixedGamma {
            base_value,
            num_decays,
            gamma,
            num_updates,
            ..
        } => {
            d.set_item("kind", "step_with_fixed_gamma")?;
            d.set_item("base_value", base_value)?;
            d.set_item("num_decays", num_decays)?;
            d.set_item("gamma", gamma)?;
            d.set_item("num_updates", num_updates)?;
        }
        Kind::Composite { schedules, spans } => {
            d.set_item("kind", "composite")?;
            let parts = PyList::empty(py);
            for part in schedules {
                parts.append(to_params(py, part)?)?;
            }
            d.set_item("schedules", parts)?;
            d.set_item("lengths", spans.lengths())?;
            let scaling: Vec<&str> = spans.scaling().iter().map(|s| s.as_str()).collect();
            d.set_item("interval_scaling", scaling)?;
        }
    }
    Ok(d)
}

fn param<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    match d.get_item(key)? {
        Some(v) => v.extract::<T>().map_err(Into::into),
        None => Err(to_py(Error::BadState {
            what: "NativeSchedule",
            reason: format!("params have no {key:?}"),
        })),
    }
}

fn from_params(d: &Bound<'_, PyDict>) -> PyResult<Schedule> {
    let py = d.py();
    let kind: String = param(d, "kind")?;
    let s = match kind.as_str() {
        "constant" => Schedule::constant(param(d, "value")?),
        "cosine" => Schedule::cosine(param(d, "start_value")?, param(d, "end_value")?),
        "exponential" => Schedule::exponential(param(d, "start_value")?, param(d, "decay")?),
        "linear" => Schedule::linear(param(d, "start_value")?, param(d, "end_value")?),
        "multi_step" => Schedule::multi_step(
            param(d, "values")?,
            Some(param(d, "num_updates")?),
            Some(param(d, "milestones")?),
        )
        .py_err()?,
        "polynomial_decay" => {
            Schedule::polynomial_decay(param(d, "base_value")?, param(d, "power")?)
        }
        "step" => Schedule::step(param(d, "num_updates")?, param(d, "values")?).py_err()?,
        "step_with_fixed_gamma" => Schedule::step_with_fixed_gamma(
            param(d, "base_value")?,
            param(d, "num_decays")?,
            param(d, "gamma")?,
            param(d, "num_updates")?,
        )
        .py_err()?,
        "composite" => {
            let parts: Vec<Bound<'_, PyDict>> = param(d, "schedules")?;
            let schedules = parts
                .iter()
                .map(from_params)
                .collect::<PyResult<Vec<_>>>()?;
            let lengths: Vec<f64> = param(d, "lengths")?;
            let scaling: Vec<String> = param(d, "interval_scaling")?;
            let spans = Spans::new(&lengths, scaling_list(&scaling)?, sum_mode(py)).py_err()?;
            Schedule::composite(schedules, spans).py_err()?
        }
        other => {
            return Err(to_py(Error::BadState {
                what: "NativeSchedule",
                reason: format!("unknown kind {other:?}"),
            }))
        }
    };
    Ok(s)
}

#[pymethods]
impl PyNativeSchedule {
    /// fvcore's `ConstantParamScheduler(value)`.
    #[staticmethod]
    fn constant(value: f64) -> Self {
        Self::wrap(Schedule::constant(value))
    }

    /// fvcore's `CosineParamScheduler(start_value, end_value)`.
    #[staticmethod]
    fn cosine(start_value: f64, end_value: f64) -> Self {
        Self::wrap(Schedule::cosine(start_value, end_value))
    }

    /// fvcore's `ExponentialParamScheduler(start_value, decay)`.
    #[staticmethod]
    fn exponential(start_value: f64, decay: f64) -> Self {
        Self::wrap(Schedule::exponential(start_value, decay))
    }

    /// fvcore's `LinearParamScheduler(start_value, end_value)`.
    #[staticmethod]
    fn linear(start_value: f64, end_value: f64) -> Self {
        Self::wrap(Schedule::linear(start_value, end_value))
    }

    /// fvcore's `MultiStepParamScheduler(values, num_updates=None, milestones=None)`.
    #[staticmethod]
    #[pyo3(signature = (values, num_updates = None, milestones = None))]
    fn multi_step(
        values: Vec<f64>,
        num_updates: Option<f64>,
        milestones: Option<Vec<f64>>,
    ) -> PyResult<Self> {
        Schedule::multi_step(values, num_updates, milestones)
            .py_err()
            .map(Self::wrap)
    }

    /// fvcore's `PolynomialDecayParamScheduler(base_value, power)`.
    #[staticmethod]
    fn polynomial_decay(base_value: f64, power: f64) -> Self {
        Self::wrap(Schedule::polynomial_decay(base_value, power))
    }

    /// fvcore's `StepParamScheduler(num_updates, values)`.
    #[staticmethod]
    fn step(num_updates: f64, values: Vec<f64>) -> PyResult<Self> {
        Schedule::step(num_updates, values).py_err().map(Self::wrap)
    }

    /// fvcore's `StepWithFixedGammaParamScheduler(base_value, num_decays, gamma, num_updates)`.
    #[staticmethod]
    fn step_with_fixed_gamma(
        base_value: f64,
        num_decays: &Bound<'_, PyAny>,
        gamma: f64,
        num_updates: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        const WHAT: &str = "StepWithFixedGammaParamScheduler";
        let num_decays = int_arg(WHAT, "num_decays", num_decays)?;
        let num_updates = int_arg(WHAT, "num_updates", num_updates)?;
        Schedule::step_with_fixed_gamma(base_value, num_decays, gamma, num_updates)
            .py_err()
            .map(Self::wrap)
    }

    /// fvcore's `CompositeParamScheduler` of native schedules over `spans`.
    #[staticmethod]
    fn composite(
        schedules: Vec<Bound<'_, PyNativeSchedule>>,
        spans: &Bound<'_, PyCompositeSpans>,
    ) -> PyResult<Self> {
        let parts = schedules.iter().map(|s| s.get().core.clone()).collect();
        Schedule::composite(parts, spans.get().core.clone())
            .py_err()
            .map(Self::wrap)
    }

    /// Rebuilds a schedule from `params` (what pickling uses).
    #[staticmethod]
    fn _from_params(params: &Bound<'_, PyDict>) -> PyResult<Self> {
        from_params(params).map(Self::wrap)
    }

    /// The value at training progress `where`.
    #[pyo3(signature = (r#where))]
    fn __call__(&self, r#where: f64) -> PyResult<f64> {
        self.core.value(r#where).py_err()
    }

    /// The value at training progress `where` (same as calling the schedule).
    #[pyo3(signature = (r#where))]
    fn value(&self, r#where: f64) -> PyResult<f64> {
        self.core.value(r#where).py_err()
    }

    /// `LRMultiplier`'s multiplier after `iter` of `max_iter` steps: `value(iter / max_iter)`.
    fn multiplier(&self, iter: i64, max_iter: i64) -> PyResult<f64> {
        self.core.multiplier(iter, max_iter).py_err()
    }

    /// `iter / max_iter`, refusing an iteration outside `[0, max_iter]` (`ValueError` naming
    /// it) and a non-positive `max_iter`.
    #[staticmethod]
    fn progress(iter: i64, max_iter: i64) -> PyResult<f64> {
        schedule::progress(iter, max_iter).py_err()
    }

    /// `LRMultiplier`'s step in one call: computes the multiplier at `last_iter` of
    /// `max_iter` once, sets `param_groups[i]["lr"] = base_lrs[i] * multiplier` for every
    /// group, and returns the new LRs (what torch keeps as `_last_lr`). Nothing is written
    /// when any argument is bad.
    fn step_lrs<'py>(
        &self,
        param_groups: &Bound<'py, PyAny>,
        base_lrs: &Bound<'py, PyAny>,
        last_iter: i64,
        max_iter: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = param_groups.py();
        let multiplier = self.core.multiplier(last_iter, max_iter).py_err()?;
        let groups = param_groups.cast::<PyList>().map_err(|_| {
            to_py(Error::wrong_type(
                "param_groups",
                "a list of dicts",
                type_name(param_groups),
            ))
        })?;
        let bases = base_lrs.cast::<PyList>().map_err(|_| {
            to_py(Error::wrong_type(
                "base_lrs",
                "a list of floats",
                type_name(base_lrs),
            ))
        })?;
        if groups.len() != bases.len() {
            return Err(to_py(Error::bad_value(
                "base_lrs",
                format!(
                    "has {} entries but the optimizer has {} param groups",
                    bases.len(),
                    groups.len()
                ),
            )));
        }
        let mut targets = Vec::with_capacity(groups.len());
        for (i, (group, base)) in groups.iter().zip(bases.iter()).enumerate() {
            let group = group.cast_into::<PyDict>().map_err(|e| {
                to_py(Error::wrong_type(
                    format!("param_groups[{i}]"),
                    "a dict",
                    type_name(&e.into_inner()),
                ))
            })?;
            // Python's `base_lr * multiplier`.
            let lr = PyFloat::new(py, base_lr(i, &base)? * multiplier);
            targets.push((group, lr));
        }
        let key = intern!(py, "lr");
        for (group, lr) in &targets {
            group.set_item(key, lr)?;
        }
        let lrs = PyList::new(py, targets.into_iter().map(|(_, lr)| lr))?;
        Ok(lrs)
    }

    /// The schedule's kind and parameters as plain Python data (nested for composites).
    #[getter]
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        to_params(py, &self.core)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "NativeSchedule({})",
            to_params(py, &self.core)?.repr()?
        ))
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let ctor = slf.get_type().getattr(intern!(py, "_from_params"))?;
        let args = PyTuple::new(py, [to_params(py, &slf.get().core)?])?;
        Ok((ctor, args))
    }
}

/// Wraps core errors and errors raised by a Python schedule, for `WarmupParts::new`.
struct Failure(PyErr);

impl From<Error> for Failure {
    fn from(err: Error) -> Self {
        Failure(to_py(err))
    }
}

/// detectron2's `WarmupParamScheduler` arguments resolved against `scheduler` (a
/// `NativeSchedule` or any callable from `where` to a number):
/// `(start_value, end_value, spans)`. The warmup stage is `Constant(start_value)` for
/// `warmup_method="constant"`, else `Linear(start_value, end_value)`.
#[pyfunction]
#[pyo3(signature = (scheduler, warmup_factor, warmup_length, warmup_method = "linear", rescale_interval = None))]
pub fn warmup_parts(
    scheduler: &Bound<'_, PyAny>,
    warmup_factor: f64,
    warmup_length: f64,
    warmup_method: &str,
    rescale_interval: Option<&Bound<'_, PyAny>>,
) -> PyResult<(f64, f64, PyCompositeSpans)> {
    let py = scheduler.py();
    // Any truthy value, as detectron2's `if rescale_interval`.
    let rescale_interval = match rescale_interval {
        Some(v) => v.is_truthy()?,
        None => false,
    };
    let native = scheduler.cast::<PyNativeSchedule>().ok();
    let inner = |w: f64| -> Result<f64, Failure> {
        match &native {
            Some(s) => Ok(s.get().core.value(w)?),
            None => scheduler
                .call1((w,))
                .and_then(|v| v.extract::<f64>())
                .map_err(Failure),
        }
    };
    let parts = WarmupParts::new(
        inner,
        warmup_factor,
        warmup_length,
        warmup_method,
        rescale_interval,
        sum_mode(py),
    )
    .map_err(|f| f.0)?;
    Ok((
        parts.start_value,
        parts.end_value,
        PyCompositeSpans { core: parts.spans },
    ))
}
