//! Appending whole lines (metrics.json) and whole records (event files): the one rule both
//! sinks follow for what may reach a file, and what a failed write may take away.
//!
//! - **Page-bounded writes.** A batch goes to the file in write calls that each hold whole
//!   units (lines or records) and lie within one [`PAGE`] of the file (between two
//!   4096-aligned offsets); a unit that crosses a page boundary of the file gets a write call
//!   of its own. Linux checks for SIGKILL between the pages (or folios) of one `write`, so a
//!   write can be cut only where it crosses a page boundary of the file: with this rule that
//!   is only ever inside one unit, the one crossing it, whose two sides are copied back to
//!   back. So after `kill -9` a file holds whole units, in order, except that the last may be
//!   torn, cut at a 4096-aligned offset inside it; the next `JSONWriter` on the file cuts it.
//! - **Disk full keeps what fits.** A write that fails part-way keeps every whole unit that
//!   reached the file and removes only the torn bytes of the failed unit.
//! - **A rollback removes only its own bytes**: it is measured from the end of this handle's
//!   last write, done only while nothing was appended after it (another writer's lines on the
//!   same file), and never goes below the file's length when the batch began.

use std::fs::File;
use std::io::{self, Seek, Write};
use std::path::Path;

use crate::{Error, Result};

/// A page of the file: a write call of more than one unit never crosses a multiple of it.
pub const PAGE: usize = 4096;

/// What an append needs of a file; a trait so tests can fill the disk or interleave another
/// writer between two write calls.
pub trait AppendFile {
    /// One `write` call (append mode).
    fn write_once(&mut self, data: &[u8]) -> io::Result<usize>;
    /// Where this handle's last write ended (in append mode, the file offset).
    fn position(&mut self) -> io::Result<u64>;
    /// The file's length now, whoever wrote it.
    fn real_len(&self) -> io::Result<u64>;
    /// Cuts the file to `len`.
    fn truncate_to(&self, len: u64) -> io::Result<()>;
}

impl AppendFile for File {
    fn write_once(&mut self, data: &[u8]) -> io::Result<usize> {
        self.write(data)
    }

    fn position(&mut self) -> io::Result<u64> {
        self.stream_position()
    }

    fn real_len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn truncate_to(&self, len: u64) -> io::Result<()> {
        self.set_len(len)
    }
}

/// An append that failed: the first `kept` units are in the file, the other `dropped` not.
#[derive(Debug)]
pub struct AppendFailure {
    pub kept: usize,
    pub dropped: usize,
    pub source: io::Error,
}

impl AppendFailure {
    /// The core error for this failure on `path`; `unit` names the units ("lines").
    pub fn into_error(self, path: &Path, unit: &'static str) -> Error {
        if self.kept == 0 && self.dropped <= 1 {
            return Error::io(path, self.source);
        }
        Error::WriteDropped {
            path: path.to_owned(),
            source: self.source,
            dropped: self.dropped,
            total: self.kept + self.dropped,
            unit,
        }
    }
}

/// The write calls of a batch that starts at file offset `offset`: `(start, end, units)` byte
/// ranges of `data` that hold whole units and lie within one [`PAGE`] of the file, or hold
/// exactly one unit that crosses a page boundary. `ends` are the units' end offsets,
/// ascending, the last one `data.len()`.
pub fn chunks(ends: &[usize], offset: u64) -> Vec<(usize, usize, usize)> {
    let page = |at: usize| (offset + at as u64) / PAGE as u64;
    let mut out = Vec::new();
    let (mut start, mut end, mut units) = (0, 0, 0);
    for &e in ends {
        let s = end;
        let crosses = e > s && page(s) != page(e - 1);
        if units > 0 && (crosses || page(start) != page(s)) {
            out.push((start, end, units));
            (start, units) = (s, 0);
        }
        end = e;
        units += 1;
        if crosses {
            out.push((start, end, units));
            (start, units) = (end, 0);
        }
    }
    if units > 0 {
        out.push((start, end, units));
    }
    out
}

/// Appends `data`, made of units ending at `ends`, in page-bounded write calls (see the
/// module). `start_len` is the file's length when the batch began: where the batch starts in
/// the file (pages are counted from it), and the floor of any rollback.
pub fn append_units<F: AppendFile>(
    file: &mut F,
    data: &[u8],
    ends: &[usize],
    start_len: u64,
) -> std::result::Result<(), AppendFailure> {
    let mut kept = 0;
    for (start, end, units) in chunks(ends, start_len) {
        let chunk = &data[start..end];
        let mut written = 0;
        while written < chunk.len() {
            match file.write_once(&chunk[written..]) {
                Ok(0) => {
                    let source = io::Error::from(io::ErrorKind::WriteZero);
                    return Err(fail(file, ends, start, written, kept, start_len, source));
                }
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(fail(file, ends, start, written, kept, start_len, source));
                }
            }
        }
        kept += units;
    }
    Ok(())
}

