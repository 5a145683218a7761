//! The writer thread: one background thread per process owns every open metrics file.
//!
//! A writer's `write()` on the training thread takes a snapshot of what is new and sends it
//! here; formatting (JSON, protobuf, PNG) and I/O happen on this thread. The thread drains
//! everything queued before touching the disk, so a burst of writes costs one fsync per file.
//! An I/O error is kept in the writer's `Status` and handed back to the training thread at
//! its next `write()` or at `close()`.

use std::collections::{HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustc_hash::FxHashMap;

use crate::history::Iter;
use crate::pyfmt::json_metrics_line;
use crate::tfevents::{encode_events, EventFile, HistogramPoint, ImagePoint, ScalarPoint};
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

/// One iteration's scalars for metrics.json.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonRow {
    pub iter: Iter,
    pub scalars: Vec<(Arc<str>, f64)>,
}

/// What a writer hands to the thread.
#[derive(Debug)]
pub enum Payload {
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
}

/// metrics.json: one JSON object per line, appended; a line is whole or absent.
pub struct JsonSink {
    path: PathBuf,
    file: File,
    /// Whole lines formatted but not yet written.
    pending: String,
    /// Length of the file after the last whole write: where a failed write is cut back to.
    len: u64,
    fsync: FsyncPolicy,
}

impl JsonSink {
    /// Opens `path` for appending (creating it), on the calling thread so that an unwritable
    /// location fails at construction as in detectron2. A torn last line left by a killed run
    /// is cut off, so the file parses line by line.
    pub fn open(path: &Path, fsync: FsyncPolicy) -> Result<JsonSink> {
        let io = |e| Error::io(path, e);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let len = whole_lines_len(&mut file, len).map_err(io)?;
        if len != file.metadata().map_err(io)?.len() {
            file.set_len(len).map_err(io)?;
        }
        Ok(JsonSink {
            path: path.to_owned(),
            file,
            pending: String::new(),
            len,
            fsync,
        })
    }
}

