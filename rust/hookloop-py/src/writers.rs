//! The native writers: metrics.json, TensorBoard event files and the console line. `write()`
//! takes what is new from the storage under its lock, lets go, and queues it for the writer
//! thread (`hookloop_core::writer`); nothing here waits on the disk except `flush`/`close`,
//! which release the GIL while they wait.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use hookloop_core::error::positive;
use hookloop_core::jsonl::{group_by_iteration, JsonSink};
use hookloop_core::media::new_reader_id;
use hookloop_core::printer::Printer;
use hookloop_core::record::{HistogramPoint, ImagePoint, ScalarPoint, TensorPoint};
use hookloop_core::storage::SmoothedScalar;
use hookloop_core::tfevents::{check_image_shape, histogram_buckets, EventSink};
use hookloop_core::writer::{flush_all, take_errors, FsyncPolicy, Payload, Sink, SinkHandle};
use hookloop_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::int64;
use crate::errors::{to_py, IntoPyResult};
use crate::state::State;
use crate::storage::PyEventStorage;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The policy named `s`, or the writer's default for `None`.
fn fsync_policy(s: Option<&str>, default: FsyncPolicy) -> PyResult<FsyncPolicy> {
    let Some(s) = s else { return Ok(default) };
    FsyncPolicy::parse(s).ok_or_else(|| {
        to_py(Error::bad_value(
            "fsync",
            format!("must be 'always', 'periodic', 'close' or 'never', got '{s}'"),
        ))
    })
}

// Optional integer arguments, read as `convert::int64` reads them (see `convert::arg`).
fn optional_int64(what: &str, v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if v.is_none() {
        return Ok(None);
    }
    int64(what, v).map(Some)
}

fn max_iter_arg(v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    optional_int64("max_iter", v)
}

fn epoch_arg(v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    optional_int64("epoch", v)
}

fn not_picklable(what: &'static str) -> PyErr {
    to_py(Error::NotPicklable {
        what,
        why: "it owns an open file on hookloop's writer thread (create a new writer in the \
              other process instead)",
    })
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Base of `JsonWriter` and `TensorboardWriter`: flush, close and the shared attributes.
///
/// A forked child inherits `handle` locked if another thread of the parent was inside
/// `flush()`/`close()` (they wait with the lock held and the GIL released): every method checks
/// the process id before taking it (`handle()`), so a child gets `OSError` and never waits.
/// `last_write` is an atomic for the same reason.
#[pyclass(name = "_NativeWriter", module = "hookloop._core", frozen, subclass)]
pub struct PyNativeWriter {
    handle: Mutex<SinkHandle>,
    /// The last iteration written, as `f64` bits.
    last_write: AtomicU64,
    window_size: i64,
    kind: &'static str,
    path: PathBuf,
    /// The process that opened the writer.
    owner: u32,
}

impl PyNativeWriter {
    fn open(
        sink: Box<dyn Sink>,
        kind: &'static str,
        path: PathBuf,
        window_size: i64,
    ) -> PyResult<Self> {
        positive("window_size", window_size).py_err()?;
        let handle = SinkHandle::open(sink, kind, path.clone()).py_err()?;
        Ok(PyNativeWriter {
            handle: Mutex::new(handle),
            last_write: AtomicU64::new((-1.0f64).to_bits()),
            window_size,
            kind,
            path,
            owner: std::process::id(),
        })
    }

    /// Whether this is the process that opened the writer.
    fn in_owner(&self) -> bool {
        std::process::id() == self.owner
    }

    /// The sink handle, locked; in a forked child the `OSError` instead, before any lock.
    fn handle(&self) -> hookloop_core::Result<MutexGuard<'_, SinkHandle>> {
        if !self.in_owner() {
            return Err(Error::ForkedChild {
                writer: self.kind,
                path: self.path.clone(),
                owner: self.owner,
                pid: std::process::id(),
            });
        }
        Ok(lock(&self.handle))
    }

    fn last_write(&self) -> f64 {
        f64::from_bits(self.last_write.load(Ordering::Relaxed))
    }

    fn store_last_write(&self, value: f64) {
        self.last_write.store(value.to_bits(), Ordering::Relaxed);
    }
}

