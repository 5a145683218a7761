//! metrics.json: detectron2's JSON-lines format (one `json.dumps(..., sort_keys=True)` object
//! per line), the grouping of smoothed scalars into rows, and the sink that appends them.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::append;
use crate::iter::Iter;
use crate::pyexact::{write_json_str, write_repr_f64};
use crate::record::JsonRow;
use crate::storage::SmoothedScalar;
use crate::writer::{Durability, FsyncPolicy, Payload, Sink};
use crate::{Error, Result};

/// One line of detectron2's `metrics.json`, newline included:
/// `json.dumps(d, sort_keys=True) + "\n"` where `d = dict(scalars)` and then
/// `d["iteration"] = iteration`. A later duplicate name replaces an earlier one, and the
/// integer `iteration` replaces a scalar of that name, as dict assignment does. Keys sort
/// by code point, which is `str`'s byte order in UTF-8.
pub fn json_metrics_line(iteration: Iter, scalars: &[(&str, f64)]) -> String {
    // `None` stands for the integer iteration; it is pushed last, so it wins over any
    // scalar named "iteration" just as the later of two duplicate scalars wins.
    let mut entries: Vec<(&str, Option<f64>)> =
        scalars.iter().map(|&(n, v)| (n, Some(v))).collect();
    entries.push(("iteration", None));
    // Stable: equal names stay in input order, so the last of each run is the one kept.
    entries.sort_by(|a, b| a.0.cmp(b.0));

    let mut out = String::with_capacity(16 + 32 * entries.len());
    out.push('{');
    let mut first = true;
    for (k, &(name, value)) in entries.iter().enumerate() {
        if entries.get(k + 1).is_some_and(|next| next.0 == name) {
            continue;
        }
        if !first {
            out.push_str(", ");
        }
        first = false;
        write_json_str(&mut out, name);
        out.push_str(": ");
        match value {
            Some(v) => write_repr_f64(&mut out, v),
            None => match iteration {
                Iter::Int(i) => {
                    let _ = write!(out, "{i}");
                }
                Iter::Float(f) => write_repr_f64(&mut out, f),
            },
        }
    }
    out.push_str("}\n");
    out
}

/// Groups smoothed scalars by iteration, in first-appearance order (as detectron2's dict).
pub fn group_by_iteration(scalars: Vec<SmoothedScalar>) -> Vec<JsonRow> {
    let n = scalars.len();
    let mut rows: Vec<JsonRow> = Vec::new();
    for (k, s) in scalars.into_iter().enumerate() {
        let it = s.iter.as_f64();
        match rows.iter_mut().find(|r| r.iter.as_f64() == it) {
            Some(row) => row.scalars.push((s.name, s.value)),
            None => {
                // Room for every scalar still to come: one row per write is the common case,
                // and then its vector never grows.
                let mut row = Vec::with_capacity(n - k);
                row.push((s.name, s.value));
                rows.push(JsonRow {
                    iter: s.iter,
                    scalars: row,
                });
            }
        }
    }
    rows
}

/// metrics.json: one JSON object per line, appended. A failed write is cut back to whole lines;
/// a SIGKILL inside a write can leave a torn last line, which `open` cuts off next time.
pub struct JsonSink {
    path: PathBuf,
    file: File,
    /// Whole lines formatted but not yet written.
    pending: String,
    /// The file ends with a whole object but no newline: the next line starts with one.
    needs_newline: bool,
    fsync: Durability,
}

