//! Python's exact results, reproduced bit for bit: how CPython formats floats, JSON strings
//! and timedeltas (`format`), and how CPython and numpy add floats (`sum`). detectron2's output
//! is these functions' output, so hookloop's must be theirs to the last digit and bit.
//!
//! Depends on no other module of the crate (its errors are the callers' to spell), so every
//! layer, the error messages included, can use it.

mod format;
mod sum;

pub use format::{
    format_f, format_g, push_f, push_g, timedelta_str, write_json_str, write_repr_f64, Repr,
};
pub use sum::{pairwise_sum, py_sum, python_sum, SumMode};
