//! The writer thread: one background thread per process owns every open metrics file.
//!
//! A writer's `write()` on the training thread takes a snapshot of what is new and sends it
//! here; formatting (JSON, protobuf, PNG) and I/O happen on this thread. The thread drains
//! everything queued before touching the disk, so a burst of writes costs one write call and at
//! most one fsync per file. An I/O error is kept in the writer's `Status` and handed back to the
//! training thread at its next `write()`, `flush()` or `close()`.
//!
//! Durability: each batch reaches its file in page-bounded write calls that end on a line or
//! record boundary (`crate::append`), so after SIGKILL a file holds only whole lines and
//! records up to 4 KiB; the JSON sink cuts a torn longer line when the file is opened again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::Duration;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::jsonl::JsonRow;
use crate::tfevents::{HistogramPoint, ImagePoint, ScalarPoint};
use crate::{Error, Result};

/// When a writer's file is fsynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// After each batch of writes reaches the file (detectron2's JSONWriter fsyncs each write).
    Always,
    /// Only when the writer is closed (writes still reach the OS at once and survive a crash
    /// of the process, not of the machine).
    Close,
    /// Never.
    Never,
}

impl FsyncPolicy {
    /// `JSONWriter`'s default (detectron2's JSONWriter fsyncs each write).
    pub const JSON_DEFAULT: FsyncPolicy = FsyncPolicy::Always;
    /// `TensorboardXWriter`'s default.
    pub const EVENTS_DEFAULT: FsyncPolicy = FsyncPolicy::Close;

    /// The policy's name, as `parse` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            FsyncPolicy::Always => "always",
            FsyncPolicy::Close => "close",
            FsyncPolicy::Never => "never",
        }
    }

    /// Parses "always", "close" or "never".
    pub fn parse(s: &str) -> Option<FsyncPolicy> {
        match s {
            "always" => Some(FsyncPolicy::Always),
            "close" => Some(FsyncPolicy::Close),
            "never" => Some(FsyncPolicy::Never),
            _ => None,
        }
    }
}

/// What a writer hands to the thread.
#[derive(Debug)]
pub enum Payload {
    /// Text for metrics.json as is (a `JSONWriter` subclass's own lines).
    Text(String),
    Json(Vec<JsonRow>),
    Events {
        wall_time: f64,
        scalars: Vec<ScalarPoint>,
        images: Vec<ImagePoint>,
        histograms: Vec<HistogramPoint>,
    },
}

/// A file owned by the writer thread.
pub trait Sink: Send {
    /// Formats a payload into the sink's buffer (no I/O; the thread calls `sync` once per
    /// batch, so a burst of writes is one write call and at most one fsync).
    fn write(&mut self, payload: Payload) -> Result<()>;
    /// Appends the buffer to the file in one write call (on error nothing partial stays in
    /// the file), then fsyncs if the policy says so after each batch.
    fn sync(&mut self) -> Result<()>;
    /// Appends the buffer, syncs per policy, and closes.
    fn close(&mut self) -> Result<()>;
    /// A resumed run restarts at iteration `from`: removes (metrics.json) or marks as stale
    /// (TensorBoard) what an earlier run wrote for iterations >= `from`. Returns how many
    /// entries were removed, when the format can tell.
    fn purge(&mut self, wall_time: f64, from: f64) -> Result<u64>;
    /// Checks that the file still exists at its path (a flush calls it on every sink, so a
    /// deleted output directory is reported even when nothing new was written).
    fn verify(&mut self) -> Result<()> {
        Ok(())
    }
}

/// A writer's error slot, shared with the thread.
#[derive(Default)]
struct Status {
    error: Mutex<Option<Error>>,
}

impl Status {
    fn set(&self, err: Error) {
        let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
        // Keep the first unreported error: it is the cause, later ones its consequences.
        if slot.is_none() {
            *slot = Some(err);
        }
    }