impl PyNativeWriter {
    /// The start of every write: settle the storage's pending values, report an earlier
    /// error, and take under one lock the smoothed scalars newer than `last_write` (advancing
    /// it) and whatever else `take` takes from the state. Returns the sink handle, still locked.
    fn take_new<T: Send>(
        &self,
        storage: &Bound<'_, PyEventStorage>,
        take: impl FnOnce(&mut State) -> T + Send,
    ) -> PyResult<(MutexGuard<'_, SinkHandle>, Vec<SmoothedScalar>, T)> {
        storage.get().settle(storage.py())?;
        let handle = self.handle().py_err()?;
        handle.check().py_err()?;
        let window = self.window_size;
        let mut last_write = self.last_write();
        let (smoothed, taken) = storage.get().state().with(|state| {
            let smoothed = state.core.smoothed_since(window, &mut last_write);
            (smoothed, take(state))
        });
        let smoothed = smoothed.py_err()?;
        self.store_last_write(last_write);
        Ok((handle, smoothed, taken))
    }
}

#[pymethods]
impl PyNativeWriter {
    /// Waits until everything queued is in the file (and fsynced per policy).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.handle()?.flush()).py_err()
    }

    /// Writes what is queued, fsyncs per policy and closes the file; closing twice is a no-op.
    /// In a forked child it does nothing: the file belongs to the parent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if !self.in_owner() {
            return Ok(());
        }
        py.detach(|| self.handle()?.close()).py_err()
    }

    /// The file (for TensorBoard: the event file, created at the first write).
    #[getter]
    fn path(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }

    #[getter]
    fn window_size(&self) -> i64 {
        self.window_size
    }

    /// The last iteration written (-1 before the first write).
    #[getter]
    fn _last_write(&self) -> f64 {
        self.last_write()
    }

    /// A resumed run restarts at iteration `start`: drops (metrics.json) or marks as stale
    /// (TensorBoard's purge marker) what was written for iterations >= `start`, and makes
    /// the next `write()` write only what is newer than `start - 1`. Returns the number of
    /// lines removed (0 for TensorBoard, whose reader does the removing).
    fn _purge_from(&self, py: Python<'_>, start: i64) -> PyResult<u64> {
        let from = start as f64;
        let removed = py
            .detach(|| self.handle()?.purge(wall_time(), from))
            .py_err()?;
        self.store_last_write(from - 1.0);
        Ok(removed)
    }

    /// Sets the last iteration written: the next `write()` writes only what is newer.
    #[setter(_last_write)]
    fn set_last_write(&self, value: f64) {
        self.store_last_write(value);
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(not_picklable("hookloop writer"))
    }
}

/// metrics.json writer (`hookloop.utils.events.JSONWriter` wraps it).
#[pyclass(name = "JSONWriter", module = "hookloop._core", frozen, extends = PyNativeWriter)]
pub struct PyJsonWriter;

#[pymethods]
impl PyJsonWriter {
    #[new]
    #[pyo3(signature = (json_file, window_size = 20, fsync = None))]
    fn new(
        json_file: PathBuf,
        #[pyo3(from_py_with = crate::convert::arg::window_size)] window_size: i64,
        fsync: Option<&str>,
    ) -> PyResult<PyClassInitializer<Self>> {
        positive("window_size", window_size).py_err()?;
        let fsync = fsync_policy(fsync, FsyncPolicy::JSON_DEFAULT)?;
        let sink = JsonSink::open(&json_file, fsync).py_err()?;
        let base = PyNativeWriter::open(Box::new(sink), "JSONWriter", json_file, window_size)?;
        Ok(PyClassInitializer::from(base).add_subclass(PyJsonWriter))
    }

    /// Queues one line per iteration with scalars not yet written.
    fn write(slf: &Bound<'_, Self>, storage: &Bound<'_, PyEventStorage>) -> PyResult<()> {
        let (handle, smoothed, ()) = slf.as_super().get().take_new(storage, |_| ())?;
        let rows = group_by_iteration(smoothed);
        if rows.is_empty() {
            return Ok(());
        }
        handle.send(Payload::Json(rows)).py_err()
    }

