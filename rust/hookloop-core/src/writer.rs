//! The writer threads: each open metrics file has a background thread of its own.
//!
//! A writer's `write()` on the training thread takes a snapshot of what is new and sends it
//! to its file's thread; formatting (JSON, protobuf, PNG) and I/O happen there. A thread
//! drains everything queued before touching the disk, so a burst of writes costs one batch of
//! write calls and at most one fsync. An I/O error is kept in the writer's `Status` and handed
//! back to the training thread at its next `write()`, `flush()` or `close()`.
//!
//! One thread per file, not one for all: a file that blocks (a hung network mount, a FIFO
//! nobody reads) holds only its own thread, so the other writers keep writing and flushing,
//! and a flush, close or exit waits for the blocked one at most [`writer_timeout`]. Order is
//! kept per file (one queue, one thread), which is all a file needs.
//!
//! Durability: each batch reaches its file in write calls that end on a line or record
//! boundary and stay within one 4 KiB page of the file (`crate::append`), so after SIGKILL a
//! file holds only whole lines and records, but for a tear inside the one line or record that
//! crosses a page boundary; the JSON sink cuts a torn last line when the file is opened again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::record::{HistogramPoint, ImagePoint, JsonRow, ScalarPoint, TensorPoint};
use crate::{Error, Result};

/// When a writer's file is fsynced. Every policy writes each batch to the file (the OS's page
/// cache) at once, so what was written survives a kill of the process; an fsync makes it
/// survive a crash of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// After each batch of writes reaches the file (detectron2's JSONWriter fsyncs each write).
    Always,
    /// At most once per [`FSYNC_INTERVAL`] while writes keep coming, and whenever the writer
    /// pauses (its thread goes idle), is flushed or closed. On a VM each fsync's I/O
    /// completion costs the CPU that takes its interrupt, often the training thread's:
    /// measured 7-16 µs per step at one fsync per write of the tiny MLP's default stack.
    Periodic,
    /// Only when the writer is closed.
    Close,
    /// Never.
    Never,
}

/// The longest a `Periodic` writer leaves written lines without an fsync while it writes.
pub const FSYNC_INTERVAL: Duration = Duration::from_secs(1);

impl FsyncPolicy {
    /// `JSONWriter`'s default.
    pub const JSON_DEFAULT: FsyncPolicy = FsyncPolicy::Periodic;
    /// `TensorboardXWriter`'s default.
    pub const EVENTS_DEFAULT: FsyncPolicy = FsyncPolicy::Close;

    /// The policy's name, as `parse` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            FsyncPolicy::Always => "always",
            FsyncPolicy::Periodic => "periodic",
            FsyncPolicy::Close => "close",
            FsyncPolicy::Never => "never",
        }
    }

    /// Parses "always", "periodic", "close" or "never".
    pub fn parse(s: &str) -> Option<FsyncPolicy> {
        match s {
            "always" => Some(FsyncPolicy::Always),
            "periodic" => Some(FsyncPolicy::Periodic),
            "close" => Some(FsyncPolicy::Close),
            "never" => Some(FsyncPolicy::Never),
            _ => None,
        }
    }
}

/// When a sink fsyncs what it wrote, by its policy: the one rule both sinks follow.
#[derive(Debug)]
pub struct Durability {
    policy: FsyncPolicy,
    /// The last fsync (None: none yet).
    last: Option<Instant>,
    /// Written since the last fsync and waiting for one (`Periodic` only).
    waiting: bool,
}

impl Durability {
    pub fn new(policy: FsyncPolicy) -> Self {
        Durability {
            policy,
            last: None,
            waiting: false,
        }
    }

    /// A batch reached the file at `now`: whether to fsync it now. A `Periodic` batch inside
    /// the interval waits for [`Durability::due`].
    pub fn after_batch(&mut self, now: Instant) -> bool {
        match self.policy {
            FsyncPolicy::Always => true,
            FsyncPolicy::Periodic => {
                let due = self.interval_over(now);
                self.waiting = !due;
                due
            }
            FsyncPolicy::Close | FsyncPolicy::Never => false,
        }
    }