    fn take(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

enum Msg {
    Open(u64, Box<dyn Sink>, Arc<Status>, PathBuf),
    Write(u64, Payload),
    Purge(u64, f64, f64, SyncSender<Result<u64>>),
    Close(u64, Ack),
    Barrier(Ack),
}

/// A one-shot "done" signal from the writer thread.
type Ack = SyncSender<()>;

/// How often the writer thread looks for new writes while writers are active.
///
/// Writes do not wake the thread: waking a sleeping thread costs the sender a futex call and,
/// on a VM, an inter-processor interrupt, ~15 µs measured here, more than the write itself.
/// The thread polls instead, so a metric reaches the file within milliseconds. Open, close,
/// flush and a full queue wake it at once.
const POLL: Duration = Duration::from_millis(5);

/// Empty polls after which the thread sleeps until woken: idle writers cost no wake-ups (the
/// next write after such a pause pays one wake).
const IDLE_POLLS: u32 = 40;

/// Messages queued before a sender waits for the thread: a writer that cannot keep up slows
/// training down instead of growing memory without limit.
const MAX_QUEUED: usize = 16_384;

/// Messages handled before the thread writes what they formatted: a writer that queues faster
/// than the thread drains still sees its lines reach the file in bounded batches.
const MAX_DRAIN: usize = 256;

/// The senders' side of the writer thread.
struct Queue {
    tx: SyncSender<Msg>,
    thread: Thread,
    /// Set by the thread before it sleeps without a timeout; a sender then wakes it.
    idle: Arc<AtomicBool>,
}

impl Queue {
    /// Queues `msg`; `urgent` wakes the thread at once. A full queue wakes it and waits.
    fn push(&self, msg: Msg, urgent: bool) {
        match self.tx.try_send(msg) {
            Ok(()) => {}
            Err(TrySendError::Full(msg)) => {
                self.thread.unpark();
                let _ = self.tx.send(msg);
            }
            // The thread never exits while a Queue exists; nothing to do if it did.
            Err(TrySendError::Disconnected(_)) => return,
        }
        if urgent || self.idle.swap(false, Ordering::AcqRel) {
            self.thread.unpark();
        }
    }

    /// Queues `make(ack)` and waits until the thread handled it, at most the writer timeout:
    /// past it, the error names the file the thread is stuck on (a hung mount, a FIFO nobody
    /// reads), or `own` if it is stuck nowhere in particular.
    fn round_trip(&self, own: &Path, make: impl FnOnce(Ack) -> Msg) -> Result<()> {
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        self.push(make(ack_tx), true);
        let timeout = writer_timeout();
        match ack_rx.recv_timeout(timeout) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let busy = BUSY.lock().unwrap_or_else(|e| e.into_inner()).clone();
                Err(Error::Blocked {
                    path: busy.unwrap_or_else(|| own.to_owned()),
                    seconds: timeout.as_secs_f64(),
                })
            }
            // The request was dropped unanswered: a sink panicked while it was handled.
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Error::WriterPanicked {
                path: own.to_owned(),
                message: "the writer thread failed while handling this request".into(),
            }),
            Ok(()) => Ok(()),
        }
    }
}

/// The file the writer thread is writing now, if any (named when a wait times out).
static BUSY: Mutex<Option<PathBuf>> = Mutex::new(None);

/// How long `flush()`, `close()` and interpreter exit wait for the writer thread, in
/// milliseconds (0: the default).
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(0);

/// The default wait: long enough for an fsync of a large batch on a slow disk.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a flush or close waits for a blocked file before it fails: `set_writer_timeout`,
/// else the environment's `HOOKLOOP_WRITER_TIMEOUT` (seconds), else [`DEFAULT_TIMEOUT`].
pub fn writer_timeout() -> Duration {
    match TIMEOUT_MS.load(Ordering::Relaxed) {
        0 => std::env::var("HOOKLOOP_WRITER_TIMEOUT")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64),
        ms => Duration::from_millis(ms),
    }
}