/// The length of the longest prefix of `file` that ends with a newline (or is empty).
fn whole_lines_len(file: &mut File, len: u64) -> std::io::Result<u64> {
    let mut end = len;
    let mut buf = [0u8; 4096];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        if let Some(pos) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + pos as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

impl JsonSink {
    fn write_pending(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let text = std::mem::take(&mut self.pending);
        // One write call: a killed process leaves whole lines; a failed one is cut back.
        if let Err(e) = self.file.write_all(text.as_bytes()) {
            let _ = self.file.set_len(self.len);
            return Err(Error::io(&self.path, e));
        }
        self.len += text.len() as u64;
        Ok(())
    }
}

impl Sink for JsonSink {
    fn write(&mut self, payload: Payload) -> Result<()> {
        let Payload::Json(rows) = payload else {
            return Ok(());
        };
        for row in &rows {
            let scalars: Vec<(&str, f64)> = row.scalars.iter().map(|(k, v)| (&**k, *v)).collect();
            self.pending
                .push_str(&json_metrics_line(row.iter, &scalars));
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<()> {
        self.write_pending()?;
        if self.fsync == FsyncPolicy::Always {
            self.file
                .sync_data()
                .map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        self.write_pending()?;
        if self.fsync != FsyncPolicy::Never {
            self.file
                .sync_data()
                .map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(())
    }
}

/// A TensorBoard event file, created at its first non-empty write.
pub struct EventSink {
    file: EventFile,
    fsync: FsyncPolicy,
    buf: Vec<u8>,
}

impl EventSink {
    /// An event file named like torch's SummaryWriter's in `log_dir`; no I/O yet.
    pub fn new(
        log_dir: PathBuf,
        hostname: &str,
        filename_suffix: &str,
        fsync: FsyncPolicy,
    ) -> EventSink {
        static UID: AtomicU64 = AtomicU64::new(0);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let uid = UID.fetch_add(1, Ordering::Relaxed);
        let name = crate::tfevents::event_file_name(now, hostname, std::process::id(), uid)
            + filename_suffix;
        EventSink {
            file: EventFile::new(log_dir, name),
            fsync,
            buf: Vec::new(),
        }
    }

    /// The file's path (it may not exist yet).
    pub fn path(&self) -> PathBuf {
        self.file.path()
    }
}

impl EventSink {
    fn write_pending(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        // EventFile::append writes once and cuts a failed write back to whole records.
        let result = self
            .file
            .append(&self.buf)
            .map_err(|e| Error::io(self.file.path(), e));
        self.buf.clear();
        result
    }
}

impl Sink for EventSink {
    fn write(&mut self, payload: Payload) -> Result<()> {
        let Payload::Events {
            wall_time,
            scalars,
            images,
            histograms,
        } = payload
        else {
            return Ok(());
        };
        // On a bad image encode_events leaves the buffer as it was.
        encode_events(&mut self.buf, wall_time, &scalars, &images, &histograms).map_err(|e| {
            Error::BadImage {
                tag: String::new(),
                reason: e.to_string(),
            }
        })
    }

    fn sync(&mut self) -> Result<()> {
        self.write_pending()?;
        self.file
            .flush(self.fsync == FsyncPolicy::Always)
            .map_err(|e| Error::io(self.file.path(), e))
    }

    fn close(&mut self) -> Result<()> {
        self.write_pending()?;
        self.file
            .flush(self.fsync != FsyncPolicy::Never)
            .map_err(|e| Error::io(self.file.path(), e))
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
    Open(u64, Box<dyn Sink>, Arc<Status>),
    Write(u64, Payload),
    Close(u64, Ack),
    Barrier(Ack),
}

/// A one-shot "done" signal from the writer thread.
type Ack = mpsc::SyncSender<()>;

/// The queue between training threads and the writer thread.
///
/// Writes do not wake the thread: waking a sleeping thread costs the sender a futex call and,
/// on a VM, an inter-processor interrupt, ~15 µs measured here, more than the write itself.
/// The thread instead polls every `POLL` while writers are open, so a metric reaches the file
/// within milliseconds. Open, close and flush wake it at once.
struct Queue {
    msgs: Mutex<VecDeque<Msg>>,
    /// Signalled for messages that must not wait for the next poll.
    wake: Condvar,
    /// Signalled when the thread drained the queue (for senders waiting on a full queue).
    drained: Condvar,
}

/// How often the writer thread looks for new writes while any writer is open.
const POLL: Duration = Duration::from_millis(5);

/// Messages queued before a sender waits for the thread: a writer that cannot keep up slows
/// training down instead of growing memory without limit.
const MAX_QUEUED: usize = 16_384;

impl Queue {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Msg>> {
        self.msgs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, msg: Msg, wake: bool) {
        let mut q = self.lock();
        while q.len() >= MAX_QUEUED {
            self.wake.notify_one();
            q = self.drained.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        q.push_back(msg);
        drop(q);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Queues `make(ack)` and waits until the thread handled it.
    fn round_trip(&self, make: impl FnOnce(Ack) -> Msg) {
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        self.push(make(ack_tx), true);
        let _ = ack_rx.recv();
    }
}

struct ThreadHandle {
    pid: u32,
    queue: Arc<Queue>,
}

static THREAD: Mutex<Option<ThreadHandle>> = Mutex::new(None);

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
    let queue = Arc::new(Queue {
        msgs: Mutex::new(VecDeque::new()),
        wake: Condvar::new(),
        drained: Condvar::new(),
    });
    let q = queue.clone();
    std::thread::Builder::new()
        .name("hookloop-writer".into())
        .spawn(move || run(&q))
        .map_err(|e| Error::io("<hookloop writer thread>", e))?;
    *guard = Some(ThreadHandle {
        pid,
        queue: queue.clone(),
    });
    Ok(queue)
}

struct Open {
    sink: Box<dyn Sink>,
    status: Arc<Status>,
}

fn run(queue: &Queue) {
    let mut sinks: FxHashMap<u64, Open> = FxHashMap::default();
    let mut dirty: HashSet<u64> = HashSet::new();
    loop {
        let batch: Vec<Msg> = {
            let mut q = queue.lock();
            while q.is_empty() {
                q = if sinks.is_empty() {
                    queue.wake.wait(q).unwrap_or_else(|e| e.into_inner())
                } else {
                    queue
                        .wake
                        .wait_timeout(q, POLL)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                };
            }
            q.drain(..).collect()
        };
        queue.drained.notify_all();
        for msg in batch {
            // A panic in a sink must neither kill this thread (every later flush would wait
            // forever) nor pass silently: the writer reports it as an error.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                handle(msg, &mut sinks, &mut dirty)
            }));
            if result.is_err() {
                for open in sinks.values() {
                    open.status.set(Error::io(
                        "<hookloop writer thread>",
                        std::io::Error::other("internal error (panic) while writing metrics"),
                    ));
                }
            }
        }
        sync_dirty(&mut sinks, &mut dirty);
    }
}

fn sync_dirty(sinks: &mut FxHashMap<u64, Open>, dirty: &mut HashSet<u64>) {
    for id in dirty.drain() {
        if let Some(open) = sinks.get_mut(&id) {
            if let Err(e) = open.sink.sync() {
                open.status.set(e);
            }
        }
    }
}

fn handle(msg: Msg, sinks: &mut FxHashMap<u64, Open>, dirty: &mut HashSet<u64>) {
    match msg {
        Msg::Open(id, sink, status) => {
            sinks.insert(id, Open { sink, status });
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
        Msg::Close(id, ack) => {
            dirty.remove(&id);
            if let Some(mut open) = sinks.remove(&id) {
                if let Err(e) = open.sink.close() {
                    open.status.set(e);
                }
            }
            let _ = ack.send(());
        }
        Msg::Barrier(ack) => {
            sync_dirty(sinks, dirty);
            let _ = ack.send(());
        }
    }
}

/// Waits until everything queued so far by any writer of this process is written (and
/// synced per each writer's policy). Interpreter exit calls this.
pub fn flush_all() -> Result<()> {
    let guard = THREAD.lock().unwrap_or_else(|e| e.into_inner());
    let Some(h) = guard.as_ref().filter(|h| h.pid == std::process::id()) else {
        return Ok(());
    };
    let queue = h.queue.clone();
    drop(guard);
    queue.round_trip(Msg::Barrier);
    Ok(())
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
        queue.push(Msg::Open(id, sink, status.clone()), true);
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

    /// Raises the error the thread met since the last call, if any.
    pub fn check(&self) -> Result<()> {
        if self.pid != std::process::id() {
            let msg = format!(
                "this {} was opened in process {}; a forked child cannot use it",
                self.kind, self.pid
            );
            return Err(Error::io(&self.path, std::io::Error::other(msg)));
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

    /// Waits until everything this process queued is written.
    pub fn flush(&self) -> Result<()> {
        self.check()?;
        self.queue.round_trip(Msg::Barrier);
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
        self.queue.round_trip(|ack| Msg::Close(id, ack));
        match self.status.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for SinkHandle {
    fn drop(&mut self) {
        // A writer dropped without close(): still write what was queued and close the file.
        let _ = self.close();
    }
}

/// Groups smoothed scalars newer than `*last_write` by iteration (first-appearance order,
/// as detectron2's dict), and advances `*last_write` to the newest iteration written.
pub fn group_new_by_iteration(
    scalars: Vec<crate::storage::SmoothedScalar>,
    last_write: &mut f64,
) -> Vec<JsonRow> {
    let mut rows: Vec<JsonRow> = Vec::new();
    let mut newest = *last_write;
    for s in scalars {
        let it = s.iter.as_f64();
        if it <= *last_write {
            continue;
        }
        newest = newest.max(it);
        match rows.iter_mut().find(|r| r.iter.as_f64() == it) {
            Some(row) => row.scalars.push((s.name, s.value)),
            None => rows.push(JsonRow {
                iter: s.iter,
                scalars: vec![(s.name, s.value)],
            }),
        }
    }
    *last_write = newest;
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::SmoothedScalar;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hookloop-writer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn row(iter: i64, scalars: &[(&str, f64)]) -> JsonRow {
        JsonRow {
            iter: Iter::Int(iter),
            scalars: scalars.iter().map(|(k, v)| (Arc::from(*k), *v)).collect(),
        }
    }

    #[test]
    fn json_sink_writes_exact_lines_through_the_thread() {
        let path = tmpdir("json").join("metrics.json");
        let sink = JsonSink::open(&path, FsyncPolicy::Always).unwrap();
        let mut h = SinkHandle::open(Box::new(sink), "JSONWriter", path.clone()).unwrap();
        h.send(Payload::Json(vec![row(
            19,
            &[("loss", 0.5), ("data_time", 1e-05)],
        )]))
        .unwrap();
        h.send(Payload::Json(vec![row(39, &[("loss", 0.25)])]))
            .unwrap();
        h.close().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\"data_time\": 1e-05, \"iteration\": 19, \"loss\": 0.5}\n{\"iteration\": 39, \"loss\": 0.25}\n"
        );
        assert!(matches!(
            h.send(Payload::Json(vec![])),
            Err(Error::Closed { .. })
        ));
    }

    #[test]
    fn json_sink_cuts_a_torn_last_line() {
        let path = tmpdir("torn").join("metrics.json");
        std::fs::write(&path, "{\"iteration\": 1}\n{\"itera").unwrap();
        let mut sink = JsonSink::open(&path, FsyncPolicy::Never).unwrap();
        sink.write(Payload::Json(vec![row(2, &[])])).unwrap();
        sink.sync().unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"iteration\": 1}\n{\"iteration\": 2}\n"
        );
    }

    #[test]
    fn unwritable_location_fails_at_open_with_the_path() {
        let path = PathBuf::from("/nonexistent-dir-hookloop/metrics.json");
        let err = JsonSink::open(&path, FsyncPolicy::Always).err().unwrap();
        assert!(
            err.to_string()
                .contains("/nonexistent-dir-hookloop/metrics.json"),
            "{err}"
        );
    }

    #[test]
    fn disk_full_is_reported_at_next_send() {
        // /dev/full accepts open() and fails every write with ENOSPC.
        let path = PathBuf::from("/dev/full");
        if !path.exists() {
            return;
        }
        let file = OpenOptions::new().append(true).open(&path).unwrap();
        let sink = JsonSink {
            path: path.clone(),
            file,
            pending: String::new(),
            len: 0,
            fsync: FsyncPolicy::Never,
        };
        let mut h = SinkHandle::open(Box::new(sink), "JSONWriter", path.clone()).unwrap();
        h.send(Payload::Json(vec![row(0, &[("a", 1.0)])])).unwrap();
        h.flush()
            .err()
            .map(|e| assert!(matches!(e, Error::Io { .. }), "{e}"))
            .unwrap_or_else(|| {
                // The error may land after the barrier's check; close() reports it then.
                assert!(h.close().is_err());
            });
    }

    #[test]
    fn event_sink_is_lazy() {
        let dir = tmpdir("events").join("tb");
        let sink = EventSink::new(dir.clone(), "host", "", FsyncPolicy::Close);
        let path = sink.path();
        let mut h = SinkHandle::open(Box::new(sink), "TensorboardXWriter", path.clone()).unwrap();
        h.flush().unwrap();
        assert!(!dir.exists());
        let scalars = vec![ScalarPoint {
            tag: "loss".into(),
            value: 0.5,
            step: 3,
        }];
        h.send(Payload::Events {
            wall_time: 1.0,
            scalars,
            images: vec![],
            histograms: vec![],
        })
        .unwrap();
        h.close().unwrap();
        assert!(path.exists());
        assert!(path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents."));
    }

    #[test]
    fn grouping_skips_written_iterations() {
        let s = |name: &str, value, iter| SmoothedScalar {
            name: name.into(),
            value,
            iter: Iter::Int(iter),
        };
        let mut last = -1.0;
        let rows = group_new_by_iteration(
            vec![s("a", 1.0, 5), s("b", 2.0, 4), s("c", 3.0, 5)],
            &mut last,
        );
        assert_eq!(
            rows,
            vec![row(5, &[("a", 1.0), ("c", 3.0)]), row(4, &[("b", 2.0)])]
        );
        assert_eq!(last, 5.0);
        let rows = group_new_by_iteration(vec![s("a", 1.0, 5), s("b", 2.0, 6)], &mut last);
        assert_eq!(rows, vec![row(6, &[("b", 2.0)])]);
    }
}
