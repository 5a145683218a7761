//! The one error type of the core crate. Variants carry data, not prose; the binding crate maps
//! each variant to a Python exception class in one place (`hookloop-py/src/errors.rs`).

use std::path::PathBuf;

/// Everything the core can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A metric name that was never put. Mapped to `KeyError`, with detectron2's message.
    #[error("No history metric available for {0}!")]
    UnknownMetric(String),

    /// A scalar put again with the other smoothing hint. Mapped to `ValueError`.
    #[error("smoothing_hint for '{name}' changed from {old} to {new} at iter {iter}")]
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

    /// An image that is not CHW/HW with 1, 3 or 4 channels. Mapped to `ValueError`.
    #[error("image '{tag}': {reason}")]
    BadImage { tag: String, reason: String },

    /// A writer used after `close()`. Mapped to `ValueError` (as a closed Python file).
    #[error("{writer} for '{path}' is closed", path = path.display())]
    Closed { writer: &'static str, path: PathBuf },

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

    /// A schedule evaluated outside the progress range it is defined on. Mapped to
    /// `RuntimeError`, as fvcore raises.
    #[error("where in {what} must be in {range}: got {}", crate::schedule::Repr(*.where_))]
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

    /// `LRMultiplier` state saved with another `max_iter`. Mapped to `ValueError`.
    #[error(
        "LRMultiplier: the checkpoint was saved with max_iter={saved}, but this scheduler has \
         max_iter={current} (resuming at iteration {iter}). The schedule is a function of \
         iter / max_iter, so resuming would change the LR at every remaining iteration. To \
         extend the schedule, build the ParamScheduler for the new length (milestones, \
         num_updates and warmup_length in units of the new max_iter), then drop the old \
         length from the state before loading it: `state.pop(\"_max_iter\")`"
    )]
    MaxIterChanged { saved: i64, current: i64, iter: i64 },
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
}