/// Sets the wait of [`writer_timeout`] (positive seconds; `None` restores the default).
pub fn set_writer_timeout(seconds: Option<f64>) -> Result<()> {
    let ms = match seconds {
        None => 0,
        Some(s) if s.is_finite() && s > 0.0 => ((s * 1000.0).ceil() as u64).max(1),
        Some(s) => {
            return Err(Error::bad_value(
                "writer timeout",
                format!("must be a positive number of seconds, got {s}"),
            ))
        }
    };
    TIMEOUT_MS.store(ms, Ordering::Relaxed);
    Ok(())
}

/// Marks the writer thread busy on `path` while `f` runs.
fn busy_on<T>(path: &Path, f: impl FnOnce() -> T) -> T {
    *BUSY.lock().unwrap_or_else(|e| e.into_inner()) = Some(path.to_owned());
    let out = f();
    *BUSY.lock().unwrap_or_else(|e| e.into_inner()) = None;
    out
}

struct ThreadHandle {
    pid: u32,
    queue: Arc<Queue>,
}

static THREAD: Mutex<Option<ThreadHandle>> = Mutex::new(None);

/// The process whose writer thread `THREAD` holds (0: none yet), readable without the lock: a
/// forked child may inherit `THREAD` locked, and must not wait on it in `flush_all`.
static THREAD_PID: AtomicU32 = AtomicU32::new(0);

/// The queue of this process's writer thread, started on first use (and again in a forked
/// child, which inherits the handle but not the thread).
fn queue() -> Result<Arc<Queue>> {
    let mut guard = THREAD.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if let Some(h) = guard.as_ref() {
        if h.pid == pid {
            return Ok(h.queue.clone());
        }
    }
    let (tx, rx) = mpsc::sync_channel(MAX_QUEUED);
    let idle = Arc::new(AtomicBool::new(false));
    let thread_idle = idle.clone();
    let handle = std::thread::Builder::new()
        .name("hookloop-writer".into())
        .spawn(move || run(&rx, &thread_idle))
        .map_err(|e| Error::io("<hookloop writer thread>", e))?;
    let queue = Arc::new(Queue {
        tx,
        thread: handle.thread().clone(),
        idle,
    });
    *guard = Some(ThreadHandle {
        pid,
        queue: queue.clone(),
    });
    THREAD_PID.store(pid, Ordering::Release);
    Ok(queue)
}

struct Open {
    sink: Box<dyn Sink>,
    status: Arc<Status>,
    path: PathBuf,
}

/// The thread's loop: drain, write, sync; poll while active, sleep once idle.
fn run(rx: &Receiver<Msg>, idle: &AtomicBool) {
    let mut sinks: FxHashMap<u64, Open> = FxHashMap::default();
    let mut dirty: FxHashSet<u64> = FxHashSet::default();
    let mut empty_polls = 0u32;
    loop {
        let mut got = 0usize;
        while got < MAX_DRAIN {
            match rx.try_recv() {
                Ok(msg) => {
                    got += 1;
                    handle_guarded(msg, &mut sinks, &mut dirty);
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    sync_dirty(&mut sinks, &mut dirty);
                    return;
                }
            }
        }
        sync_dirty(&mut sinks, &mut dirty);
        if got == MAX_DRAIN {
            continue; // more is queued: write it without waiting for the next poll
        }
        let got = got > 0;
        empty_polls = if got {
            0
        } else {
            empty_polls.saturating_add(1)
        };
        if sinks.is_empty() || empty_polls >= IDLE_POLLS {
            idle.store(true, Ordering::Release);
            // A message sent between the drain and the store found `idle` false and did not
            // wake us: look once more before sleeping.
            match rx.try_recv() {
                Ok(msg) => {
                    idle.store(false, Ordering::Release);
                    handle_guarded(msg, &mut sinks, &mut dirty);
                    empty_polls = 0;
                    continue;
                }
                Err(mpsc::TryRecvError::Empty) => std::thread::park(),
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
            idle.store(false, Ordering::Release);
            empty_polls = 0;
        } else {
            std::thread::park_timeout(POLL);
        }
    }
}

/// `handle`, with a panic in a sink turned into that writer's error: it must neither kill this
/// thread (every later flush would wait forever) nor pass silently.
fn handle_guarded(msg: Msg, sinks: &mut FxHashMap<u64, Open>, dirty: &mut FxHashSet<u64>) {
    let id = match &msg {
        Msg::Open(id, ..) | Msg::Write(id, _) | Msg::Close(id, _) | Msg::Purge(id, ..) => Some(*id),
        Msg::Barrier(_) => None,
    };
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(msg, sinks, dirty)));
    if let Err(panic) = result {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        let failed = id.and_then(|id| sinks.remove(&id));
        if let Some(open) = failed {
            open.status.set(Error::WriterPanicked {
                path: open.path.clone(),
                message,
            });
        }
    }
}

