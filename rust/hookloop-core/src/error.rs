//! The one error type of the core crate. Variants carry data, not prose; the binding crate maps
//! each variant to a Python exception class in one place (`hookloop-py/src/errors.rs`).

use std::path::PathBuf;

use crate::iter::{InexactIter, Iter, EXACT_ITER_RANGE};
use crate::record::BucketMismatch;

/// Everything the core can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A metric name that was never put. Mapped to `KeyError`, with detectron2's message.
    #[error("No history metric available for {0}!")]
    UnknownMetric(String),

    /// A scalar put again with the other smoothing hint. Mapped to `ValueError`.
    #[error("smoothing_hint for '{name}' changed from {} to {} at iter {iter}", py_bool(*old), py_bool(*new))]
    HintChanged {
        name: String,
        old: bool,
        new: bool,
        iter: String,
    },

    /// A window (samples or iterations) that is not a positive integer. Mapped to `ValueError`.
    #[error("window_size must be a positive integer, got {0}")]
    BadWindow(i64),

    /// A history length that is not a positive integer. Mapped to `ValueError`.
    #[error("max_length must be a positive integer, got {0}")]
    BadMaxLength(i64),

    /// `latest()` on a history that holds nothing yet. Mapped to `IndexError`, as fvcore's
    /// list indexing raises.
    #[error("latest() called on an empty HistoryBuffer")]
    EmptyHistory,

    /// An argument of the wrong type. Mapped to `TypeError`.
    #[error("{what} must be {expected}, got {got}")]
    WrongType {
        what: String,
        expected: &'static str,
        got: String,
    },

    /// An argument of the right type with a bad value. Mapped to `ValueError`.
    #[error("{what} {reason}")]
    BadValue { what: String, reason: String },

    /// A number outside what hookloop can represent (iterations beyond int64, say). Mapped to
    /// `OverflowError`.
    #[error("{what} is out of range: {value} (must be within {range})")]
    OutOfRange {
        what: String,
        value: String,
        range: &'static str,
    },

    /// A saved state (pickle, checkpoint) that does not describe a valid object. Mapped to
    /// `ValueError`.
    #[error("cannot restore {what}: {reason}")]
    BadState { what: &'static str, reason: String },

    /// An image that cannot be encoded. `step` is known once the image is queued. Mapped to
    /// `ValueError`.
    #[error("image '{tag}'{}: {source}", step.map(|s| format!(" at iter {s}")).unwrap_or_default())]
    Image {
        tag: String,
        step: Option<i64>,
        source: ImageError,
    },

    /// The total loss of an iteration is NaN or infinite. Mapped to `FloatingPointError` with
    /// detectron2's message (the losses formatted as the Python dict they were).
    #[error("Loss became infinite or NaN at iteration={iter}!")]
    NonFiniteLoss {
        iter: Iter,
        losses: Vec<(String, f64)>,
    },

    /// An object that cannot be pickled or copied, and why. Mapped to `TypeError` (what
    /// pickle raises for unpicklable objects).
    #[error("a {what} cannot be pickled or copied: {why}")]
    NotPicklable {
        what: &'static str,
        why: &'static str,
    },

    /// A writer used after `close()`. Mapped to `ValueError` (as a closed Python file).
    #[error("{writer} for '{path}' is closed", path = path.display())]
    Closed { writer: &'static str, path: PathBuf },

    /// A writer used from a forked child of the process that opened it: the child has no
    /// writer thread, and the file belongs to the parent. Mapped to `OSError`.
    #[error("this {writer} for '{path}' was opened in process {owner}; a forked child (process {pid}) cannot use it", path = path.display())]
    ForkedChild {
        writer: &'static str,
        path: PathBuf,
        owner: u32,
        pid: u32,
    },

    /// A sink panicked on the writer thread (a bug in hookloop); the writer is unusable.
    /// Mapped to `OSError` naming the path, so training code that handles I/O errors sees it.
    #[error("hookloop's writer thread failed on '{path}': {message}", path = path.display())]
    WriterPanicked { path: PathBuf, message: String },

    /// A write failed part-way (disk full, quota): the first `total - dropped` lines or
    /// records are in the file, the other `dropped` are not. Mapped to `OSError` with the errno
    /// and the path.
    #[error("{source} ({dropped} of {total} {unit} not written): '{path}'", path = path.display())]
    WriteDropped {
        path: PathBuf,
        source: std::io::Error,
        dropped: usize,
        total: usize,
        unit: &'static str,
    },

    /// An open output file no longer exists at its path (deleted, or its directory removed):
    /// what is written to it is lost. Mapped to `OSError` (`ENOENT`) naming the path.
    #[error("'{path}' was deleted (or its directory removed) while open; nothing written to it since is kept", path = path.display())]
    Deleted { path: PathBuf },

    /// The writer thread did not finish within the writer timeout because a file blocks (a
    /// hung network mount, a FIFO nobody reads). Mapped to `OSError` (`ETIMEDOUT`).
    #[error("hookloop's writer thread is blocked writing '{path}' (waited {seconds} s; \
             HOOKLOOP_WRITER_TIMEOUT sets the wait)", path = path.display())]
    Blocked { path: PathBuf, seconds: f64 },

    /// File I/O failed. Mapped to `OSError` with the errno and the path.
    #[error("{source}: '{path}'", path = path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    /// A parameter schedule built with a bad argument, or evaluated where Python would raise.
    /// `reason` names the argument. Mapped to `ValueError`.
    #[error("{what}: {reason}")]
    BadSchedule { what: &'static str, reason: String },

    /// A schedule argument fvcore refuses, with fvcore's own message (user code matches on
    /// it). Mapped to `ValueError`.
    #[error("{reason}")]
    BadScheduleArg { what: &'static str, reason: String },

    /// A step schedule evaluated at or past its end (`where >= 1`), where fvcore's list
    /// indexing raises. Mapped to `IndexError`, with Python's message.
    #[error("list index out of range")]
    StepPastEnd { what: &'static str, where_: f64 },

    /// A schedule evaluated outside the progress range it is defined on. Mapped to
    /// `RuntimeError`, as fvcore raises.
    #[error("where in {what} must be in {range}: got {}", crate::pyexact::Repr(*.where_))]
    WhereOutOfRange {
        what: &'static str,
        range: &'static str,
        where_: f64,
    },

    /// `LRMultiplier` stepped past the end of its schedule (or before its start). Mapped to
    /// `ValueError`.
    #[error(
        "LRMultiplier: iteration {iter} is outside the schedule's [0, max_iter={max_iter}] \
         (where = {iter} / {max_iter} must be in [0, 1]). The schedule ends at max_iter; to \
         train longer, build the LRMultiplier and its ParamScheduler for the new max_iter"
    )]
    IterOutOfRange { iter: i64, max_iter: i64 },
}

/// Why an image cannot be encoded as PNG.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Not a 3-d `(C, H, W)` shape.
    #[error("expected a (C, H, W) image, got shape {shape:?}")]
    NotChw { shape: Vec<i64> },
    /// `channels` is not 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA).
    #[error(
        "image has {channels} channels; expected 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA)"
    )]
    UnsupportedChannels { channels: u64 },
    /// Width or height is zero: PNG has no empty images.
    #[error("image is {width}x{height}; width and height must be positive")]
    Empty { width: u64, height: u64 },
    /// Width or height exceeds `i32::MAX`, the limit of both PNG and the `Image` message.
    #[error(
        "image is {width}x{height}; width and height must be at most {}",
        i32::MAX
    )]
    TooLarge { width: u64, height: u64 },
    /// The pixel buffer does not hold `width * height * channels` bytes.
    #[error("image of {width}x{height}x{channels} needs {} bytes of HWC uint8 pixels, got {len}", u128::from(*width) * u128::from(*height) * u128::from(*channels))]
    PixelCountMismatch {
        width: u64,
        height: u64,
        channels: u64,
        len: usize,
    },
    /// The PNG encoder failed.
    #[error("PNG encoding failed: {0}")]
    Png(String),
}