    /// Whether a waiting fsync is due at `now`: its interval is over, or the writer pauses
    /// (`pause`: the thread goes idle, or a flush).
    pub fn due(&self, now: Instant, pause: bool) -> bool {
        self.waiting && (pause || self.interval_over(now))
    }

    /// No fsync yet, or the last one is an interval old at `now`.
    fn interval_over(&self, now: Instant) -> bool {
        match self.last {
            None => true,
            Some(t) => now.duration_since(t) >= FSYNC_INTERVAL,
        }
    }

    /// An fsync was made at `now`.
    pub fn synced(&mut self, now: Instant) {
        self.last = Some(now);
        self.waiting = false;
    }

    /// Whether closing fsyncs: every policy but `Never`.
    pub fn at_close(&self) -> bool {
        self.policy != FsyncPolicy::Never
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
        tensors: Vec<TensorPoint>,
    },
}

/// A file owned by the writer thread.
pub trait Sink: Send {
    /// Formats a payload into the sink's buffer (no I/O; the thread calls `sync` once per
    /// batch, so a burst of writes is one batch of write calls and at most one fsync).
    fn write(&mut self, payload: Payload) -> Result<()>;
    /// Appends the buffer to the file in page-bounded write calls (`crate::append`: on error
    /// the whole units that reached the file stay, a torn one is cut), then fsyncs if the
    /// policy says so after each batch.
    fn sync(&mut self) -> Result<()>;
    /// Called on each poll of the thread after the batch, if any, was synced, and at a
    /// flush: a sink whose policy left written data waiting for an fsync makes it now when it
    /// is due (`pause`: the thread is about to sleep until woken, or a flush asks).
    fn tick(&mut self, _pause: bool) -> Result<()> {
        Ok(())
    }
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

/// A writer's error slot, shared with its thread.
#[derive(Default)]
struct Status {
    error: Mutex<Option<Error>>,
    /// Set by the thread when it ends (its writer closed or dropped), before it drops the
    /// queue's receiver: a request dropped unanswered after that was not a panic.
    ended: AtomicBool,
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
    Write(Payload),
    Purge(f64, f64, SyncSender<Result<u64>>),
    Close(Ack),
    Barrier(Ack),
}

/// A one-shot "done" signal from a writer thread.
type Ack = SyncSender<()>;

/// How often a writer thread looks for new writes while its writer is active.
///
/// Writes do not wake the thread: waking a sleeping thread costs the sender a futex call and,
/// on a VM, an inter-processor interrupt, ~15 µs measured here, more than the write itself.
/// The thread polls instead, so a metric reaches the file within milliseconds. Close, flush
/// and a full queue wake it at once.
const POLL: Duration = Duration::from_millis(5);

/// Empty polls after which the thread sleeps until woken: idle writers cost no wake-ups (the
/// next write after such a pause pays one wake).
const IDLE_POLLS: u32 = 40;

/// Messages queued before a sender waits for the thread: a writer that cannot keep up slows
/// training down instead of growing memory without limit (and past the writer timeout,
/// `write()` fails instead of waiting for a file that blocks).
const MAX_QUEUED: usize = 16_384;

/// Messages handled before the thread writes what they formatted: a writer that queues faster
/// than the thread drains still sees its lines reach the file in bounded batches.
const MAX_DRAIN: usize = 256;

/// The senders' side of one file's writer thread.
struct Queue {
    tx: SyncSender<Msg>,
    thread: Thread,
    /// Set by the thread before it sleeps without a timeout; a sender then wakes it.
    idle: Arc<AtomicBool>,
    status: Arc<Status>,
    path: PathBuf,
    /// The process that started the thread (a forked child inherits the queue, not the thread).
    pid: u32,
    /// A request that timed out, while the thread may still be stuck on it: the check says
    /// whether it has been answered since. Until it has, later requests fail at once instead
    /// of each waiting the timeout again (interpreter exit meets every writer once or twice).
    stalled: Mutex<Option<Box<dyn FnMut() -> bool + Send>>>,
}

impl Queue {
    /// Queues `msg`; `urgent` wakes the thread at once. A full queue wakes it and waits, at
    /// most the writer timeout. `Ok(false)`: the thread is gone (its writer was closed).
    fn push(&self, msg: Msg, urgent: bool) -> Result<bool> {
        match self.tx.try_send(msg) {
            Ok(()) => {}
            Err(TrySendError::Full(msg)) => {
                self.thread.unpark();
                return self.push_full(msg);
            }
            Err(TrySendError::Disconnected(_)) => return Ok(false),
        }
        if urgent || self.idle.swap(false, Ordering::AcqRel) {
            self.thread.unpark();
        }
        Ok(true)
    }