impl JsonSink {
    /// fsyncs the file's data (`Durability` decides when).
    fn sync_data(&mut self, now: Instant) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::io(&self.path, e))?;
        self.fsync.synced(now);
        Ok(())
    }

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
        let whole = whole_lines_len(&mut file, len).map_err(io)?;
        let refuse = |reason: String| {
            Error::bad_value(
                format!("JSONWriter: '{}'", path.display()),
                format!(
                    "is not a JSON-lines file ({reason}); refusing to append to it \
                     (move it away or pick another path)"
                ),
            )
        };
        if whole > 0 {
            let (first, last) = first_and_last_lines(&mut file, whole).map_err(io)?;
            for (which, line) in [("first", first), ("last", last)] {
                if !is_json_object(&line) {
                    return Err(refuse(format!("its {which} line is not a JSON object")));
                }
            }
        }
        let mut needs_newline = false;
        if whole < len {
            // An unterminated tail: a whole object (a file written without a final newline)
            // is kept; a torn line (a run killed mid-write) is cut; anything else is refused.
            let tail = read_at(&mut file, whole, len - whole).map_err(io)?;
            if is_json_object(&tail) {
                needs_newline = true;
            } else if tail.first() == Some(&b'{') && !tail.contains(&0) {
                file.set_len(whole).map_err(io)?;
            } else {
                let what = if whole == 0 {
                    "its content"
                } else {
                    "its last line"
                };
                return Err(refuse(format!("{what} is not a JSON object")));
            }
        }
        Ok(JsonSink {
            path: path.to_owned(),
            file,
            pending: String::new(),
            needs_newline,
            fsync: Durability::new(fsync),
        })
    }
}

/// How much of a line `open` reads to check it is a JSON object: a longer one counts as not.
const MAX_CHECKED_LINE: u64 = 1 << 20;

fn read_at(file: &mut File, start: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; usize::try_from(len.min(MAX_CHECKED_LINE)).unwrap_or(0)];
    file.seek(SeekFrom::Start(start))?;
    file.read_exact(&mut buf)?;
    Ok(buf)
}

/// The first and the last line of the first `whole` bytes (which end with a newline).
fn first_and_last_lines(file: &mut File, whole: u64) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let head = read_at(file, 0, whole)?;
    let first = match head.iter().position(|&b| b == b'\n') {
        Some(end) => head[..end].to_vec(),
        None => head, // longer than MAX_CHECKED_LINE
    };
    let back = whole.min(MAX_CHECKED_LINE);
    let tail = read_at(file, whole - back, back)?;
    let body = &tail[..tail.len() - 1];
    let last = match body.iter().rposition(|&b| b == b'\n') {
        Some(start) => body[start + 1..].to_vec(),
        None if back == whole => body.to_vec(),
        None => Vec::new(), // longer than MAX_CHECKED_LINE
    };
    Ok((first, last))
}

/// Whether `line` is one JSON object (Python's `NaN`/`Infinity` values allowed).
fn is_json_object(line: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(line) else {
        return false;
    };
    let text = text.trim();
    text.starts_with('{') && {
        let strict = text
            .replace(": NaN", ": null")
            .replace(": -Infinity", ": null")
            .replace(": Infinity", ": null");
        matches!(
            serde_json::from_str::<serde_json::Value>(&strict),
            Ok(serde_json::Value::Object(_))
        )
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
    /// Appends the pending lines in page-bounded write calls (see `append`), after checking
    /// the file still exists at its path. On disk full the whole lines that fit stay.
    fn write_pending(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let text = std::mem::take(&mut self.pending);
        let mut start = append::live_len(&self.file, &self.path)?;
        let file = &mut self.file;
        let layout = append::page_aligned_lines(text.as_bytes(), start, || {
            read_at(file, start - 1, 1).is_ok_and(|b| b == b"\n")
        });
        if layout.retract_newline {
            // The file's last line gets the padding: its newline is cut and appended again
            // after the spaces. A kill between the two leaves a whole object without a
            // newline, which `open` keeps.
            start -= 1;
            self.file
                .set_len(start)
                .map_err(|e| Error::io(&self.path, e))?;
        }
        let appended = append::append_units(&mut self.file, &layout.data, &layout.ends, start);
        let untouched = || self.file.metadata().is_ok_and(|m| m.len() == start);
        if appended.is_err() && layout.retract_newline && untouched() {
            // Not even the padding reached the file: put the newline back, or start the next
            // line with one.
            self.needs_newline = self.file.write_all(b"\n").is_err();
        }
        appended.map_err(|f| f.into_error(&self.path, "lines"))
    }
}

/// The `iteration` of a metrics.json line, if it is a JSON object with a numeric one.
/// Python's `json.dumps` writes non-finite floats as `NaN`/`Infinity`, which strict JSON
/// lacks: as values (after `": "`) they are read as null.
pub fn line_iteration(line: &str) -> Option<f64> {
    let value: serde_json::Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(_) => {
            let strict = line
                .replace(": NaN", ": null")
                .replace(": -Infinity", ": null")
                .replace(": Infinity", ": null");
            serde_json::from_str(&strict).ok()?
        }
    };
    value.get("iteration")?.as_f64()
}