impl From<png::EncodingError> for ImageError {
    fn from(e: png::EncodingError) -> Self {
        ImageError::Png(e.to_string())
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// Shorthand used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// A `BadValue` for `what`.
    pub fn bad_value(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::BadValue {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// A `WrongType` for `what`.
    pub fn wrong_type(
        what: impl Into<String>,
        expected: &'static str,
        got: impl Into<String>,
    ) -> Self {
        Error::WrongType {
            what: what.into(),
            expected,
            got: got.into(),
        }
    }
}

impl From<InexactIter> for Error {
    fn from(e: InexactIter) -> Self {
        Error::OutOfRange {
            what: e.what,
            value: e.value.to_string(),
            range: EXACT_ITER_RANGE,
        }
    }
}

impl From<BucketMismatch> for Error {
    fn from(e: BucketMismatch) -> Self {
        Error::bad_value(
            format!("histogram '{}'", e.tag),
            format!(
                "has {} bucket limits but {} bucket counts",
                e.limits, e.counts
            ),
        )
    }
}

/// Checks that `value` is a positive integer (window sizes, lengths, periods, bounds) and
/// returns it as a `usize`; the one place that rule lives.
pub fn positive(what: &str, value: i64) -> Result<usize> {
    if value <= 0 {
        return Err(Error::bad_value(
            what,
            format!("must be a positive integer, got {value}"),
        ));
    }
    usize::try_from(value).map_err(|_| Error::OutOfRange {
        what: what.to_owned(),
        value: value.to_string(),
        range: "the platform's usize",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_are_spelled_as_python_bools() {
        let e = Error::HintChanged {
            name: "loss".into(),
            old: true,
            new: false,
            iter: "120".into(),
        };
        assert_eq!(
            e.to_string(),
            "smoothing_hint for 'loss' changed from True to False at iter 120"
        );
    }

    #[test]
    fn image_errors_name_the_image_and_step() {
        let e = Error::Image {
            tag: "img".into(),
            step: Some(7),
            source: ImageError::UnsupportedChannels { channels: 5 },
        };
        assert_eq!(
            e.to_string(),
            "image 'img' at iter 7: image has 5 channels; expected 1 (grey), 2 (grey + alpha), \
             3 (RGB) or 4 (RGBA)"
        );
    }

    #[test]
    fn positive_rule() {
        assert_eq!(positive("window_size", 3).unwrap(), 3);
        assert_eq!(
            positive("window_size", 0).unwrap_err().to_string(),
            "window_size must be a positive integer, got 0"
        );
    }

    #[test]
    fn errors_cross_threads() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Error>();
    }
}