    /// The slow path of `push`: waits for room in the queue, at most the writer timeout (the
    /// queue is full when the file is much slower than training, or blocks).
    fn push_full(&self, mut msg: Msg) -> Result<bool> {
        let timeout = writer_timeout();
        let deadline = Instant::now() + timeout;
        loop {
            if self.still_stalled() || Instant::now() >= deadline {
                return Err(self.blocked(timeout));
            }
            std::thread::sleep(Duration::from_millis(1));
            match self.tx.try_send(msg) {
                Ok(()) => return Ok(true),
                Err(TrySendError::Full(m)) => msg = m,
                Err(TrySendError::Disconnected(_)) => return Ok(false),
            }
        }
    }

    fn blocked(&self, timeout: Duration) -> Error {
        Error::Blocked {
            path: self.path.clone(),
            seconds: timeout.as_secs_f64(),
        }
    }

    /// Whether a request that timed out is still unanswered (the file still blocks).
    fn still_stalled(&self) -> bool {
        let mut stalled = self.stalled.lock().unwrap_or_else(|e| e.into_inner());
        let still = stalled.as_mut().is_some_and(|answered| !answered());
        if !still {
            *stalled = None;
        }
        still
    }

    /// Queues the request `make(reply)`, waking the thread. `Ok(None)`: the thread is gone.
    /// While an earlier request is still stuck, the request is queued (the thread handles it
    /// once the file unblocks) and the error returned at once.
    fn ask<T>(&self, make: impl FnOnce(SyncSender<T>) -> Msg) -> Result<Option<Receiver<T>>> {
        let (tx, rx) = mpsc::sync_channel(1);
        let stalled = self.still_stalled();
        if !self.push(make(tx), true)? {
            return Ok(None);
        }
        if stalled {
            return Err(self.blocked(writer_timeout()));
        }
        Ok(Some(rx))
    }

    /// Waits for the reply to a request until `deadline`: past it, the error names this file.
    /// `Ok(None)`: the thread ended (its writer closed) before it reached the request.
    fn answer<T: Send + 'static>(&self, rx: Receiver<T>, deadline: Instant) -> Result<Option<T>> {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(v) => Ok(Some(v)),
            Err(mpsc::RecvTimeoutError::Disconnected)
                if self.status.ended.load(Ordering::Acquire) =>
            {
                Ok(None)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let answered = move || !matches!(rx.try_recv(), Err(TryRecvError::Empty));
                *self.stalled.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(answered));
                Err(self.blocked(writer_timeout()))
            }
            // The request was dropped unanswered: the sink panicked while it was handled.
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Error::WriterPanicked {
                path: self.path.clone(),
                message: "the writer thread failed while handling this request".into(),
            }),
        }
    }

    /// `ask`, then `answer` within the writer timeout. `Ok(None)`: the thread is gone.
    fn round_trip<T: Send + 'static>(
        &self,
        make: impl FnOnce(SyncSender<T>) -> Msg,
    ) -> Result<Option<T>> {
        match self.ask(make)? {
            Some(rx) => self.answer(rx, Instant::now() + writer_timeout()),
            None => Ok(None),
        }
    }
}

/// How long `flush()`, `close()` and interpreter exit wait for a blocked file, in
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

