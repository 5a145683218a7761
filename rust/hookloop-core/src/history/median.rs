//! The windowed median: numpy's `median` of a history's last values, by selection on
//! order-preserving integer keys, and a sorted copy of a window kept up to date from the
//! updates (`SortedWindow`) for the medians asked for at every write.

use std::collections::VecDeque;

/// The order keys ([`order_key`]) of the values of a history's last `window` entries, sorted,
/// as they were when the history had had `synced` updates; NaNs have no key and are counted.
/// [`SortedWindow::sync`] brings it up to date from the updates since (each key in place, or one
/// merge pass), so that a median asked for at every write (the printer's ETA over the last
/// 1,000 iteration times; at period 1, the smoothing window of every loss) costs neither a
/// selection over the whole window, whose memory is cold by then, nor anything on the updates
/// in between.
#[derive(Debug, Clone, Default)]
pub(super) struct SortedWindow {
    pub(super) window: usize,
    pub(super) keys: Vec<u64>,
    pub(super) nan: usize,
    /// The update count when `keys` was last brought up to date.
    pub(super) synced: u64,
    /// The index (counting every update ever made) of the first value in `keys`.
    pub(super) start: u64,
    /// The merge's output buffer, kept to avoid an allocation per sync.
    pub(super) spare: Vec<u64>,
}

/// Up to this many keys leaving and entering together are moved one at a time (binary search,
/// shift); more take one merge pass.
pub(super) const IN_PLACE_KEYS: u64 = 4;

impl SortedWindow {
    /// Brings the copy up to the last `window` of `values` (a history's ring after `count`
    /// updates): from what left and entered the window since the last sync when those are
    /// still held and fewer than half the copy, or made anew (reusing its buffer).
    pub(super) fn sync(&mut self, values: &VecDeque<f64>, count: u64, window: usize) {
        let len = values.len() as u64;
        let first = count - len; // the index of the oldest value held
        let start = count - (window as u64).min(len); // of the window's first value
        let value = |i: u64| values[(i - first) as usize];
        let tracked = self.window == window
            && self.synced > 0
            && self.start >= first
            && count - self.synced <= self.keys.len() as u64 / 2;
        if tracked {
            // Left: [self.start, left_end) of those in the copy; entered: since the last sync.
            let left_end = start.min(self.synced);
            let entered = self.synced.max(start);
            if (left_end - self.start) + (count - entered) <= IN_PLACE_KEYS {
                for v in (self.start..left_end).map(value) {
                    self.remove(v);
                }
                for v in (entered..count).map(value) {
                    self.insert(v);
                }
            } else {
                let (leaving, nan_out) = Self::keys_of((self.start..left_end).map(value));
                let (entering, nan_in) = Self::keys_of((entered..count).map(value));
                self.merge(&leaving, &entering);
                self.nan = self.nan + nan_in - nan_out;
            }
        } else {
            self.keys.clear();
            self.nan = 0;
            for v in (start..count).map(value) {
                if v.is_nan() {
                    self.nan += 1;
                } else {
                    self.keys.push(order_key(v));
                }
            }
            self.keys.sort_unstable();
            self.window = window;
        }
        self.synced = count;
        self.start = start;
    }

    pub(super) fn remove(&mut self, v: f64) {
        if v.is_nan() {
            self.nan -= 1;
        } else if let Ok(at) = self.keys.binary_search(&order_key(v)) {
            self.keys.remove(at);
        }
    }

    pub(super) fn insert(&mut self, v: f64) {
        if v.is_nan() {
            self.nan += 1;
        } else {
            let k = order_key(v);
            let at = self.keys.partition_point(|&x| x < k);
            self.keys.insert(at, k);
        }
    }

    /// The keys of `values`, sorted, and how many of them are NaN.
    pub(super) fn keys_of(values: impl Iterator<Item = f64>) -> (Vec<u64>, usize) {
        let mut nan = 0;
        let mut keys: Vec<u64> = values
            .filter(|v| {
                nan += usize::from(v.is_nan());
                !v.is_nan()
            })
            .map(order_key)
            .collect();
        keys.sort_unstable();
        (keys, nan)
    }

