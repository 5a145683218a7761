//! Python's and numpy's float sums, step for step: a sum that adds in another order or
//! with another start rounds differently, and the value it feeds (a total loss, a schedule's
//! spans, a window's mean) would differ from detectron2's in the last bit.

/// How `sum(list_of_floats)` adds: CPython changed its float fast path in 3.12.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumMode {
    /// CPython up to 3.11: a left fold from 0.
    Naive,
    /// CPython 3.12 and later: Neumaier's compensated summation (gh-100425).
    Neumaier,
}

impl SumMode {
    /// The mode of CPython `3.minor`.
    pub fn for_python_minor(minor: u8) -> Self {
        if minor >= 12 {
            SumMode::Neumaier
        } else {
            SumMode::Naive
        }
    }
}

/// Python's `sum(values)` over floats, as the given CPython computes it.
pub fn py_sum(values: &[f64], mode: SumMode) -> f64 {
    // `sum` starts from the int 0; 0 + x is x except that -0.0 becomes 0.0.
    let mut total = 0.0_f64;
    match mode {
        SumMode::Naive => {
            for &x in values {
                total += x;
            }
            total
        }
        SumMode::Neumaier => {
            let mut c = 0.0_f64;
            for &x in values {
                let t = total + x;
                if total.abs() >= x.abs() {
                    c += (total - t) + x;
                } else {
                    c += (x - t) + total;
                }
                total = t;
            }
            // CPython: keep the sign of a negative sum; never turn inf/overflow into NaN.
            if c != 0.0 && c.is_finite() {
                total += c;
            }
            total
        }
    }
}

/// Python's `sum()` of floats: it starts from the int 0, and `0 + x == x` for every float but
/// -0.0, which `0.0 + x` turns into 0.0 exactly as `0 + x` does.
pub fn python_sum(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |acc, v| acc + v)
}

/// numpy's pairwise summation (`pairwise_sum` in loops_utils.h): exact blocks of 8 accumulators
/// up to 128 elements, halves above. Reproducing it makes `avg` equal `numpy.mean` to the bit.
pub fn pairwise_sum(a: &[f64]) -> f64 {
    let n = a.len();
    if n < 8 {
        let mut res = -0.0;
        for &x in a {
            res += x;
        }
        res
    } else if n <= 128 {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&a[..8]);
        let full = n - n % 8;
        let mut i = 8;
        while i < full {
            for j in 0..8 {
                r[j] += a[i + j];
            }
            i += 8;
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &x in &a[full..] {
            res += x;
        }
        res
    } else {
        let mut n2 = n / 2;
        n2 -= n2 % 8;
        pairwise_sum(&a[..n2]) + pairwise_sum(&a[n2..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits_eq(a: f64, b: f64) {
        assert_eq!(a.to_bits(), b.to_bits(), "{a:?} != {b:?}");
    }

    #[test]
    fn py_sum_modes() {
        let v = [0.1, 0.2, 0.3];
        bits_eq(py_sum(&v, SumMode::Naive), 0.1 + 0.2 + 0.3);
        // CPython 3.12: sum([0.1, 0.2, 0.3]) == 0.6
        bits_eq(py_sum(&v, SumMode::Neumaier), 0.6);
        bits_eq(py_sum(&[], SumMode::Neumaier), 0.0);
        bits_eq(py_sum(&[-0.0], SumMode::Naive), 0.0);
        assert_eq!(SumMode::for_python_minor(11), SumMode::Naive);
        assert_eq!(SumMode::for_python_minor(13), SumMode::Neumaier);
    }

    #[test]
    fn negative_zero_total_is_python_sum() {
        assert_eq!(python_sum([-0.0].into_iter()).to_bits(), 0.0f64.to_bits());
    }
}