/// The queues of this process's writers, for [`flush_all`] and [`take_errors`].
static QUEUES: Mutex<Vec<Weak<Queue>>> = Mutex::new(Vec::new());

/// The process whose writers `QUEUES` holds (0: none yet), readable without the lock: a
/// forked child may inherit `QUEUES` locked, and must not wait on it at exit.
static QUEUES_PID: AtomicU32 = AtomicU32::new(0);

/// Starts the writer thread of `sink` and registers its queue.
fn start(sink: Box<dyn Sink>, path: PathBuf) -> Result<Arc<Queue>> {
    let (tx, rx) = mpsc::sync_channel(MAX_QUEUED);
    let idle = Arc::new(AtomicBool::new(false));
    let status = Arc::new(Status::default());
    let thread = {
        let (idle, status, own) = (idle.clone(), status.clone(), path.clone());
        std::thread::Builder::new()
            .name("hookloop-writer".into())
            .spawn(move || run(Some(sink), &rx, &idle, &status, &own))
            .map_err(|e| Error::io(&path, e))?
            .thread()
            .clone()
    };
    let pid = std::process::id();
    let queue = Arc::new(Queue {
        tx,
        thread,
        idle,
        status,
        path,
        pid,
        stalled: Mutex::new(None),
    });
    let mut queues = QUEUES.lock().unwrap_or_else(|e| e.into_inner());
    if QUEUES_PID.load(Ordering::Acquire) != pid {
        queues.clear(); // a forked child: the parent's writers are not ours
    }
    queues.retain(|w| w.strong_count() > 0);
    queues.push(Arc::downgrade(&queue));
    QUEUES_PID.store(pid, Ordering::Release);
    Ok(queue)
}

/// This process's live writer queues (none in a forked child that opened no writer).
fn live_queues() -> Vec<Arc<Queue>> {
    let pid = std::process::id();
    if QUEUES_PID.load(Ordering::Acquire) != pid {
        return Vec::new();
    }
    let queues = QUEUES.lock().unwrap_or_else(|e| e.into_inner());
    queues
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|q| q.pid == pid)
        .collect()
}

/// One sink's thread: drain, write, sync; poll while active, sleep once idle. It ends when its
/// writer is closed or dropped.
fn run(
    sink: Option<Box<dyn Sink>>,
    rx: &Receiver<Msg>,
    idle: &AtomicBool,
    status: &Status,
    path: &Path,
) {
    run_until_closed(sink, rx, idle, status, path);
    status.ended.store(true, Ordering::Release);
}

fn run_until_closed(
    mut sink: Option<Box<dyn Sink>>,
    rx: &Receiver<Msg>,
    idle: &AtomicBool,
    status: &Status,
    path: &Path,
) {
    let mut empty_polls = 0u32;
    loop {
        let mut got = 0usize;
        let mut dirty = false;
        let mut done = false;
        while got < MAX_DRAIN && !done {
            match rx.try_recv() {
                Ok(msg) => {
                    got += 1;
                    done = handle(msg, &mut sink, &mut dirty, status, path);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => done = true,
            }
        }
        if dirty {
            guarded(&mut sink, status, path, |s| s.sync());
        }
        if done {
            // Closed, or the writer dropped: what it queued is written.
            return;
        }
        if got == MAX_DRAIN {
            continue; // more is queued: write it without waiting for the next poll
        }
        empty_polls = if got > 0 {
            0
        } else {
            empty_polls.saturating_add(1)
        };
        let going_idle = sink.is_none() || empty_polls >= IDLE_POLLS;
        guarded(&mut sink, status, path, |s| s.tick(going_idle));
        if going_idle {
            idle.store(true, Ordering::Release);
            // A message sent between the drain and the store found `idle` false and did not
            // wake us: look once more before sleeping.
            match rx.try_recv() {
                Ok(msg) => {
                    idle.store(false, Ordering::Release);
                    let mut dirty = false;
                    if handle(msg, &mut sink, &mut dirty, status, path) {
                        return;
                    }
                    if dirty {
                        guarded(&mut sink, status, path, |s| s.sync());
                    }
                    empty_polls = 0;
                    continue;
                }
                Err(TryRecvError::Empty) => std::thread::park(),
                Err(TryRecvError::Disconnected) => return,
            }
            idle.store(false, Ordering::Release);
            empty_polls = 0;
        } else {
            std::thread::park_timeout(POLL);
        }
    }
}

/// Runs `f` on the sink, with an error kept for the writer and a panic turned into its error:
/// a panic must neither kill the thread (every later flush would wait for it) nor pass
/// silently. After a panic the sink is dropped; the thread still answers requests.
fn guarded<T>(
    sink: &mut Option<Box<dyn Sink>>,
    status: &Status,
    path: &Path,
    f: impl FnOnce(&mut dyn Sink) -> Result<T>,
) -> Option<T> {
    let s = sink.as_mut()?;
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(s.as_mut()))) {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) => {
            status.set(e);
            None
        }
        Err(panic) => {
            panicked(sink, status, path, panic.as_ref());
            None
        }
    }
}