fn sync_dirty(sinks: &mut FxHashMap<u64, Open>, dirty: &mut FxHashSet<u64>) {
    for id in dirty.drain() {
        if let Some(open) = sinks.get_mut(&id) {
            if let Err(e) = busy_on(&open.path, || open.sink.sync()) {
                open.status.set(e);
            }
        }
    }
}

fn handle(msg: Msg, sinks: &mut FxHashMap<u64, Open>, dirty: &mut FxHashSet<u64>) {
    match msg {
        Msg::Open(id, sink, status, path) => {
            sinks.insert(id, Open { sink, status, path });
        }
        Msg::Write(id, payload) => {
            if let Some(open) = sinks.get_mut(&id) {
                match open.sink.write(payload) {
                    Ok(()) => {
                        dirty.insert(id);
                    }
                    Err(e) => open.status.set(e),
                }
            }
        }
        Msg::Purge(id, wall_time, from, reply) => {
            let result = match sinks.get_mut(&id) {
                Some(open) => open
                    .sink
                    .sync()
                    .and_then(|()| open.sink.purge(wall_time, from)),
                None => Ok(0),
            };
            dirty.remove(&id);
            let _ = reply.send(result);
        }
        Msg::Close(id, ack) => {
            dirty.remove(&id);
            if let Some(mut open) = sinks.remove(&id) {
                if let Err(e) = busy_on(&open.path, || open.sink.close()) {
                    open.status.set(e);
                }
            }
            let _ = ack.send(());
        }
        Msg::Barrier(ack) => {
            sync_dirty(sinks, dirty);
            for open in sinks.values_mut() {
                if let Err(e) = open.sink.verify() {
                    open.status.set(e);
                }
            }
            let _ = ack.send(());
        }
    }
}

/// Waits until everything queued so far by any writer of this process is written (and
/// synced per each writer's policy). Interpreter exit calls this.
pub fn flush_all() -> Result<()> {
    if THREAD_PID.load(Ordering::Acquire) != std::process::id() {
        return Ok(()); // no writer thread in this process (none yet, or a forked child)
    }
    let guard = THREAD.lock().unwrap_or_else(|e| e.into_inner());
    let Some(h) = guard.as_ref().filter(|h| h.pid == std::process::id()) else {
        return Ok(());
    };
    let queue = h.queue.clone();
    drop(guard);
    queue.round_trip(Path::new("<hookloop writers>"), Msg::Barrier)
}

/// The error slots of the sinks opened in this process, for [`take_errors`].
static OPEN_STATUSES: Mutex<Vec<std::sync::Weak<Status>>> = Mutex::new(Vec::new());

fn register(status: &Arc<Status>) {
    let mut open = OPEN_STATUSES.lock().unwrap_or_else(|e| e.into_inner());
    open.retain(|w| w.strong_count() > 0);
    open.push(Arc::downgrade(status));
}