    /// Appends `text` to metrics.json in order with the writer's own lines (what a subclass
    /// writes through `_file_handle`).
    fn _write_text(slf: &Bound<'_, Self>, text: String) -> PyResult<()> {
        let base = slf.as_super().get();
        base.handle().py_err()?.send(Payload::Text(text)).py_err()
    }
}

/// TensorBoard event-file writer (`hookloop.utils.events.TensorboardXWriter` wraps it).
#[pyclass(name = "TensorboardXWriter", module = "hookloop._core", frozen, extends = PyNativeWriter)]
pub struct PyTensorboardWriter {
    /// Its id as a reader of the storage's images and histograms (`hookloop_core::media`).
    reader: u64,
}

type ImageArg<'py> = (String, i64, u32, u32, u8, Bound<'py, PyBytes>);
type HistArg = (String, i64, f64, f64, f64, f64, f64, Vec<f64>, Vec<f64>);

#[pymethods]
impl PyTensorboardWriter {
    #[new]
    #[pyo3(signature = (log_dir, window_size = 20, hostname = "localhost", filename_suffix = "", fsync = None))]
    fn new(
        log_dir: PathBuf,
        #[pyo3(from_py_with = crate::convert::arg::window_size)] window_size: i64,
        hostname: &str,
        filename_suffix: &str,
        fsync: Option<&str>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let fsync = fsync_policy(fsync, FsyncPolicy::EVENTS_DEFAULT)?;
        let sink = EventSink::new(log_dir, hostname, filename_suffix, fsync);
        let path = sink.path();
        let base = PyNativeWriter::open(Box::new(sink), "TensorboardXWriter", path, window_size)?;
        Ok(
            PyClassInitializer::from(base).add_subclass(PyTensorboardWriter {
                reader: new_reader_id(),
            }),
        )
    }

    /// Queues new smoothed scalars and the storage's histograms this writer has not read;
    /// returns how many images it has not read (the Python layer takes those with
    /// `storage._take_images(self._reader)`, converts the tensors and calls `add_points`).
    fn write(slf: &Bound<'_, Self>, storage: &Bound<'_, PyEventStorage>) -> PyResult<usize> {
        let reader = slf.get().reader;
        let (handle, smoothed, (histograms, n_images)) =
            slf.as_super().get().take_new(storage, |state| {
                let iter = state.core.iter();
                (
                    state.core.read_histograms(reader),
                    state.images.unread(reader, iter),
                )
            })?;
        let scalars: Vec<ScalarPoint> = smoothed
            .into_iter()
            .map(|s| ScalarPoint {
                tag: s.name,
                value: s.value,
                step: s.iter.as_f64() as i64,
            })
            .collect();
        if !scalars.is_empty() || !histograms.is_empty() {
            let payload = Payload::Events {
                wall_time: wall_time(),
                scalars,
                images: vec![],
                histograms,
                tensors: vec![],
            };
            handle.send(payload).py_err()?;
        }
        Ok(n_images)
    }

    /// Its id as a reader of the storage's images and histograms.
    #[getter]
    fn _reader(&self) -> u64 {
        self.reader
    }

