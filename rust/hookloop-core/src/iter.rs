//! The iteration number as callers give it, and the one rule for which integers hookloop
//! takes as iterations. A leaf: names no other module of the crate.

use std::fmt;

/// An iteration number as the caller gave it: detectron2 passes ints, fvcore's API allows floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Iter {
    Int(i64),
    Float(f64),
}

/// The largest iteration magnitude hookloop takes: histories keep iterations as `f64`, exact
/// up to 2**53, so a larger int would read back rounded from `history()` but not `latest()`.
pub const MAX_EXACT_ITER: i64 = 1 << 53;

/// The range [`exact_iter`] allows, as error messages name it.
pub const EXACT_ITER_RANGE: &str = "±2**53, where iterations stay exact as floats";

/// An integer iteration beyond [`MAX_EXACT_ITER`]: `what` names it. The crate's `Error`
/// converts it (`OutOfRange`), which is where its message is spelled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InexactIter {
    pub what: String,
    pub value: i64,
}

/// Checks that the iteration `value` is within ±2**53 (see [`MAX_EXACT_ITER`]); the one
/// place that rule lives.
pub fn exact_iter(what: &str, value: i64) -> Result<i64, InexactIter> {
    if value.unsigned_abs() > MAX_EXACT_ITER.unsigned_abs() {
        return Err(InexactIter {
            what: what.to_owned(),
            value,
        });
    }
    Ok(value)
}

impl Iter {
    /// The value used for arithmetic and comparisons.
    pub fn as_f64(self) -> f64 {
        match self {
            Iter::Int(i) => i as f64,
            Iter::Float(f) => f,
        }
    }
}

impl fmt::Display for Iter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Iter::Int(i) => write!(f, "{i}"),
            Iter::Float(x) => write!(f, "{x:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_iter_allows_two_to_the_53_either_way() {
        assert_eq!(exact_iter("it", MAX_EXACT_ITER), Ok(MAX_EXACT_ITER));
        assert_eq!(exact_iter("it", -MAX_EXACT_ITER), Ok(-MAX_EXACT_ITER));
        let err = exact_iter("it", MAX_EXACT_ITER + 1).unwrap_err();
        assert_eq!(err.what, "it");
        assert_eq!(err.value, MAX_EXACT_ITER + 1);
        assert!(exact_iter("it", i64::MIN).is_err());
    }

    #[test]
    fn display_is_pythons_str() {
        assert_eq!(Iter::Int(3).to_string(), "3");
        assert_eq!(Iter::Float(2.5).to_string(), "2.5");
        assert_eq!(Iter::Float(2.0).to_string(), "2.0");
    }
}