/// Removes and returns the errors the writer thread met that no `write()`, `flush()` or
/// `close()` reported yet, for every writer of this process that still exists. Interpreter
/// exit calls this after `flush_all`, to report an error after the last write.
/// Tests that open sinks on the process's one writer thread take this first: `take_errors`
/// takes every open sink's unreported error, so a test of it run beside a test that expects
/// its own writer's error would steal that error.
#[cfg(test)]
pub(crate) fn test_serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn take_errors() -> Vec<Error> {
    if THREAD_PID.load(Ordering::Acquire) != std::process::id() {
        return Vec::new(); // a forked child: the errors are the parent's to report
    }
    let open = OPEN_STATUSES.lock().unwrap_or_else(|e| e.into_inner());
    open.iter()
        .filter_map(std::sync::Weak::upgrade)
        .filter_map(|status| status.take())
        .collect()
}

/// The training thread's side of one open sink.
pub struct SinkHandle {
    id: u64,
    /// The process that opened it: a forked child inherits the handle but not the thread, so
    /// it must not queue anything (nobody would write it, and a flush would wait forever).
    pid: u32,
    queue: Arc<Queue>,
    status: Arc<Status>,
    kind: &'static str,
    path: PathBuf,
    closed: bool,
}

impl SinkHandle {
    /// Hands `sink` to the writer thread. `kind` and `path` name it in errors.
    pub fn open(sink: Box<dyn Sink>, kind: &'static str, path: PathBuf) -> Result<SinkHandle> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let queue = queue()?;
        let status = Arc::new(Status::default());
        register(&status);
        queue.push(Msg::Open(id, sink, status.clone(), path.clone()), true);
        Ok(SinkHandle {
            id,
            pid: std::process::id(),
            queue,
            status,
            kind,
            path,
            closed: false,
        })
    }