    /// Queues raw points: scalars `(tag, value, step)`, images `(tag, step, height, width,
    /// channels, HWC uint8 bytes)`, histograms `(tag, step, min, max, num, sum, sum_squares,
    /// bucket_limits, bucket_counts)`, texts `(tag, step, text)` (for TensorBoard's text
    /// plugin, under `tag/text_summary` as `SummaryWriter.add_text` writes them). PNG encoding
    /// happens on the writer thread.
    #[pyo3(signature = (scalars = vec![], images = vec![], histograms = vec![], texts = vec![], walltime = None))]
    fn add_points(
        slf: &Bound<'_, Self>,
        scalars: Vec<(String, f64, i64)>,
        images: Vec<ImageArg<'_>>,
        histograms: Vec<HistArg>,
        texts: Vec<(String, i64, String)>,
        walltime: Option<f64>,
    ) -> PyResult<()> {
        let scalars = scalars
            .into_iter()
            .map(|(tag, value, step)| ScalarPoint {
                tag: tag.into(),
                value,
                step,
            })
            .collect();
        let mut imgs = Vec::with_capacity(images.len());
        for (tag, step, height, width, channels, pixels) in images {
            let pixels = pixels.as_bytes().to_vec();
            let shape = check_image_shape(
                u64::from(width),
                u64::from(height),
                u64::from(channels),
                pixels.len(),
            );
            if let Err(source) = shape {
                return Err(to_py(Error::Image {
                    tag,
                    step: Some(step),
                    source,
                }));
            }
            imgs.push(ImagePoint {
                tag,
                step,
                height,
                width,
                channels,
                pixels,
            });
        }
        let histograms = histograms
            .into_iter()
            .map(
                |(tag, step, min, max, num, sum, sum_squares, bucket_limits, bucket_counts)| {
                    HistogramPoint::new(
                        tag,
                        step,
                        [min, max, num, sum, sum_squares],
                        bucket_limits,
                        bucket_counts,
                    )
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map_err(Error::from)
            .py_err()?;
        let payload = Payload::Events {
            wall_time: walltime.unwrap_or_else(wall_time),
            scalars,
            images: imgs,
            histograms,
            tensors: texts
                .into_iter()
                .map(|(tag, step, text)| TensorPoint::text(&tag, step, text))
                .collect(),
        };
        let base = slf.as_super().get();
        base.handle().py_err()?.send(payload).py_err()
    }
}

/// The console line of `CommonMetricPrinter`.
#[pyclass(
    name = "CommonMetricPrinter",
    module = "hookloop._core",
    frozen,
    subclass
)]
pub struct PyMetricPrinter {
    inner: Mutex<Printer>,
}

#[pymethods]
impl PyMetricPrinter {
    #[new]
    #[pyo3(signature = (max_iter = None, window_size = 20, epoch = None))]
    fn new(
        #[pyo3(from_py_with = max_iter_arg)] max_iter: Option<i64>,
        #[pyo3(from_py_with = crate::convert::arg::window_size)] window_size: i64,
        #[pyo3(from_py_with = epoch_arg)] epoch: Option<i64>,
    ) -> PyResult<Self> {
        positive("window_size", window_size).py_err()?;
        if let Some(e) = epoch {
            positive("epoch", e).py_err()?;
            if max_iter.is_none() {
                return Err(to_py(Error::bad_value(
                    "CommonMetricPrinter(epoch=...)",
                    "needs max_iter",
                )));
            }
        }
        Ok(PyMetricPrinter {
            inner: Mutex::new(Printer::new(max_iter, window_size, epoch).py_err()?),
        })
    }

    /// The line for the storage's current iteration, or None at `max_iter`. `epoch`:
    /// the trainer's `(current, total)` epoch, counted from 1, or None.
    #[pyo3(signature = (storage, max_mem_mb, now, epoch = None))]
    fn format(
        &self,
        storage: &Bound<'_, PyEventStorage>,
        max_mem_mb: Option<f64>,
        now: f64,
        epoch: Option<(i64, i64)>,
    ) -> PyResult<Option<String>> {
        storage.get().settle(storage.py())?;
        let mut guard = lock(&self.inner);
        let printer: &mut Printer = &mut guard;
        storage
            .get()
            .with(|core| printer.format(core, max_mem_mb, now, epoch))
            .py_err()
    }

    /// detectron2's `_get_eta`: the ETA string (None when it cannot be estimated yet, "" when
    /// there is no `max_iter`); puts `eta_seconds` when a `time` metric exists. `now` is
    /// `time.perf_counter()`.
    fn _get_eta(&self, storage: &Bound<'_, PyEventStorage>, now: f64) -> PyResult<Option<String>> {
        storage.get().settle(storage.py())?;
        let mut guard = lock(&self.inner);
        let printer: &mut Printer = &mut guard;
        storage.get().with(|core| printer.eta(core, now)).py_err()
    }