/// After `written` bytes of the chunk at `start` reached the file and the next write failed:
/// keeps the whole units among them, cuts the torn rest (only if it is still the file's end).
fn fail<F: AppendFile>(
    file: &mut F,
    ends: &[usize],
    start: usize,
    written: usize,
    kept: usize,
    start_len: u64,
    source: io::Error,
) -> AppendFailure {
    let reached = start + written;
    // Units of the failed chunk that reached the file whole.
    let first = ends.partition_point(|&e| e <= start);
    let whole = ends[first..].partition_point(|&e| e <= reached);
    let kept = kept + whole;
    let whole_end = if whole > 0 {
        ends[first + whole - 1]
    } else {
        start
    };
    let torn = (reached - whole_end) as u64;
    if torn > 0 {
        if let (Ok(pos), Ok(len)) = (file.position(), file.real_len()) {
            // Nothing was appended after our bytes: the torn tail is ours to remove.
            if pos == len && pos >= torn {
                let _ = file.truncate_to((pos - torn).max(start_len));
            }
        }
    }
    AppendFailure {
        kept,
        dropped: ends.len() - kept,
        source,
    }
}

/// The file's length, after checking that `path` still names the open `file`: a deleted file
/// (link count 0, e.g. its directory removed) or one replaced at its path is an error, since
/// what is written to it is lost.
pub fn live_len(file: &File, path: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    let named = match std::fs::metadata(path) {
        Ok(m) => m.dev() == meta.dev() && m.ino() == meta.ino(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(Error::io(path, e)),
    };
    if meta.nlink() == 0 || !named {
        return Err(Error::Deleted {
            path: path.to_owned(),
        });
    }
    Ok(meta.len())
}

/// The end offsets of the lines of `text` (each ends with `\n`, except perhaps the last).
pub fn line_ends(text: &[u8]) -> Vec<usize> {
    let mut ends: Vec<usize> = text
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i + 1)
        .collect();
    if ends.last() != Some(&text.len()) && !text.is_empty() {
        ends.push(text.len());
    }
    ends
}