/// A sink panicked: it is dropped and the panic becomes its writer's error.
fn panicked(
    sink: &mut Option<Box<dyn Sink>>,
    status: &Status,
    path: &Path,
    panic: &(dyn std::any::Any + Send),
) {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into());
    *sink = None;
    status.set(Error::WriterPanicked {
        path: path.to_owned(),
        message,
    });
}

/// Handles one message; returns whether the thread is done (the writer was closed).
fn handle(
    msg: Msg,
    sink: &mut Option<Box<dyn Sink>>,
    dirty: &mut bool,
    status: &Status,
    path: &Path,
) -> bool {
    match msg {
        Msg::Write(payload) => {
            if guarded(sink, status, path, |s| s.write(payload)).is_some() {
                *dirty = true;
            }
            false
        }
        Msg::Purge(wall_time, from, reply) => {
            *dirty = false;
            let Some(s) = sink.as_mut() else {
                let _ = reply.send(Ok(0));
                return false;
            };
            // The purge's own error goes to its caller, not to the writer's slot.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                s.sync().and_then(|()| s.purge(wall_time, from))
            }));
            match result {
                Ok(result) => {
                    let _ = reply.send(result);
                }
                // The reply is dropped unanswered: the caller reports the panic.
                Err(panic) => panicked(sink, status, path, panic.as_ref()),
            }
            false
        }
        Msg::Close(ack) => {
            *dirty = false;
            guarded(sink, status, path, |s| s.close());
            *sink = None;
            let _ = ack.send(());
            true
        }
        Msg::Barrier(ack) => {
            if std::mem::take(dirty) {
                guarded(sink, status, path, |s| s.sync());
            }
            guarded(sink, status, path, |s| s.tick(true));
            guarded(sink, status, path, |s| s.verify());
            let _ = ack.send(());
            false
        }
    }
}

