//! Iterations stored as arithmetic runs: a metric put once per iteration, or once every N
//! iterations, is one run however long.

/// A run of iterations `first, first + step, ..., first + step * (len - 1)`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Run {
    pub(super) first: f64,
    pub(super) step: i32,
    pub(super) len: u32,
}

impl Run {
    pub(super) fn at(&self, k: u32) -> f64 {
        self.first + f64::from(self.step) * f64::from(k)
    }

    pub(super) fn last(&self) -> f64 {
        self.at(self.len - 1)
    }

    /// The smallest `k` such that the entries `k..len` are all above `threshold` (`len` when
    /// the last one is not): the entries a walk back from the run's end passes first.
    pub(super) fn first_above(&self, threshold: f64) -> u32 {
        if self.last() <= threshold {
            return self.len;
        }
        if self.step <= 0 {
            return 0; // non-increasing: every earlier entry is at least the last
        }
        // Increasing: estimate the first entry above the threshold, then settle it by the
        // entries themselves (the division may round either way).
        let estimate = ((threshold - self.first) / f64::from(self.step)).floor() + 1.0;
        let mut k = estimate.clamp(0.0, f64::from(self.len - 1)) as u32;
        while k > 0 && self.at(k - 1) > threshold {
            k -= 1;
        }
        while self.at(k) <= threshold {
            k += 1;
        }
        k
    }
}
