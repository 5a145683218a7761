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
//! - **Lines stay inside their page.** metrics.json's lines are laid out by
//!   [`page_aligned_lines`] so that a line of at most a page never crosses a page boundary:
//!   the line before it is padded with trailing spaces. So after `kill -9` every line of up to
//!   4 KiB is whole; only a longer line can be torn.
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

/// A batch of lines laid out for the file: see [`page_aligned_lines`].
#[derive(Debug, PartialEq, Eq)]
pub struct Layout {
    /// The bytes to append.
    pub data: Vec<u8>,
    /// The end offsets of its units, ascending, the last one `data.len()`.
    pub ends: Vec<usize>,
    /// `data` begins by padding the file's last line: the caller cuts the file's final
    /// newline first (appending at one byte before the offset given), and `data`'s first unit
    /// is the spaces and that newline.
    pub retract_newline: bool,
}

/// Lays out `text` (lines, appended at file offset `offset`) so that no line of at most
/// [`PAGE`] bytes crosses a page boundary of the file, so that `kill -9` can never tear it
/// (see the module): where a line would cross one, the line before it is padded with spaces
/// before its newline (whitespace JSON allows after a value) and the line starts on the
/// boundary. When the line before is the file's last, `file_ends_with_newline` (called at
/// most once) says whether it can be padded; the layout then starts by retracting it. A line
/// longer than a page, or a first line after a file that does not end with a newline, is left
/// where it falls.
pub fn page_aligned_lines(
    text: &[u8],
    offset: u64,
    file_ends_with_newline: impl FnOnce() -> bool,
) -> Layout {
    let mut ask = Some(file_ends_with_newline);
    let mut data = Vec::with_capacity(text.len());
    let mut ends: Vec<usize> = Vec::new();
    let mut base = offset;
    let mut retract_newline = false;
    let mut start = 0;
    for end in line_ends(text) {
        let line = &text[start..end];
        start = end;
        let used = ((base + data.len() as u64) % PAGE as u64) as usize;
        if used != 0 && line.len() <= PAGE && used + line.len() > PAGE {
            let pad = PAGE - used;
            if data.last() == Some(&b'\n') {
                data.pop();
                data.resize(data.len() + pad, b' ');
                data.push(b'\n');
                if let Some(last) = ends.last_mut() {
                    *last += pad;
                }
            } else if data.is_empty() && offset > 0 && ask.take().is_some_and(|f| f()) {
                base = offset - 1;
                retract_newline = true;
                data.resize(pad, b' ');
                data.push(b'\n');
                ends.push(data.len());
            }
        }
        data.extend_from_slice(line);
        ends.push(data.len());
    }
    Layout {
        data,
        ends,
        retract_newline,
    }
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

    /// Where `layout` puts each line of the file it is appended to (a file of `at` bytes):
    /// `(start, end)` file offsets of the lines, the retracted newline's line ending after
    /// the padding.
    fn placed(layout: &Layout, at: u64) -> Vec<(u64, u64)> {
        let base = at - u64::from(layout.retract_newline);
        let mut start = base;
        let mut out = Vec::new();
        for (k, &e) in layout.ends.iter().enumerate() {
            let end = base + e as u64;
            if !(k == 0 && layout.retract_newline) {
                out.push((start, end));
            }
            start = end;
        }
        out
    }

    /// Lines of 50 B to 4 KiB (and a few longer), each a JSON object.
    fn mixed_lines(n: usize) -> Vec<u8> {
        let mut text = Vec::new();
        for i in 0..n {
            let width = if i % 41 == 7 {
                PAGE + 1 + i
            } else {
                50 + (i * 7919) % (PAGE - 49)
            };
            text.extend(lines(1, width));
        }
        text
    }

    #[test]
    fn no_line_of_at_most_a_page_crosses_a_page_boundary() {
        let text = mixed_lines(300);
        for at in OFFSETS {
            let layout = page_aligned_lines(&text, at as u64, || true);
            assert_eq!(*layout.ends.last().unwrap(), layout.data.len());
            for (start, end) in placed(&layout, at as u64) {
                let len = (end - start) as usize;
                if len <= PAGE {
                    assert_eq!(start / 4096, (end - 1) / 4096, "{start}..{end} from {at}");
                }
            }
            // The same lines, only trailing spaces added before some newlines.
            let unpadded: Vec<u8> = layout
                .data
                .split_inclusive(|&b| b == b'\n')
                .flat_map(|l| {
                    let body = l.trim_ascii_end();
                    body.iter()
                        .copied()
                        .chain((!body.is_empty()).then_some(b'\n'))
                })
                .collect();
            assert_eq!(unpadded, text, "from {at}");
        }
    }

    #[test]
    fn a_first_line_that_would_cross_pads_the_files_last_line() {
        let text = lines(1, 200);
        let layout = page_aligned_lines(&text, 4000, || true);
        assert!(layout.retract_newline);
        // The file is cut to 3999 bytes, then 96 spaces and the newline end at 4096.
        let mut want = vec![b' '; 96];
        want.push(b'\n');
        want.extend(&text);
        assert_eq!(layout.data, want);
        assert_eq!(layout.ends, [97, 297]);
        // Not when the file's last byte is not a newline, or the line fits.
        let layout = page_aligned_lines(&text, 4000, || false);
        assert_eq!((layout.retract_newline, layout.data), (false, text.clone()));
        let layout = page_aligned_lines(&text, 3896, || unreachable!());
        assert_eq!((layout.retract_newline, layout.data), (false, text.clone()));
        // A page-long line at a boundary, and a longer one anywhere, stay where they fall.
        let page = lines(1, PAGE);
        assert_eq!(
            page_aligned_lines(&page, 8192, || unreachable!()).data,
            page
        );
        let long = lines(1, PAGE + 1);
        assert_eq!(page_aligned_lines(&long, 10, || unreachable!()).data, long);
    }

    #[test]
    fn the_file_is_the_same_whatever_the_batches() {
        // Appending the lines in batches of any size leaves the bytes of one batch: a resumed
        // run's file equals an uninterrupted one's.
        let text = mixed_lines(120);
        let ends = line_ends(&text);
        let whole = page_aligned_lines(&text, 0, || unreachable!()).data;
        for batch in [1, 2, 3, 7, 20] {
            let mut file: Vec<u8> = Vec::new();
            for group in ends.chunks(batch) {
                let start = file.len();
                let first = ends.partition_point(|&e| e < group[0]);
                let from = if first == 0 { 0 } else { ends[first - 1] };
                let chunk = &text[from..*group.last().unwrap()];
                let layout =
                    page_aligned_lines(chunk, start as u64, || file.last() == Some(&b'\n'));
                if layout.retract_newline {
                    file.pop();
                }
                file.extend(layout.data);
            }
            assert_eq!(file, whole, "batches of {batch}");
        }
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

    /// What page-bounded writes, and the padding that keeps lines inside their page, cost the
    /// writer thread against one `write_all` per batch, and the padding's bytes:
    /// `cargo test --release -p hookloop-core -- --ignored --nocapture page_bounded_cost`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn page_bounded_cost() {
        let dir = std::env::temp_dir().join(format!("hookloop-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // (widths, lines per batch); width 0 is 50 B to 4 KiB, varying.
        for (width, batch) in [
            (200, 1),
            (200, 20),
            (200, 256),
            (3000, 256),
            (0, 1),
            (0, 20),
        ] {
            let mut data = Vec::new();
            for i in 0..batch.max(64) {
                let w = if width > 0 {
                    width
                } else {
                    50 + (i * 7919) % 4046
                };
                let mut line = format!("{{\"iteration\": {i}, \"x\": \"");
                line.push_str(&"p".repeat(w - line.len() - 3));
                line.push_str("\"}\n");
                data.extend_from_slice(line.as_bytes());
            }
            // Batches of `batch` lines, cycling through the 64+ lines made.
            let all = line_ends(&data);
            let groups: Vec<&[u8]> = all
                .chunks(batch)
                .scan(0, |from, g| {
                    let chunk = &data[*from..*g.last().unwrap()];
                    *from = *g.last().unwrap();
                    Some(chunk)
                })
                .filter(|c| line_ends(c).len() == batch)
                .collect();
            let batches = (20 << 20) / (data.len() / groups.len()).max(1);
            let mut best = [f64::MAX; 3];
            let mut bytes = [0u64; 3];
            for _ in 0..3 {
                for (k, best) in best.iter_mut().enumerate() {
                    let path = dir.join("m.json");
                    let _ = std::fs::remove_file(&path);
                    let mut file = std::fs::OpenOptions::new()
                        .read(true)
                        .append(true)
                        .create(true)
                        .open(&path)
                        .unwrap();
                    let t = Instant::now();
                    for b in 0..batches {
                        let chunk = groups[b % groups.len()];
                        if k == 0 {
                            file.write_all(chunk).unwrap();
                            continue;
                        }
                        let mut start = live_len(&file, &path).unwrap();
                        if k == 1 {
                            append_units(&mut file, chunk, &line_ends(chunk), start).unwrap();
                            continue;
                        }
                        let layout = page_aligned_lines(chunk, start, || true);
                        if layout.retract_newline {
                            start -= 1;
                            file.set_len(start).unwrap();
                        }
                        append_units(&mut file, &layout.data, &layout.ends, start).unwrap();
                    }
                    *best = best.min(t.elapsed().as_secs_f64() / batches as f64);
                    bytes[k] = file.metadata().unwrap().len();
                }
            }
            let per_line = |a: f64, b: f64| (b - a) * 1e6 / batch as f64;
            println!(
                "lines of {} B, {batch} per batch: one write_all {:.2} µs/batch, page-bounded \
                 {:+.2} µs/line, padded {:+.2} µs/line more; padding {:.1}% of the bytes",
                if width > 0 {
                    width.to_string()
                } else {
                    "50-4096".into()
                },
                best[0] * 1e6,
                per_line(best[0], best[1]),
                per_line(best[1], best[2]),
                (bytes[2] as f64 / bytes[0] as f64 - 1.0) * 100.0
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
