//! `hookloop._core`: the PyO3 shells over `hookloop-core`. Each method converts its arguments,
//! calls the core once and converts the result; the state lives in core types.

use pyo3::prelude::*;

mod convert;
mod dispatch;
mod errors;
mod history;
mod hooks;
mod pending;
mod schedule;
mod state;
mod storage;
mod writers;

/// "release" or "debug": benchmarks refuse to quote a debug build.
const BUILD_PROFILE: &str = if cfg!(debug_assertions) {
    "debug"
} else {
    "release"
};

/// The period rule of periodic hooks (`hookloop_core::dispatch::periodic_due`): due when
/// `iter + 1` is a multiple of `period`, and at `max_iter - 1`.
#[pyfunction]
fn periodic_due(iter: i64, period: i64, max_iter: i64) -> PyResult<bool> {
    let period = hookloop_core::error::positive("period", period).map_err(errors::to_py)?;
    Ok(hookloop_core::dispatch::periodic_due(
        iter,
        period as u64,
        max_iter,
    ))
}

/// Checks an image shape against the core's rule (`(C, H, W)`, C in 1, 3, 4, H and W
/// positive): `ValueError` naming the image otherwise.
#[pyfunction]
fn check_chw(tag: String, shape: Vec<i64>) -> PyResult<()> {
    hookloop_core::tfevents::check_chw(&shape)
        .map(|_| ())
        .map_err(|source| {
            errors::to_py(hookloop_core::Error::Image {
                tag,
                step: None,
                source,
            })
        })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD_PROFILE", BUILD_PROFILE)?;
    // The storage's pending queue starts or does a read at least this often (recorded
    // iterations): what a producer that reuses its buffers (a CUDA graph's ring) relies on.
    m.add(
        "PENDING_READ_EVERY",
        hookloop_core::pending::Limits::default().read_every,
    )?;
    m.add_class::<history::PyHistoryBuffer>()?;
    m.add_class::<storage::PyEventStorage>()?;
    m.add_class::<dispatch::PyDispatcher>()?;
    m.add_class::<hooks::PyIterationTimerBase>()?;
    m.add_class::<writers::PyNativeWriter>()?;
    m.add_class::<writers::PyJsonWriter>()?;
    m.add_class::<writers::PyTensorboardWriter>()?;
    m.add_class::<writers::PyMetricPrinter>()?;
    m.add_function(wrap_pyfunction!(writers::flush_writers, m)?)?;
    m.add_function(wrap_pyfunction!(writers::_take_writer_errors, m)?)?;
    m.add_function(wrap_pyfunction!(writers::_set_writer_timeout, m)?)?;
    m.add_function(wrap_pyfunction!(writers::_histogram_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(writers::_new_reader_id, m)?)?;
    m.add_function(wrap_pyfunction!(periodic_due, m)?)?;
    m.add_function(wrap_pyfunction!(check_chw, m)?)?;
    m.add_function(wrap_pyfunction!(pending::_register_tensor_reads, m)?)?;
    m.add(
        "DEFAULT_MAX_LENGTH",
        hookloop_core::History::DEFAULT_MAX_LENGTH,
    )?;
    m.add(
        "JSON_FSYNC_DEFAULT",
        hookloop_core::writer::FsyncPolicy::JSON_DEFAULT.as_str(),
    )?;
    m.add(
        "EVENTS_FSYNC_DEFAULT",
        hookloop_core::writer::FsyncPolicy::EVENTS_DEFAULT.as_str(),
    )?;
    m.add_class::<schedule::PyNativeSchedule>()?;
    m.add_class::<schedule::PyCompositeSpans>()?;
    m.add_function(wrap_pyfunction!(schedule::warmup_parts, m)?)?;
    Ok(())
}