    /// detectron2's `_last_write`: `(iteration, time.perf_counter())` of the last wall-time ETA
    /// estimate, or None.
    #[getter]
    fn _last_write(&self) -> Option<(i64, f64)> {
        lock(&self.inner).last_write
    }

    #[setter(_last_write)]
    fn set_last_write(&self, value: Option<(i64, f64)>) {
        lock(&self.inner).last_write = value;
    }

    /// The run's last iteration, for the ETA (None: no ETA).
    #[getter]
    fn _max_iter(&self) -> Option<i64> {
        lock(&self.inner).max_iter()
    }

    #[setter(_max_iter)]
    fn set_max_iter(&self, max_iter: Option<i64>) {
        lock(&self.inner).set_max_iter(max_iter);
    }

    #[getter]
    fn _window_size(&self) -> i64 {
        lock(&self.inner).window_size()
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(not_picklable("CommonMetricPrinter"))
    }
}

/// Sets how long `flush()`, `close()` and interpreter exit wait for a blocked file (seconds;
/// `None`: `HOOKLOOP_WRITER_TIMEOUT`, else 10 s).
/// TensorBoard's bucket layout of `numpy.histogram`'s `counts` between `edges`, as torch's
/// `SummaryWriter.add_histogram` lays it out: `(bucket_limits, bucket_counts)`.
#[pyfunction]
#[pyo3(signature = (edges, counts, max_bins = None))]
pub fn _histogram_buckets(
    edges: Vec<f64>,
    counts: Vec<f64>,
    max_bins: Option<i64>,
) -> PyResult<(Vec<f64>, Vec<f64>)> {
    histogram_buckets(&edges, &counts, max_bins)
        .map_err(|reason| to_py(Error::bad_value("histogram", reason)))
}

#[pyfunction]
#[pyo3(signature = (seconds))]
pub fn _set_writer_timeout(seconds: Option<f64>) -> PyResult<()> {
    hookloop_core::writer::set_writer_timeout(seconds).py_err()
}

/// Waits until every writer of this process has written what it queued.
#[pyfunction]
pub fn flush_writers(py: Python<'_>) -> PyResult<()> {
    py.detach(flush_all).py_err()
}

/// The errors the writer thread met that no `write()`/`flush()`/`close()` reported yet (each
/// as the `OSError` it would have raised), removed from their writers. Interpreter exit logs
/// them after `flush_writers()`.
#[pyfunction]
pub fn _take_writer_errors(py: Python<'_>) -> Vec<Py<PyAny>> {
    take_errors()
        .into_iter()
        .map(|e| to_py(e).into_value(py).into_any())
        .collect()
}

/// Logs `err` at ERROR on `hookloop.utils.events`'s logger (best effort: at interpreter exit
/// logging may be gone, and a destructor has nobody to raise to).
fn log_error(py: Python<'_>, message: &str, err: PyErr) {
    let _ = (|| -> PyResult<()> {
        let logger = py
            .import("logging")?
            .call_method1("getLogger", ("hookloop.utils.events",))?;
        logger.call_method1("error", ("%s: %s", message, err.into_value(py)))?;
        Ok(())
    })();
}

impl Drop for PyNativeWriter {
    /// A writer dropped without `close()`: writes what it queued, closes the file, and logs an
    /// error no call reported (there is nobody to raise it to).
    fn drop(&mut self) {
        if !self.in_owner() {
            return;
        }
        let handle = self.handle.get_mut().unwrap_or_else(|e| e.into_inner());
        if handle.is_closed() {
            return;
        }
        if let Err(e) = handle.close() {
            let message = format!(
                "{} for '{}' dropped without close() after a write failed",
                self.kind,
                self.path.display()
            );
            // try_attach: during interpreter shutdown attach would panic; stderr then.
            let text = e.to_string();
            if Python::try_attach(|py| log_error(py, &message, to_py(e))).is_none() {
                eprintln!("hookloop: {message}: {text}");
            }
        }
    }
}

/// A new id for a writer that reads the storage's images and histograms
/// (`EventStorage._take_images(reader)`): each reader gets every one.
#[pyfunction]
pub fn _new_reader_id() -> u64 {
    new_reader_id()
}