/// `text` (whole lines) without the lines whose iteration is `>= from`; lines without an
/// iteration are kept. Returns the kept text and the number of lines removed.
pub fn drop_iterations_from(text: &str, from: f64) -> (String, u64) {
    let mut kept = String::with_capacity(text.len());
    let mut removed = 0;
    for line in text.split_inclusive('\n') {
        if line_iteration(line.trim_end()).is_some_and(|it| it >= from) {
            removed += 1;
        } else {
            kept.push_str(line);
        }
    }
    (kept, removed)
}

impl JsonSink {
    /// Rewrites the file without the lines of iterations `>= from`, atomically: a temporary
    /// file in the same directory, fsynced, renamed over the file, the directory fsynced; then
    /// appends continue on the new file. A kill at any moment leaves the old or the new file.
    fn rewrite_without(&mut self, from: f64) -> Result<u64> {
        let io = |e| Error::io(&self.path, e);
        let mut text = String::new();
        self.file.seek(SeekFrom::Start(0)).map_err(io)?;
        self.file.read_to_string(&mut text).map_err(io)?;
        let (kept, removed) = drop_iterations_from(&text, from);
        if removed == 0 {
            return Ok(0);
        }
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let tmp = self.path.with_file_name(format!(
            ".{}.purge-{}.tmp",
            name.unwrap_or_default(),
            std::process::id()
        ));
        let tmp_io = |e| Error::io(&tmp, e);
        {
            let mut f = File::create(&tmp).map_err(tmp_io)?;
            f.write_all(kept.as_bytes()).map_err(tmp_io)?;
            f.sync_all().map_err(tmp_io)?;
        }
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        self.file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&self.path)
            .map_err(io)?;
        Ok(removed)
    }
}

