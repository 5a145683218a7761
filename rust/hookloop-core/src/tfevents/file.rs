//! The event file of a log directory, created lazily, and the writer thread's sink that
//! appends batches of events to it.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::encode::{encode_events, file_version_record, purge_record};
use crate::error::{Error, Result};
use crate::writer::{Durability, FsyncPolicy, Payload, Sink};

/// An event file name as torch.utils.tensorboard names it:
/// `events.out.tfevents.{time:010}.{hostname}.{pid}.{uid}`.
pub fn event_file_name(unix_time_secs: u64, hostname: &str, pid: u32, uid: u64) -> String {
    format!("events.out.tfevents.{unix_time_secs:010}.{hostname}.{pid}.{uid}")
}

/// Appends framed `records` in page-bounded write calls (see `append`), after checking the
/// file still exists at `path`; on disk full the whole records that fit stay.
pub(super) fn append_records(
    file: &mut File,
    path: &std::path::Path,
    records: &[u8],
) -> Result<()> {
    let start = crate::append::live_len(file, path)?;
    let ends = crate::append::record_ends(records);
    crate::append::append_units(file, records, &ends, start)
        .map_err(|f| f.into_error(path, "records"))
}

pub(super) fn unix_time_now() -> f64 {
    // A clock before 1970 is a broken clock; 0.0 still gives a readable file.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One event file in a log directory, created on its first non-empty append.
///
/// Invariant: the file holds only whole records, and its first record is the
/// `file_version` event; a failed append is truncated away.
#[derive(Debug)]
pub struct EventFile {
    log_dir: PathBuf,
    file_name: String,
    file: Option<File>,
    // False until the file_version record is on disk; a failed first write retries it.
    header_written: bool,
    // The log directory's (device, inode) when it already existed at construction: if it is
    // gone by the first write (rmtree of the output directory), that is an error, not a new
    // directory holding only the event file.
    dir_id: Option<(u64, u64)>,
}

pub(super) fn dir_id(dir: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir)
        .ok()
        .filter(|m| m.is_dir())
        .map(|m| (m.dev(), m.ino()))
}

impl EventFile {
    /// An event file at `log_dir/file_name`. Only looks at `log_dir`: the directory (if
    /// missing) and the file appear on the first [`append`](Self::append) with records.
    pub fn new(log_dir: PathBuf, file_name: String) -> EventFile {
        EventFile {
            dir_id: dir_id(&log_dir),
            log_dir,
            file_name,
            file: None,
            header_written: false,
        }
    }

    /// Appends already framed `records` (see [`encode_events`]).
    ///
    /// The first call with records creates the log directory and the file (failing if the
    /// file already exists) and writes the `file_version` record before them. `records`
    /// go to disk with one `write_all`; if it fails (disk full, quota) the file is
    /// truncated back to its previous length and the error returned. An empty `records`
    /// does nothing, so a writer that never logs leaves no file behind. Errors do not
    /// name the path; callers add [`path`](Self::path).
    pub fn append(&mut self, records: &[u8]) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let path = self.path();
        let file = match &mut self.file {
            Some(file) => file,
            None => {
                let io = |e| Error::io(&path, e);
                if self.dir_id.is_some() && dir_id(&self.log_dir) != self.dir_id {
                    return Err(Error::Deleted {
                        path: self.log_dir.clone(),
                    });
                }
                std::fs::create_dir_all(&self.log_dir).map_err(io)?;
                let file = OpenOptions::new()
                    .append(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(io)?;
                self.file.insert(file)
            }
        };
        if !self.header_written {
            append_records(file, &path, &file_version_record(unix_time_now()))?;
            self.header_written = true;
        }
        append_records(file, &path, records)
    }

    /// Checks that the file, once created, still exists at its path (before: that a log
    /// directory that existed at construction still does).
    pub fn verify(&self) -> Result<()> {
        match &self.file {
            Some(file) => crate::append::live_len(file, &self.path()).map(|_| ()),
            None if self.dir_id.is_some() && dir_id(&self.log_dir) != self.dir_id => {
                Err(Error::Deleted {
                    path: self.log_dir.clone(),
                })
            }
            None => Ok(()),
        }
    }

    /// Flushes the file; with `fsync`, also waits until its data reach the disk.
    /// Does nothing before the file exists.
    pub fn flush(&mut self, fsync: bool) -> io::Result<()> {
        if let Some(file) = &mut self.file {
            file.flush()?;
            if fsync {
                file.sync_data()?;
            }
        }
        Ok(())
    }

    /// `log_dir/file_name`, whether or not the file exists yet.
    pub fn path(&self) -> PathBuf {
        self.log_dir.join(&self.file_name)
    }

    /// Whether the file has been created on disk.
    pub fn is_created(&self) -> bool {
        self.file.is_some()
    }
}

/// A TensorBoard event file, created at its first non-empty write.
pub struct EventSink {
    file: EventFile,
    fsync: Durability,
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
            fsync: Durability::new(fsync),
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
        // EventFile::append keeps the whole records that fit and cuts a torn one.
        let result = self.file.append(&self.buf);
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
            tensors,
        } = payload
        else {
            return Ok(());
        };
        // On a bad image encode_events leaves the buffer as it was.
        encode_events(
            &mut self.buf,
            wall_time,
            &scalars,
            &images,
            &histograms,
            &tensors,
        )
    }

    fn sync(&mut self) -> Result<()> {
        self.write_pending()?;
        let now = Instant::now();
        let fsync = self.fsync.after_batch(now);
        self.file
            .flush(fsync)
            .map_err(|e| Error::io(self.file.path(), e))?;
        if fsync {
            self.fsync.synced(now);
        }
        Ok(())
    }

    fn tick(&mut self, pause: bool) -> Result<()> {
        let now = Instant::now();
        if self.fsync.due(now, pause) {
            self.file
                .flush(true)
                .map_err(|e| Error::io(self.file.path(), e))?;
            self.fsync.synced(now);
        }
        Ok(())
    }

    fn purge(&mut self, wall_time: f64, from: f64) -> Result<u64> {
        self.buf.extend(purge_record(wall_time, from as i64));
        self.write_pending()?;
        Ok(0)
    }

    fn verify(&mut self) -> Result<()> {
        self.file.verify()
    }

    fn close(&mut self) -> Result<()> {
        self.write_pending()?;
        self.file.verify()?;
        self.file
            .flush(self.fsync.at_close())
            .map_err(|e| Error::io(self.file.path(), e))
    }
}
