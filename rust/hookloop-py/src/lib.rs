//! `hookloop._core`: the PyO3 shells over `hookloop-core`. Each method converts its arguments,
//! calls the core once and converts the result; the state lives in core types.

use pyo3::prelude::*;

mod convert;
mod dispatch;
mod errors;
mod history;
mod hooks;
mod schedule;
mod storage;
mod writers;

/// "release" or "debug": benchmarks refuse to quote a debug build.
const BUILD_PROFILE: &str = if cfg!(debug_assertions) {
    "debug"
} else {
    "release"
};

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD_PROFILE", BUILD_PROFILE)?;
    m.add_class::<history::PyHistoryBuffer>()?;
    m.add_class::<storage::PyEventStorage>()?;
    m.add_class::<dispatch::PyDispatcher>()?;
    m.add_class::<hooks::PyIterationTimerBase>()?;
    m.add_class::<hooks::PyPeriodicWriterBase>()?;
    m.add_class::<hooks::PyLRSchedulerBase>()?;
    m.add_class::<writers::PyNativeWriter>()?;
    m.add_class::<writers::PyJsonWriter>()?;
    m.add_class::<writers::PyTensorboardWriter>()?;
    m.add_class::<writers::PyMetricPrinter>()?;
    m.add_function(wrap_pyfunction!(writers::flush_writers, m)?)?;
    m.add_class::<schedule::PyNativeSchedule>()?;
    m.add_class::<schedule::PyCompositeSpans>()?;
    m.add_function(wrap_pyfunction!(schedule::warmup_parts, m)?)?;
    Ok(())
}