    /// The file this sink writes.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Raises the error the thread met since the last call, if any.
    pub fn check(&self) -> Result<()> {
        let pid = std::process::id();
        if self.pid != pid {
            return Err(Error::ForkedChild {
                writer: self.kind,
                path: self.path.clone(),
                owner: self.pid,
                pid,
            });
        }
        if self.closed {
            return Err(Error::Closed {
                writer: self.kind,
                path: self.path.clone(),
            });
        }
        match self.status.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Queues a payload (after reporting any earlier error).
    pub fn send(&self, payload: Payload) -> Result<()> {
        self.check()?;
        self.queue.push(Msg::Write(self.id, payload), false);
        Ok(())
    }

    /// A resumed run restarts at iteration `from`: the sink drops (or marks as stale) what
    /// was written for iterations >= `from`, after writing what is queued. Waits for it and
    /// returns how many entries were removed.
    pub fn purge(&self, wall_time: f64, from: f64) -> Result<u64> {
        self.check()?;
        let (tx, rx) = mpsc::sync_channel(1);
        self.queue
            .push(Msg::Purge(self.id, wall_time, from, tx), true);
        rx.recv().unwrap_or(Ok(0))
    }

    /// Waits until everything this process queued is written.
    pub fn flush(&self) -> Result<()> {
        self.check()?;
        self.queue.round_trip(&self.path, Msg::Barrier)?;
        self.check()
    }

    /// Writes what is queued, syncs per policy, closes the file and reports any error.
    /// Closing twice is a no-op.
    pub fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        if self.pid != std::process::id() {
            return Ok(()); // the parent owns the file; see `pid`
        }
        let id = self.id;
        self.queue
            .round_trip(&self.path, |ack| Msg::Close(id, ack))?;
        match self.status.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl SinkHandle {
    /// Whether `close()` was called (or the handle belongs to another process).
    pub fn is_closed(&self) -> bool {
        self.closed || self.pid != std::process::id()
    }
}

impl Drop for SinkHandle {
    fn drop(&mut self) {
        // A writer dropped without close(): still write what was queued and close the file.
        // The binding closes first and reports the error; here nobody is left to tell.
        let _ = self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that records what reached it, and panics on request.
    struct Recording {
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Sink for Recording {
        fn write(&mut self, payload: Payload) -> Result<()> {
            let Payload::Json(rows) = payload else {
                panic!("boom");
            };
            let mut log = self.log.lock().unwrap();
            log.extend(rows.iter().map(|r| format!("write {}", r.iter)));
            Ok(())
        }
        fn sync(&mut self) -> Result<()> {
            self.log.lock().unwrap().push("sync".into());
            Ok(())
        }
        fn close(&mut self) -> Result<()> {
            self.log.lock().unwrap().push("close".into());
            Ok(())
        }
        fn purge(&mut self, _wall_time: f64, from: f64) -> Result<u64> {
            self.log.lock().unwrap().push(format!("purge {from}"));
            Ok(0)
        }
    }

    fn row(i: i64) -> JsonRow {
        JsonRow {
            iter: crate::history::Iter::Int(i),
            scalars: vec![],
        }
    }

    #[test]
    fn a_burst_of_writes_is_synced_once_and_flush_waits_for_it() {
        let _serial = crate::writer::test_serial();
        let log = Arc::new(Mutex::new(vec![]));
        let sink = Recording { log: log.clone() };
        let mut h = SinkHandle::open(Box::new(sink), "test", "/x".into()).unwrap();
        // Queued without waking the thread; flush is a barrier behind them.
        for i in 0..3 {
            h.send(Payload::Json(vec![row(i)])).unwrap();
        }
        h.flush().unwrap();
        h.close().unwrap();
        let log = log.lock().unwrap().clone();
        let writes: Vec<&String> = log.iter().filter(|s| s.starts_with("write")).collect();
        assert_eq!(writes, ["write 0", "write 1", "write 2"]);
        assert_eq!(log.last().map(String::as_str), Some("close"));
        assert!(matches!(
            h.send(Payload::Json(vec![])),
            Err(Error::Closed { .. })
        ));
    }

    /// A sink whose close fails, like a disk that fills after the last write.
    struct FailsAtClose;

    impl Sink for FailsAtClose {
        fn write(&mut self, _payload: Payload) -> Result<()> {
            Ok(())
        }
        fn sync(&mut self) -> Result<()> {
            Err(Error::io("/late", std::io::Error::from_raw_os_error(28)))
        }
        fn close(&mut self) -> Result<()> {
            Ok(())
        }
        fn purge(&mut self, _wall_time: f64, _from: f64) -> Result<u64> {
            Ok(0)
        }
    }

    #[test]
    fn an_error_after_the_last_write_is_left_for_take_errors() {
        let _serial = crate::writer::test_serial();
        let mut h = SinkHandle::open(Box::new(FailsAtClose), "test", "/late".into()).unwrap();
        h.send(Payload::Json(vec![row(1)])).unwrap(); // accepted; the sync fails later
        flush_all().unwrap();
        let errors: Vec<String> = take_errors().iter().map(|e| e.to_string()).collect();
        assert!(errors.iter().any(|e| e.contains("/late")), "{errors:?}");
        assert!(take_errors()
            .iter()
            .all(|e| !e.to_string().contains("/late")));
        h.close().unwrap();
    }

    #[test]
    fn a_panicking_sink_becomes_its_writers_error() {
        let _serial = crate::writer::test_serial();
        let log = Arc::new(Mutex::new(vec![]));
        let mut h = SinkHandle::open(Box::new(Recording { log }), "test", "/p".into()).unwrap();
        h.send(Payload::Events {
            wall_time: 0.0,
            scalars: vec![],
            images: vec![],
            histograms: vec![],
        })
        .unwrap();
        // Reported at the flush, or (when another test's sink shared the thread's batch) at
        // the latest at close: never lost.
        let err = h.flush().err().or_else(|| h.close().err()).unwrap();
        assert!(matches!(&err, Error::WriterPanicked { .. }), "{err}");
        // The thread survived: another writer still works.
        let log = Arc::new(Mutex::new(vec![]));
        let mut other = SinkHandle::open(Box::new(Recording { log }), "test", "/q".into()).unwrap();
        other.send(Payload::Json(vec![row(1)])).unwrap();
        other.close().unwrap();
        let _ = h.close();
    }
}