/// Waits until everything queued so far by any writer of this process is written (and
/// synced per each writer's policy), at most the writer timeout for all of them together; a
/// file that blocks fails it with an error naming that file, and the other writers are still
/// flushed. Interpreter exit calls this.
pub fn flush_all() -> Result<()> {
    let deadline = Instant::now() + writer_timeout();
    let asked: Vec<_> = live_queues()
        .into_iter()
        .map(|q| {
            let rx = q.ask(Msg::Barrier);
            (q, rx)
        })
        .collect();
    let mut first = Ok(());
    for (q, rx) in asked {
        let done = match rx {
            Ok(Some(rx)) => q.answer(rx, deadline).map(|_| ()),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        if let (Err(e), Ok(())) = (done, &first) {
            first = Err(e);
        }
    }
    first
}

/// Tests that open sinks take this first: `take_errors` takes every open sink's unreported
/// error, so a test of it run beside a test that expects its own writer's error would steal
/// that error.
#[cfg(test)]
pub(crate) fn test_serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes and returns the errors the writer threads met that no `write()`, `flush()` or
/// `close()` reported yet, for every writer of this process that still exists. Interpreter
/// exit calls this after `flush_all`, to report an error after the last write.
pub fn take_errors() -> Vec<Error> {
    live_queues()
        .iter()
        .filter_map(|q| q.status.take())
        .collect()
}

/// The training thread's side of one open sink.
pub struct SinkHandle {
    /// Its thread's queue. Its `pid` is the process that opened it: a forked child inherits
    /// the handle but not the thread, so it must not queue anything (nobody would write it,
    /// and a flush would wait for nothing).
    queue: Arc<Queue>,
    kind: &'static str,
    closed: bool,
}

impl SinkHandle {
    /// Starts a writer thread for `sink`. `kind` and `path` name it in errors.
    pub fn open(sink: Box<dyn Sink>, kind: &'static str, path: PathBuf) -> Result<SinkHandle> {
        Ok(SinkHandle {
            queue: start(sink, path)?,
            kind,
            closed: false,
        })
    }

    /// The file this sink writes.
    pub fn path(&self) -> &std::path::Path {
        &self.queue.path
    }

    /// Raises the error the thread met since the last call, if any.
    pub fn check(&self) -> Result<()> {
        let pid = std::process::id();
        if self.queue.pid != pid {
            return Err(Error::ForkedChild {
                writer: self.kind,
                path: self.queue.path.clone(),
                owner: self.queue.pid,
                pid,
            });
        }
        if self.closed {
            return Err(Error::Closed {
                writer: self.kind,
                path: self.queue.path.clone(),
            });
        }
        match self.queue.status.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Queues a payload (after reporting any earlier error).
    pub fn send(&self, payload: Payload) -> Result<()> {
        self.check()?;
        self.queue.push(Msg::Write(payload), false)?;
        Ok(())
    }

    /// A resumed run restarts at iteration `from`: the sink drops (or marks as stale) what
    /// was written for iterations >= `from`, after writing what is queued. Waits for it (at
    /// most the writer timeout) and returns how many entries were removed.
    pub fn purge(&self, wall_time: f64, from: f64) -> Result<u64> {
        self.check()?;
        let removed = self
            .queue
            .round_trip(|reply| Msg::Purge(wall_time, from, reply))?;
        removed.unwrap_or(Ok(0))
    }

    /// Waits until everything this writer queued is in its file, at most the writer timeout.
    pub fn flush(&self) -> Result<()> {
        self.check()?;
        self.queue.round_trip(Msg::Barrier)?;
        self.check()
    }

    /// Writes what is queued, syncs per policy, closes the file and reports any error.
    /// Closing twice is a no-op.
    pub fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        if self.queue.pid != std::process::id() {
            return Ok(()); // the parent owns the file; see `queue`
        }
        self.queue.round_trip(Msg::Close)?;
        match self.queue.status.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Whether `close()` was called (or the handle belongs to another process).
    pub fn is_closed(&self) -> bool {
        self.closed || self.queue.pid != std::process::id()
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
        fn tick(&mut self, pause: bool) -> Result<()> {
            if pause {
                self.log.lock().unwrap().push("pause".into());
            }
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

    #[test]
    fn periodic_fsyncs_the_first_batch_then_at_most_once_per_interval_and_at_pauses() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut d = Durability::new(FsyncPolicy::Periodic);
        assert!(!d.due(at(0), true)); // nothing written yet
        assert!(d.after_batch(at(0)));
        d.synced(at(0));
        // Batches inside the interval wait; the wait ends with the interval or a pause.
        assert!(!d.after_batch(at(20)));
        assert!(!d.due(at(40), false));
        assert!(!d.after_batch(at(999)));
        assert!(d.due(at(1000), false));
        assert!(d.due(at(60), true));
        d.synced(at(1000));
        assert!(!d.due(at(1001), true)); // nothing waits after the fsync
        assert!(d.after_batch(at(2000)));
    }

    #[test]
    fn the_other_policies_fsync_every_batch_or_never_before_close() {
        let now = Instant::now();
        let mut always = Durability::new(FsyncPolicy::Always);
        assert!(always.after_batch(now) && always.after_batch(now));
        for policy in [FsyncPolicy::Close, FsyncPolicy::Never] {
            let mut d = Durability::new(policy);
            assert!(!d.after_batch(now));
            assert!(!d.due(now, true));
        }
        let at_close = |p| Durability::new(p).at_close();
        assert!(at_close(FsyncPolicy::Always) && at_close(FsyncPolicy::Periodic));
        assert!(at_close(FsyncPolicy::Close) && !at_close(FsyncPolicy::Never));
        for p in ["always", "periodic", "close", "never"] {
            assert_eq!(FsyncPolicy::parse(p).map(FsyncPolicy::as_str), Some(p));
        }
        assert_eq!(FsyncPolicy::parse("sometimes"), None);
    }

    fn row(i: i64) -> JsonRow {
        JsonRow {
            iter: crate::iter::Iter::Int(i),
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
        // The flush made a deferred fsync due: the sink was told after the writes' sync.
        let at_flush = log.lock().unwrap().clone();
        let sync = at_flush.iter().position(|s| s == "sync").unwrap();
        assert!(
            at_flush[sync..].iter().any(|s| s == "pause"),
            "{at_flush:?}"
        );
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
            tensors: vec![],
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

    /// A sink whose sync blocks until released, like a file on a hung mount.
    struct Hangs {
        released: Arc<(Mutex<bool>, std::sync::Condvar)>,
    }

    impl Sink for Hangs {
        fn write(&mut self, _payload: Payload) -> Result<()> {
            Ok(())
        }
        fn sync(&mut self) -> Result<()> {
            let (lock, cvar) = &*self.released;
            let mut released = lock.lock().unwrap();
            while !*released {
                released = cvar.wait(released).unwrap();
            }
            Ok(())
        }
        fn close(&mut self) -> Result<()> {
            Ok(())
        }
        fn purge(&mut self, _wall_time: f64, _from: f64) -> Result<u64> {
            Ok(0)
        }
    }

    #[test]
    fn a_blocked_sink_fails_its_own_flush_and_stalls_no_other() {
        let _serial = crate::writer::test_serial();
        let released = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let hangs = Hangs {
            released: released.clone(),
        };
        let mut hung = SinkHandle::open(Box::new(hangs), "test", "/hung".into()).unwrap();
        let log = Arc::new(Mutex::new(vec![]));
        let fine = Recording { log: log.clone() };
        let mut fine = SinkHandle::open(Box::new(fine), "test", "/fine".into()).unwrap();
        set_writer_timeout(Some(0.2)).unwrap();
        hung.send(Payload::Json(vec![row(0)])).unwrap();
        let blocked = |r: Result<()>| matches!(r, Err(Error::Blocked { path, .. }) if path == Path::new("/hung"));
        assert!(blocked(hung.flush()));
        set_writer_timeout(None).unwrap();
        // Still blocked: every later wait on it fails at once, naming it.
        assert!(blocked(flush_all()));
        assert!(blocked(hung.flush()));
        // The other sink has a thread of its own.
        fine.send(Payload::Json(vec![row(1)])).unwrap();
        fine.flush().unwrap();
        let seen: Vec<String> = log
            .lock()
            .unwrap()
            .iter()
            .filter(|s| *s != "pause")
            .cloned()
            .collect();
        assert_eq!(seen[..2], ["write 1", "sync"]);
        // Unblocked, the stuck requests are answered and the sink works again.
        *released.0.lock().unwrap() = true;
        released.1.notify_all();
        let deadline = Instant::now() + Duration::from_secs(60);
        while blocked(hung.flush()) {
            assert!(Instant::now() < deadline, "the sink never recovered");
            std::thread::sleep(Duration::from_millis(10));
        }
        hung.close().unwrap();
        fine.close().unwrap();
        flush_all().unwrap();
    }
}