    /// `keys` without one of each key in `leaving` and with those of `entering` (all three
    /// sorted), in one merge pass.
    pub(super) fn merge(&mut self, leaving: &[u64], entering: &[u64]) {
        let out = &mut self.spare;
        out.clear();
        out.reserve(self.keys.len() + entering.len());
        let (mut l, mut e) = (0, 0);
        for &k in &self.keys {
            if l < leaving.len() && leaving[l] == k {
                l += 1;
                continue;
            }
            while e < entering.len() && entering[e] < k {
                out.push(entering[e]);
                e += 1;
            }
            out.push(k);
        }
        out.extend_from_slice(&entering[e..]);
        std::mem::swap(&mut self.keys, &mut self.spare);
    }

    /// As [`median_of`] over the window's values.
    pub(super) fn median(&self) -> f64 {
        let n = self.keys.len();
        if self.nan > 0 || n == 0 {
            return f64::NAN;
        }
        let upper = from_order_key(self.keys[n / 2]);
        if n % 2 == 1 {
            0.0 + upper
        } else {
            (0.0 + (from_order_key(self.keys[n / 2 - 1]) + upper)) / 2.0
        }
    }
}

/// An order-preserving integer key of a non-NaN float (-0.0 sorts just below +0.0): selecting
/// on integers is several times faster than on floats with `total_cmp`.
pub(super) fn order_key(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | 1 << 63
    }
}

pub(super) fn from_order_key(k: u64) -> f64 {
    f64::from_bits(if k >> 63 == 1 { k & !(1 << 63) } else { !k })
}

/// `numpy.median` of `a` followed by `b`: NaN if any value is NaN or there are none.
pub fn median_of(a: &[f64], b: &[f64]) -> f64 {
    // The writers' windows (20 by default) fit on the stack: no allocation per median.
    const ON_STACK: usize = 64;
    let n = a.len() + b.len();
    if n <= ON_STACK {
        let mut keys = [0u64; ON_STACK];
        median_in(a, b, &mut keys[..n])
    } else {
        median_in(a, b, &mut vec![0u64; n])
    }
}

/// [`median_of`] with `keys` (as long as `a` and `b` together) as its scratch space.
fn median_in(a: &[f64], b: &[f64], keys: &mut [u64]) -> f64 {
    for (k, &v) in keys.iter_mut().zip(a.iter().chain(b)) {
        if v.is_nan() {
            return f64::NAN;
        }
        *k = order_key(v);
    }
    let n = keys.len();
    if n == 0 {
        return f64::NAN;
    }
    let mid = n / 2;
    let (lower, upper, _) = keys.select_nth_unstable(mid);
    let upper = from_order_key(*upper);
    // numpy takes the mean of the middle value(s), and its sum starts from +0.0: so the
    // median of [-0.0] is 0.0, and of two middle values a, b it is (0 + (a + b)) / 2.
    if n % 2 == 1 {
        0.0 + upper
    } else {
        let below = lower.iter().copied().max().map_or(upper, from_order_key);
        (0.0 + (below + upper)) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_on_the_stack_and_on_the_heap_equals_a_sorted_median() {
        // 64 values fit the stack buffer, 65 do not: both sides of it, split over a and b.
        let sorted_median = |v: &[f64]| {
            let mut s = v.to_vec();
            s.sort_by(f64::total_cmp);
            let n = s.len();
            if n % 2 == 1 {
                s[n / 2]
            } else {
                (s[n / 2 - 1] + s[n / 2]) / 2.0
            }
        };
        for n in [1usize, 2, 20, 63, 64, 65, 200] {
            let v: Vec<f64> = (0..n).map(|i| ((i * 37) % 101) as f64 - 50.5).collect();
            let (a, b) = v.split_at(n / 3);
            assert_eq!(median_of(a, b), sorted_median(&v), "n = {n}");
            let mut with_nan = v.clone();
            with_nan[n - 1] = f64::NAN;
            let (a, b) = with_nan.split_at(n / 3);
            assert!(median_of(a, b).is_nan(), "n = {n}");
        }
        assert!(median_of(&[], &[]).is_nan());
    }

    #[test]
    fn order_keys_sort_like_total_cmp() {
        let mut xs = [
            3.5,
            -0.0,
            0.0,
            -1e300,
            f64::INFINITY,
            f64::NEG_INFINITY,
            5e-324,
            -2.0,
        ];
        let mut keys: Vec<u64> = xs.iter().map(|&x| order_key(x)).collect();
        keys.sort_unstable();
        xs.sort_by(f64::total_cmp);
        let back: Vec<u64> = keys.iter().map(|&k| from_order_key(k).to_bits()).collect();
        assert_eq!(back, xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    }
}