impl Sink for JsonSink {
    fn write(&mut self, payload: Payload) -> Result<()> {
        let rows = match payload {
            Payload::Json(rows) => rows,
            Payload::Text(text) => {
                self.pending.push_str(&text);
                return Ok(());
            }
            Payload::Events { .. } => return Ok(()),
        };
        if self.needs_newline && !rows.is_empty() {
            self.pending.push('\n');
            self.needs_newline = false;
        }
        for row in &rows {
            let scalars: Vec<(&str, f64)> = row.scalars.iter().map(|(k, v)| (&**k, *v)).collect();
            self.pending
                .push_str(&json_metrics_line(row.iter, &scalars));
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<()> {
        self.write_pending()?;
        let now = Instant::now();
        if self.fsync.after_batch(now) {
            self.sync_data(now)?;
        }
        Ok(())
    }

    fn tick(&mut self, pause: bool) -> Result<()> {
        let now = Instant::now();
        if self.fsync.due(now, pause) {
            self.sync_data(now)?;
        }
        Ok(())
    }

    fn purge(&mut self, _wall_time: f64, from: f64) -> Result<u64> {
        self.write_pending()?;
        self.rewrite_without(from)
    }

    fn verify(&mut self) -> Result<()> {
        append::live_len(&self.file, &self.path).map(|_| ())
    }

    fn close(&mut self) -> Result<()> {
        self.write_pending()?;
        self.verify()?;
        if self.fsync.at_close() {
            self.sync_data(Instant::now())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::writer::SinkHandle;

    /// (iteration, scalars, expected line).
    type MetricsCase = (i64, &'static [(&'static str, f64)], &'static str);

    const METRICS_CASES: &[MetricsCase] = &[
        (19, &[("loss", 1e-05), ("data_time", 0.5)], "{\"data_time\": 0.5, \"iteration\": 19, \"loss\": 1e-05}\n"),
        (0, &[], "{\"iteration\": 0}\n"),
        (7, &[("iteration", 3.5), ("lr", 0.02)], "{\"iteration\": 7, \"lr\": 0.02}\n"),
        (7, &[("lr", 0.02), ("iteration", 3.5)], "{\"iteration\": 7, \"lr\": 0.02}\n"),
        (-1, &[("b", 1.0), ("a", 2.0), ("b", 3.0)], "{\"a\": 2.0, \"b\": 3.0, \"iteration\": -1}\n"),
        (5, &[("Z", 1.0), ("a", 2.0), ("_x", 3.0), ("\u{e4}", 4.0), ("\u{1f600}", 5.0), ("\u{ffff}", 6.0), ("\u{e9}", 7.0), ("iter", 8.0), ("iterations", 9.0)], "{\"Z\": 1.0, \"_x\": 3.0, \"a\": 2.0, \"iter\": 8.0, \"iteration\": 5, \"iterations\": 9.0, \"\\u00e4\": 4.0, \"\\u00e9\": 7.0, \"\\uffff\": 6.0, \"\\ud83d\\ude00\": 5.0}\n"),
        (123456789012, &[("loss/total", 0.30000000000000004), ("time", 1e+16), ("eta", 123456789.0), ("x", f64::NAN), ("y", f64::INFINITY), ("z", f64::NEG_INFINITY), ("neg", -0.0)], "{\"eta\": 123456789.0, \"iteration\": 123456789012, \"loss/total\": 0.30000000000000004, \"neg\": -0.0, \"time\": 1e+16, \"x\": NaN, \"y\": Infinity, \"z\": -Infinity}\n"),
    ];

    #[test]
    fn metrics_line_matches_python() {
        for &(iteration, scalars, want) in METRICS_CASES {
            assert_eq!(
                json_metrics_line(crate::iter::Iter::Int(iteration), scalars),
                want
            );
        }
        let line = json_metrics_line(crate::iter::Iter::Float(2.5), &[("a", 1.0)]);
        assert_eq!(line, "{\"a\": 1.0, \"iteration\": 2.5}\n");
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hookloop-{name}-{}", std::process::id()));
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
        let _serial = crate::writer::test_serial();
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
    fn json_sink_keeps_every_line_of_at_most_a_page_inside_its_page() {
        let path = tmpdir("pages").join("metrics.json");
        std::fs::write(&path, "{\"iteration\": -1}\n").unwrap();
        let mut sink = JsonSink::open(&path, FsyncPolicy::Never).unwrap();
        let mut want = vec![-1];
        for i in 0..200i64 {
            // 1 to 3 rows per batch, lines of ~40 B to ~4 KiB.
            let rows: Vec<JsonRow> = (0..1 + i % 3)
                .map(|k| {
                    let iter = i * 3 + k;
                    want.push(iter);
                    let names: Vec<String> =
                        (0..(iter * 37) % 300).map(|n| format!("m{n:03}")).collect();
                    let scalars: Vec<(&str, f64)> =
                        names.iter().map(|n| (n.as_str(), 0.5)).collect();
                    row(iter, &scalars)
                })
                .collect();
            sink.write(Payload::Json(rows)).unwrap();
            sink.sync().unwrap();
        }
        sink.close().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let mut start = 0;
        let mut got = Vec::new();
        for line in bytes.split_inclusive(|&b| b == b'\n') {
            let end = start + line.len();
            assert!(line.len() <= append::PAGE);
            assert_eq!(start / 4096, (end - 1) / 4096, "line {start}..{end}");
            let text = std::str::from_utf8(line).unwrap();
            got.push(line_iteration(text.trim_end()).unwrap() as i64);
            start = end;
        }
        assert_eq!(got, want);
        assert!(bytes.windows(2).any(|w| w == b" \n"), "no line was padded");
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
    fn open_keeps_a_whole_object_without_newline_and_refuses_what_is_not_json_lines() {
        let dir = tmpdir("open-check");
        // A complete one-line file without its final newline is kept, and appended after.
        let path = dir.join("one.json");
        std::fs::write(&path, "{\"iteration\": 1, \"a\": NaN}").unwrap();
        let mut sink = JsonSink::open(&path, FsyncPolicy::Never).unwrap();
        sink.write(Payload::Json(vec![row(2, &[])])).unwrap();
        sink.sync().unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"iteration\": 1, \"a\": NaN}\n{\"iteration\": 2}\n"
        );
        // Not JSON lines: refused, and the file is left as it was.
        for (name, content) in [
            (
                "binary.json",
                b"\x89PNG\r\n\x1a\n\x00\x00binary\x00tail".to_vec(),
            ),
            ("text.json", b"hello\nworld\n".to_vec()),
            ("notail.json", b"{\"iteration\": 1}\nnot json".to_vec()),
            ("array.json", b"[1, 2, 3]".to_vec()),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, &content).unwrap();
            let err = JsonSink::open(&path, FsyncPolicy::Never).err().unwrap();
            assert!(matches!(err, Error::BadValue { .. }), "{name}: {err}");
            assert!(
                err.to_string().contains("is not a JSON-lines file"),
                "{err}"
            );
            assert!(err.to_string().contains(name), "{err}");
            assert_eq!(std::fs::read(&path).unwrap(), content, "{name}");
        }
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
        let _serial = crate::writer::test_serial();
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
            needs_newline: false,
            fsync: Durability::new(FsyncPolicy::Never),
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
    fn grouping_keeps_first_appearance_order() {
        let s = |name: &str, value, iter| SmoothedScalar {
            name: name.into(),
            value,
            iter: Iter::Int(iter),
        };
        let rows = group_by_iteration(vec![s("a", 1.0, 5), s("b", 2.0, 4), s("c", 3.0, 5)]);
        assert_eq!(
            rows,
            vec![row(5, &[("a", 1.0), ("c", 3.0)]), row(4, &[("b", 2.0)])]
        );
    }

    #[test]
    fn smoothed_since_skips_written_iterations_and_advances() {
        let mut st = crate::storage::Storage::new(0, 100, 1).unwrap();
        st.put_scalar("a", 1.0, false, Some(Iter::Int(5))).unwrap();
        st.put_scalar("b", 2.0, false, Some(Iter::Int(4))).unwrap();
        let mut last = -1.0;
        assert_eq!(st.smoothed_since(20, &mut last).unwrap().len(), 2);
        assert_eq!(last, 5.0);
        st.put_scalar("b", 2.0, false, Some(Iter::Int(6))).unwrap();
        let again = st.smoothed_since(20, &mut last).unwrap();
        assert_eq!(again.iter().map(|s| &*s.name).collect::<Vec<_>>(), ["b"]);
        assert_eq!(last, 6.0);
    }

    #[test]
    fn purge_drops_iterations_from_a_resume_point_atomically() {
        let _serial = crate::writer::test_serial();
        let path = tmpdir("purge").join("metrics.json");
        std::fs::write(
            &path,
            "{\"iteration\": 1, \"a\": 1.0}\n{\"iteration\": 5}\n{\"x\": 1}\n{\"iteration\": 9}\n",
        )
        .unwrap();
        let sink = JsonSink::open(&path, FsyncPolicy::Never).unwrap();
        let mut h = SinkHandle::open(Box::new(sink), "JSONWriter", path.clone()).unwrap();
        assert_eq!(h.purge(0.0, 5.0).unwrap(), 2);
        h.send(Payload::Json(vec![row(5, &[("a", 2.0)])])).unwrap();
        h.close().unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"iteration\": 1, \"a\": 1.0}\n{\"x\": 1}\n{\"a\": 2.0, \"iteration\": 5}\n"
        );
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("purge"))
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn line_iteration_reads_ints_and_floats() {
        assert_eq!(
            line_iteration("{\"iteration\": 7, \"loss\": NaN}"),
            Some(7.0)
        );
        assert_eq!(
            line_iteration("{\"a\": -Infinity, \"iteration\": 3}"),
            Some(3.0)
        );
        assert_eq!(
            line_iteration("{\"iteration\": 7, \"loss\": 1.5}"),
            Some(7.0)
        );
        assert_eq!(line_iteration("{\"iteration\": 2.5}"), Some(2.5));
        assert_eq!(line_iteration("garbage"), None);
    }
}