/// The end offsets of the TFRecords framed in `data` (u64 LE length, 4-byte CRC, data, 4-byte
/// CRC); anything after a frame that does not fit counts as one unit.
pub fn record_ends(data: &[u8]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut pos = 0usize;
    while pos < data.len() {
        let next = data
            .get(pos..pos + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .and_then(|b| usize::try_from(u64::from_le_bytes(b)).ok())
            .and_then(|len| len.checked_add(16))
            .and_then(|n| pos.checked_add(n))
            .filter(|&end| end <= data.len())
            .unwrap_or(data.len());
        ends.push(next);
        pos = next;
    }
    ends
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames `data` as a TFRecord with zeroed checksums: `record_ends` reads only the
    /// lengths (the event format's own tests check the checksums).
    fn frame(out: &mut Vec<u8>, data: &[u8]) {
        out.extend_from_slice(&(data.len() as u64).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(data);
        out.extend_from_slice(&[0; 4]);
    }

    /// An in-memory file shared by handles: records every write call, fills up after `room`
    /// bytes (a short write, then ENOSPC), and can let "another writer" append between calls.
    #[derive(Default)]
    struct Mem {
        bytes: Vec<u8>,
        calls: Vec<usize>,
        /// The file offset of each write call.
        offsets: Vec<u64>,
        room: Option<usize>,
        pos: u64,
        /// Appended by someone else right after our next write call.
        interleave: Option<Vec<u8>>,
    }

    impl Mem {
        fn write_once(&mut self, data: &[u8]) -> io::Result<usize> {
            let n = match self.room {
                Some(0) => return Err(io::Error::from_raw_os_error(28)),
                Some(r) => data.len().min(r),
                None => data.len(),
            };
            if let Some(r) = &mut self.room {
                *r -= n;
            }
            self.offsets.push(self.bytes.len() as u64);
            self.bytes.extend_from_slice(&data[..n]);
            self.pos = self.bytes.len() as u64;
            self.calls.push(n);
            if let Some(other) = self.interleave.take() {
                self.bytes.extend_from_slice(&other);
            }
            Ok(n)
        }
    }

    /// `Mem` as a file (the trait truncates through `&self`).
    struct Cell(std::cell::RefCell<Mem>);

    impl AppendFile for Cell {
        fn write_once(&mut self, data: &[u8]) -> io::Result<usize> {
            self.0.get_mut().write_once(data)
        }
        fn position(&mut self) -> io::Result<u64> {
            Ok(self.0.borrow().pos)
        }
        fn real_len(&self) -> io::Result<u64> {
            Ok(self.0.borrow().bytes.len() as u64)
        }
        fn truncate_to(&self, len: u64) -> io::Result<()> {
            self.0.borrow_mut().bytes.truncate(len as usize);
            Ok(())
        }
    }

    fn lines(n: usize, width: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..n {
            let body = format!("{{\"iteration\": {i}, \"pad\": \"");
            out.extend_from_slice(body.as_bytes());
            out.resize(out.len() + width - body.len() - 3, b'x');
            out.extend_from_slice(b"\"}\n");
        }
        out
    }

    #[test]
    fn each_write_call_is_whole_lines_of_at_most_a_page() {
        let data = lines(100, 300);
        let ends = line_ends(&data);
        let mut f = Cell(Default::default());
        append_units(&mut f, &data, &ends, 0).unwrap();
        let mem = f.0.into_inner();
        assert_eq!(mem.bytes, data);
        assert!(mem.calls.len() > 1);
        let mut at = 0;
        for n in mem.calls {
            assert!(n <= PAGE, "a write call of {n} bytes");
            at += n;
            assert_eq!(data[at - 1], b'\n', "a write call ends mid-line");
        }
    }

    #[test]
    fn a_line_longer_than_a_page_gets_its_own_write_call() {
        let mut data = lines(2, 100);
        data.extend(lines(1, 3 * PAGE));
        data.extend(lines(2, 100));
        let ends = line_ends(&data);
        let mut f = Cell(Default::default());
        append_units(&mut f, &data, &ends, 0).unwrap();
        assert_eq!(f.0.into_inner().calls, [200, 3 * PAGE, 200]);
    }

    /// Appends `data` to a file already `at` bytes long; returns each write call's
    /// `(offset, len)` after checking the file ends with `data`.
    fn write_pattern(data: &[u8], ends: &[usize], at: usize) -> Vec<(u64, usize)> {
        let mut f = Cell(std::cell::RefCell::new(Mem {
            bytes: vec![b'\n'; at],
            pos: at as u64,
            ..Default::default()
        }));
        append_units(&mut f, data, ends, at as u64).unwrap();
        let mem = f.0.into_inner();
        assert_eq!(&mem.bytes[at..], data);
        mem.offsets.into_iter().zip(mem.calls).collect()
    }

    #[test]
    fn a_line_that_crosses_a_file_page_gets_its_own_write_call() {
        // From offset 4000: a line within page 0, one across 4096, two within page 1.
        let data = lines(4, 50);
        let calls = write_pattern(&data, &line_ends(&data), 4000);
        assert_eq!(calls, [(4000, 50), (4050, 50), (4100, 100)]);
        // A line ending exactly at 4096: the next write starts the next page.
        let data = lines(3, 48);
        let calls = write_pattern(&data, &line_ends(&data), 4000);
        assert_eq!(calls, [(4000, 96), (4096, 48)]);
    }

    /// Checks that every write call of `data` (units ending at `ends`) appended at `at` lies
    /// within one page of the file or is exactly one unit.
    fn assert_page_bounded(data: &[u8], ends: &[usize], at: usize) {
        let mut next = at as u64;
        for (offset, len) in write_pattern(data, ends, at) {
            assert_eq!(offset, next, "write calls are back to back");
            next += len as u64;
            let (start, end) = ((offset as usize) - at, (offset as usize) - at + len);
            assert!(ends.contains(&end), "a write call ends inside a unit");
            let first_page = offset / PAGE as u64;
            let last_page = (offset + len as u64 - 1) / PAGE as u64;
            if first_page != last_page {
                // Exactly one unit: it starts where the previous unit ends.
                let one = ends.partition_point(|&e| e <= start);
                assert_eq!(
                    ends[one], end,
                    "a write of several units crosses a page at {at}"
                );
                assert!(one == 0 || ends[one - 1] == start);
            }
        }
    }

    /// Widths of assorted sizes, some longer than a page.
    fn widths() -> impl Iterator<Item = usize> {
        (0..400usize).map(|i| {
            if i % 37 == 5 {
                4096 + i * 13
            } else {
                30 + (i * 7919) % 2500
            }
        })
    }

    const OFFSETS: [usize; 9] = [0, 1, 100, 2048, 4000, 4095, 4096, 5000, 3 * PAGE - 1];

    #[test]
    fn every_write_call_lies_within_one_file_page_or_is_exactly_one_line() {
        let mut data = Vec::new();
        for width in widths() {
            data.extend(lines(1, width));
        }
        for at in OFFSETS {
            assert_page_bounded(&data, &line_ends(&data), at);
        }
    }

    #[test]
    fn every_write_call_lies_within_one_file_page_or_is_exactly_one_record() {
        let mut data = Vec::new();
        for width in widths() {
            frame(&mut data, &vec![7; width]);
        }
        for at in OFFSETS {
            assert_page_bounded(&data, &record_ends(&data), at);
        }
    }

    #[test]
    fn disk_full_keeps_every_whole_line_that_fits() {
        // 50 lines of 100 bytes into 830 bytes of room: 8 whole lines stay, the torn 9th goes.
        let data = lines(50, 100);
        let ends = line_ends(&data);
        let mut f = Cell(std::cell::RefCell::new(Mem {
            room: Some(830),
            ..Default::default()
        }));
        let err = append_units(&mut f, &data, &ends, 0).unwrap_err();
        assert_eq!((err.kept, err.dropped), (8, 42));
        assert_eq!(err.source.raw_os_error(), Some(28));
        assert_eq!(f.0.into_inner().bytes, &data[..800]);
    }

    #[test]
    fn rollback_never_removes_another_writers_bytes() {
        // Another writer's 95 lines were on disk before; ours fail part-way.
        let theirs = lines(95, 50);
        let ours = lines(10, 100);
        let ends = line_ends(&ours);
        let start = theirs.len();
        let mut f = Cell(std::cell::RefCell::new(Mem {
            bytes: theirs.clone(),
            room: Some(250),
            ..Default::default()
        }));
        let err = append_units(&mut f, &ours, &ends, start as u64).unwrap_err();
        assert_eq!(err.kept, 2);
        let mut expected = theirs.clone();
        expected.extend_from_slice(&ours[..200]);
        assert_eq!(f.0.into_inner().bytes, expected);

        // Someone appended after our torn bytes: they stay (and so do our torn bytes).
        let mut f = Cell(std::cell::RefCell::new(Mem {
            bytes: theirs.clone(),
            room: Some(250),
            interleave: Some(b"{\"other\": 1}\n".to_vec()),
            ..Default::default()
        }));
        let _ = append_units(&mut f, &ours, &ends, start as u64).unwrap_err();
        let bytes = f.0.into_inner().bytes;
        assert!(bytes.starts_with(&theirs));
        assert!(bytes.len() >= theirs.len() + 250);
    }

    #[test]
    fn record_ends_follow_the_framing() {
        let mut data = Vec::new();
        frame(&mut data, &[1; 10]);
        frame(&mut data, &[2; 5000]);
        frame(&mut data, &[]);
        assert_eq!(record_ends(&data), [26, 26 + 5016, 26 + 5016 + 16]);
        assert_eq!(record_ends(&data[..30]), [26, 30]);
    }

    #[test]
    fn line_ends_include_an_unterminated_tail() {
        assert_eq!(line_ends(b"a\nbc\n"), [2, 5]);
        assert_eq!(line_ends(b"a\nbc"), [2, 4]);
        assert!(line_ends(b"").is_empty());
    }
}

#[cfg(test)]
mod cost {
    use super::*;
    use std::time::Instant;

    /// What page-bounded writes cost the writer thread against one `write_all` per batch:
    /// `cargo test --release -p hookloop-core -- --ignored --nocapture page_bounded_cost`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn page_bounded_cost() {
        let dir = std::env::temp_dir().join(format!("hookloop-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (width, batch) in [(200, 1), (200, 20), (200, 256), (3000, 256)] {
            let mut data = Vec::new();
            for i in 0..batch {
                let mut line = format!("{{\"iteration\": {i}, \"x\": \"");
                line.push_str(&"p".repeat(width - line.len() - 3));
                line.push_str("\"}\n");
                data.extend_from_slice(line.as_bytes());
            }
            let ends = line_ends(&data);
            let batches = (20 << 20) / data.len().max(1);
            let mut best = [f64::MAX; 2];
            for _ in 0..3 {
                for (k, best) in best.iter_mut().enumerate() {
                    let path = dir.join("m.json");
                    let _ = std::fs::remove_file(&path);
                    let mut file = std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(&path)
                        .unwrap();
                    let t = Instant::now();
                    for _ in 0..batches {
                        if k == 0 {
                            file.write_all(&data).unwrap();
                        } else {
                            let start = live_len(&file, &path).unwrap();
                            append_units(&mut file, &data, &ends, start).unwrap();
                        }
                    }
                    *best = best.min(t.elapsed().as_secs_f64() / batches as f64);
                }
            }
            println!(
                "lines of {width} B, {batch} per batch: one write_all {:.2} µs/batch, \
                 page-bounded {:.2} µs/batch ({:+.2} µs, {:.2} µs/line more)",
                best[0] * 1e6,
                best[1] * 1e6,
                (best[1] - best[0]) * 1e6,
                (best[1] - best[0]) * 1e6 / batch as f64
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
