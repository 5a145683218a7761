//! `History`: the windowed scalar history behind fvcore's `HistoryBuffer`.
//!
//! Values live in a ring buffer (`VecDeque<f64>`, 8 bytes an entry) whose capacity never exceeds
//! `max_length`. Iterations are stored apart as arithmetic runs: a metric put once per iteration,
//! or once every N iterations, is one run however long, so the typical entry costs 8 bytes and the
//! worst case (every iteration irregular) 8 + 16 = 24 bytes.

use crate::iter::Iter;
use crate::pyexact::pairwise_sum;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

mod median;
mod runs;

pub use median::median_of;
use median::SortedWindow;
use runs::Run;

/// The last `max_length` (value, iteration) pairs of one metric, plus a running average over
/// every value ever added (evicted ones included).
#[derive(Debug, Clone)]
pub struct History {
    max_length: usize,
    values: VecDeque<f64>,
    runs: VecDeque<Run>,
    /// Number of updates ever made; the default iteration of the next update (as fvcore).
    count: u64,
    global_avg: f64,
    /// True while every iteration given was an integer: then iterations read back as ints.
    int_iterations: bool,
    /// The last values in order, for [`History::median_tracked`]; None until it is asked for.
    sorted: Option<Box<SortedWindow>>,
    /// The same for [`History::windowed_median`] (the writers' smoothing window, 20 by
    /// default), apart from `sorted`: the printer asks both of one history (`time`: the ETA's
    /// 1,000 and the smoothing's 20), and one copy following both would be rebuilt each time.
    /// A `RefCell`: reads take `&self`; no borrow of it outlives `windowed_median`. Both
    /// copies are boxed: a history that is never smoothed (most of a storage's) stays small.
    smoothing: RefCell<Option<Box<SortedWindow>>>,
    /// The last answer of [`History::windowed_median`]: (update count, window, median). The
    /// writers of one iteration (printer, JSON, TensorBoard) ask for the same median in turn;
    /// every change of the history is an update, which moves the count on.
    memo: Cell<Option<(u64, i64, f64)>>,
}

impl History {
    /// fvcore's default `max_length`.
    pub const DEFAULT_MAX_LENGTH: usize = 1_000_000;

    /// An empty history keeping at most `max_length` entries; `max_length` must be positive.
    pub fn new(max_length: usize) -> crate::Result<Self> {
        if max_length == 0 {
            return Err(crate::Error::BadMaxLength(0));
        }
        Ok(History {
            max_length,
            values: VecDeque::new(),
            runs: VecDeque::new(),
            count: 0,
            global_avg: 0.0,
            int_iterations: true,
            sorted: None,
            smoothing: RefCell::new(None),
            memo: Cell::new(None),
        })
    }

    /// Adds `value` at `iteration` (default: the number of updates so far, as fvcore), evicting
    /// the oldest entry when full. O(1) at any fill level.
    pub fn update(&mut self, value: f64, iteration: Option<Iter>) {
        let iteration = iteration.unwrap_or(Iter::Int(self.count as i64));
        if let Iter::Float(_) = iteration {
            self.int_iterations = false;
        }
        if self.values.len() == self.max_length {
            self.evict_oldest();
        }
        self.grow_if_full();
        self.values.push_back(value);
        self.push_iteration(iteration.as_f64());
        self.count += 1;
        // fvcore's running mean, kept bit-for-bit: global_avg += (v - global_avg) / count.
        self.global_avg += (value - self.global_avg) / self.count as f64;
    }

    /// Grows the ring by doubling, but never past `max_length`: a full history of the default
    /// length holds exactly 1e6 values, not 2^20.
    fn grow_if_full(&mut self) {
        let cap = self.values.capacity();
        if self.values.len() == cap {
            let target = (cap * 2).max(16).min(self.max_length);
            self.values.reserve_exact(target - self.values.len());
        }
    }

    fn evict_oldest(&mut self) {
        self.values.pop_front();
        if let Some(run) = self.runs.front_mut() {
            run.len -= 1;
            run.first += f64::from(run.step);
            if run.len == 0 {
                self.runs.pop_front();
            }
        }
    }

    fn push_iteration(&mut self, it: f64) {
        if let Some(run) = self.runs.back_mut() {
            if run.len == 1 {
                let delta = it - run.first;
                // Integral steps that fit i32 and reproduce `it` exactly start a run; anything
                // else (e.g. float iterations whose difference rounds) stays a run of one.
                if delta.fract() == 0.0
                    && delta.abs() <= f64::from(i32::MAX)
                    && run.first + delta == it
                {
                    run.step = delta as i32;
                    run.len = 2;
                    return;
                }
            } else if run.len < u32::MAX && run.at(run.len) == it {
                run.len += 1;
                return;
            }
        }
        self.runs.push_back(Run {
            first: it,
            step: 0,
            len: 1,
        });
    }

    /// The most recent value.
    pub fn latest(&self) -> crate::Result<f64> {
        self.values
            .back()
            .copied()
            .ok_or(crate::Error::EmptyHistory)
    }

    /// The most recent (value, iteration).
    pub fn latest_entry(&self) -> Option<(f64, Iter)> {
        let value = *self.values.back()?;
        let it = self.runs.back()?.last();
        Some((value, self.iter_of(it)))
    }

    fn iter_of(&self, it: f64) -> Iter {
        if self.int_iterations {
            Iter::Int(it as i64)
        } else {
            Iter::Float(it)
        }
    }

    /// The last `window_size` values as the ring's two contiguous parts (oldest first).
    fn window(&self, window_size: i64) -> crate::Result<(&[f64], &[f64])> {
        if window_size <= 0 {
            return Err(crate::Error::BadWindow(window_size));
        }
        let n = self.values.len();
        let k = usize::try_from(window_size).unwrap_or(usize::MAX).min(n);
        let (front, back) = self.values.as_slices();
        let start = n - k;
        Ok(if start >= front.len() {
            (&[][..], &back[start - front.len()..])
        } else {
            (&front[start..], back)
        })
    }

    /// The median of the last `window_size` values, equal to `numpy.median` (the mean of the
    /// two middle values for an even count; NaN if any value in the window is NaN or the
    /// history is empty).
    pub fn median(&self, window_size: i64) -> crate::Result<f64> {
        let (a, b) = self.window(window_size)?;
        Ok(median_of(a, b))
    }

    /// The median over the entries of the last `window_size` iterations (at least one entry):
    /// the value detectron2's writers and printer show for a smoothed scalar. Asked again
    /// before the next update, it is the answer kept from the first time.
    pub fn windowed_median(&self, window_size: i64) -> crate::Result<f64> {
        if window_size <= 0 {
            return Err(crate::Error::BadWindow(window_size));
        }
        if let Some(value) = self.newest_alone(window_size) {
            return Ok(value);
        }
        if let Some((count, window, median)) = self.memo.get() {
            if count == self.count && window == window_size {
                return Ok(median);
            }
        }
        // count_samples counts the newest entry itself, so it is >= 1 for a non-empty history.
        let samples = self.count_samples(window_size).max(1);
        let median = if samples <= Self::TRACKED_SMOOTHING {
            let mut sorted = self.smoothing.borrow_mut();
            let s = sorted.get_or_insert_with(Box::default);
            s.sync(&self.values, self.count, samples);
            s.median()
        } else {
            self.median(samples as i64)?
        };
        self.memo.set(Some((self.count, window_size, median)));
        Ok(median)
    }

    /// The newest value when it is the only sample within `window_size` iterations of itself
    /// (the entry before it is at or below `newest - window_size`): the median of one. An
    /// every-step writer's window of one iteration, and a metric put less often than its
    /// window (an evaluation), read it without counting samples or sorting.
    fn newest_alone(&self, window_size: i64) -> Option<f64> {
        let run = self.runs.back()?;
        let newest = run.last();
        let before = if run.len >= 2 {
            Some(run.at(run.len - 2))
        } else {
            self.runs.iter().rev().nth(1).map(Run::last)
        };
        match before {
            Some(b) if b > newest - window_size as f64 => None,
            // numpy's median is a mean, and its sum starts from +0.0: -0.0 reads as 0.0.
            _ => self.values.back().map(|v| 0.0 + v),
        }
    }

    /// The longest smoothing window [`History::windowed_median`] keeps a sorted copy of; a
    /// longer one is selected anew at each read, holding no second copy of its values.
    const TRACKED_SMOOTHING: usize = 4096;

    /// [`History::median`], from a sorted copy of the last `window_size` values that this
    /// call keeps: brought up to date from the values put since the last call (those that
    /// entered the window and those that left it), or made anew when that is not cheaper or
    /// the values that left were evicted. Updates cost nothing extra. The copy follows one
    /// window size, the one asked for last.
    pub fn median_tracked(&mut self, window_size: i64) -> crate::Result<f64> {
        if window_size <= 0 {
            return Err(crate::Error::BadWindow(window_size));
        }
        let window = usize::try_from(window_size)
            .unwrap_or(usize::MAX)
            .min(self.max_length);
        let s = self.sorted.get_or_insert_with(Box::default);
        s.sync(&self.values, self.count, window);
        Ok(s.median())
    }

    /// The mean of the last `window_size` values, bit-identical to `numpy.mean` (which sums
    /// pairwise, see `pairwise_sum`). NaN when empty.
    pub fn avg(&self, window_size: i64) -> crate::Result<f64> {
        let (a, b) = self.window(window_size)?;
        let k = a.len() + b.len();
        if k == 0 {
            return Ok(f64::NAN);
        }
        let sum = if b.is_empty() {
            pairwise_sum(a)
        } else if a.is_empty() {
            pairwise_sum(b)
        } else {
            // Wrapped ring: numpy sums one contiguous array, so make one.
            let joined: Vec<f64> = a.iter().chain(b).copied().collect();
            pairwise_sum(&joined)
        };
        Ok((0.0 + sum) / k as f64)
    }

    /// The average of every value ever added, evicted ones included.
    pub fn global_avg(&self) -> f64 {
        self.global_avg
    }

    /// Number of updates ever made (evicted ones included).
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Number of entries held now.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// True when nothing was ever added.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The configured maximum number of entries.
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// Whether every iteration so far was an integer.
    pub fn int_iterations(&self) -> bool {
        self.int_iterations
    }

    /// All (value, iteration) pairs held, oldest first.
    pub fn values(&self) -> Vec<(f64, Iter)> {
        let mut out = Vec::with_capacity(self.values.len());
        let mut vals = self.values.iter();
        for run in &self.runs {
            for k in 0..run.len {
                if let Some(&v) = vals.next() {
                    out.push((v, self.iter_of(run.at(k))));
                }
            }
        }
        out
    }

    /// How many of the most recent entries lie within the last `window_size` iterations,
    /// counted back from the newest entry's iteration (detectron2's `count_samples`: the window
    /// counts iterations, not samples).
    pub fn count_samples(&self, window_size: i64) -> usize {
        let Some(last) = self.runs.back().map(Run::last) else {
            return 0;
        };
        let threshold = last - window_size as f64;
        let mut samples = 0;
        for run in self.runs.iter().rev() {
            // Walking back from the newest entry, how many of this run's entries come before
            // the first one at or below the threshold; a run is arithmetic, so that is found
            // without visiting its entries.
            let within = run.len - run.first_above(threshold);
            samples += within as usize;
            if within < run.len {
                return samples;
            }
        }
        samples
    }

    /// Bytes of heap held by this history (values and runs), for memory accounting.
    pub fn heap_bytes(&self) -> usize {
        self.values.capacity() * std::mem::size_of::<f64>()
            + self.runs.capacity() * std::mem::size_of::<Run>()
    }
}

/// Everything a `History` holds, as plain data: what pickling and checkpoints save.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryState {
    pub max_length: usize,
    /// (value, iteration) pairs held, oldest first.
    pub entries: Vec<(f64, f64)>,
    pub count: u64,
    pub global_avg: f64,
    pub int_iterations: bool,
}

impl History {
    /// The state, keeping only the newest `keep` entries (all with `None`); the count and the
    /// global average cover every value ever added either way.
    pub fn state(&self, keep: Option<usize>) -> HistoryState {
        let skip = keep.map_or(0, |k| self.values.len().saturating_sub(k));
        let mut entries = Vec::with_capacity(self.values.len() - skip);
        let mut vals = self.values.iter();
        let mut index = 0usize;
        for run in &self.runs {
            for k in 0..run.len {
                if let Some(&v) = vals.next() {
                    if index >= skip {
                        entries.push((v, run.at(k)));
                    }
                    index += 1;
                }
            }
        }
        HistoryState {
            max_length: self.max_length,
            entries,
            count: self.count,
            global_avg: self.global_avg,
            int_iterations: self.int_iterations,
        }
    }

    /// A history equal to the one `state` came from.
    pub fn from_state(state: HistoryState) -> crate::Result<History> {
        let max = i64::try_from(state.max_length).unwrap_or(i64::MAX);
        if state.max_length == 0 {
            return Err(crate::Error::BadMaxLength(0));
        }
        if state.entries.len() > state.max_length || (state.entries.len() as u64) > state.count {
            return Err(crate::Error::BadState {
                what: "HistoryBuffer",
                reason: format!(
                    "{} entries for max_length {max} and count {}",
                    state.entries.len(),
                    state.count
                ),
            });
        }
        let mut h = History::new(state.max_length)?;
        for &(v, it) in &state.entries {
            h.grow_if_full();
            h.values.push_back(v);
            h.push_iteration(it);
        }
        h.count = state.count;
        h.global_avg = state.global_avg;
        h.int_iterations = state.int_iterations;
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(max_length: usize, n: usize) -> History {
        let mut h = History::new(max_length).unwrap();
        for i in 0..n {
            h.update(i as f64, None);
        }
        h
    }

    #[test]
    fn ring_wraps_and_keeps_iterations() {
        let h = filled(5, 12);
        let vals = h.values();
        assert_eq!(vals.len(), 5);
        assert_eq!(vals[0], (7.0, Iter::Int(7)));
        assert_eq!(vals[4], (11.0, Iter::Int(11)));
        assert_eq!(h.count(), 12);
        assert_eq!(h.latest().unwrap(), 11.0);
    }

    #[test]
    fn global_avg_includes_evicted_values() {
        let h = filled(3, 10);
        assert!((h.global_avg() - 4.5).abs() < 1e-12);
        assert_eq!(h.avg(100).unwrap(), 8.0);
    }

    #[test]
    fn median_matches_numpy_for_odd_and_even_windows() {
        let mut h = History::new(100).unwrap();
        for v in [5.0, 1.0, 4.0, 2.0, 3.0, 10.0] {
            h.update(v, None);
        }
        assert_eq!(h.median(5).unwrap(), 3.0); // [1,4,2,3,10]
        assert_eq!(h.median(6).unwrap(), 3.5); // [5,1,4,2,3,10]
        assert_eq!(h.median(1).unwrap(), 10.0);
        assert_eq!(h.median(2).unwrap(), 6.5);
        h.update(f64::NAN, None);
        assert!(h.median(3).unwrap().is_nan());
    }

    #[test]
    fn the_tracked_median_equals_the_selected_one_through_updates_and_evictions() {
        // (Besides equality, this walks every path of median_tracked: the first build, merges,
        // rebuilds after long gaps and after evictions, and a change of window.)
        // A fixed pseudo-random walk with repeats, signed zeros, NaNs and infinities, over
        // windows shorter than, equal to and longer than max_length.
        let mut next = crate::testutil::xorshift(0x9E37_79B9_7F4A_7C15);
        for &(max_length, window) in &[
            (50, 7),
            (50, 50),
            (50, 80),
            (1000, 1000),
            (64, 1),
            (10_000, 200),
        ] {
            let mut h = History::new(max_length).unwrap();
            for step in 0..600 {
                let r = next();
                let v = match r % 17 {
                    0 => f64::NAN,
                    1 => -0.0,
                    2 => 0.0,
                    3 => f64::INFINITY,
                    4 => f64::NEG_INFINITY,
                    5..=8 => (r % 5) as f64,
                    _ => (r % 10_000) as f64 / 7.0 - 700.0,
                };
                h.update(v, None);
                // Reads after gaps of one to dozens of updates (a merge, or a rebuild when
                // the gap is long or what left the window was evicted), and long quiet spells.
                let gap = if step > 300 && step < 420 {
                    97
                } else {
                    1 + (r >> 20) % 9
                };
                if step % gap == 0 || step < 10 {
                    let tracked = h.median_tracked(window as i64).unwrap();
                    let selected = h.median(window as i64).unwrap();
                    assert!(
                        tracked.to_bits() == selected.to_bits()
                            || (tracked.is_nan() && selected.is_nan()),
                        "max_length {max_length} window {window} step {step}: \
                         {tracked} != {selected}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_smoothed_median_equals_a_fresh_selection_through_updates_and_evictions() {
        // windowed_median keeps its own sorted copy (apart from median_tracked's): read at
        // every update (keys moved in place), after gaps (merges, rebuilds), with iterations
        // that skip or repeat (the sample count changes), and beside median_tracked on the same
        // history, as the printer asks both of `time`.
        let mut next = crate::testutil::xorshift(0x2545_F491_4F6C_DD1D);
        for &(max_length, window) in &[(30, 20), (20, 20), (8, 20), (1000, 5), (64, 1)] {
            let mut h = History::new(max_length).unwrap();
            let mut it = 0i64;
            for step in 0..800 {
                let r = next();
                let v = match r % 23 {
                    0 => f64::NAN,
                    1 => -0.0,
                    2 => 0.0,
                    3 => f64::INFINITY,
                    4..=9 => (r % 4) as f64,
                    _ => (r % 10_000) as f64 / 3.0 - 1000.0,
                };
                // Mostly one entry per iteration; sometimes a skipped or a repeated one.
                it += match (r >> 8) % 13 {
                    0 => 0,
                    1 => 3,
                    _ => 1,
                };
                h.update(v, Some(Iter::Int(it)));
                let gap = if (300..360).contains(&step) {
                    29
                } else {
                    1 + (r >> 24) % 4
                };
                if step % gap == 0 {
                    let n = h.count_samples(window).max(1) as i64;
                    let fresh = h.median(n).unwrap();
                    let kept = h.windowed_median(window).unwrap();
                    assert!(
                        kept.to_bits() == fresh.to_bits() || (kept.is_nan() && fresh.is_nan()),
                        "max_length {max_length} window {window} step {step}: {kept} != {fresh}"
                    );
                    if step % 3 == 0 {
                        let long = h.median_tracked(1000).unwrap();
                        let selected = h.median(1000).unwrap();
                        assert!(
                            long.to_bits() == selected.to_bits()
                                || (long.is_nan() && selected.is_nan())
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_tracked_median_follows_the_window_asked_for_last() {
        let mut h = History::new(100).unwrap();
        for v in [5.0, 1.0, 4.0, 2.0, 3.0] {
            h.update(v, None);
        }
        assert_eq!(h.median_tracked(5).unwrap(), 3.0);
        assert_eq!(h.median_tracked(2).unwrap(), 2.5);
        h.update(10.0, None);
        assert_eq!(h.median_tracked(2).unwrap(), 6.5);
        assert_eq!(h.median_tracked(6).unwrap(), 3.5);
        assert!(matches!(
            h.median_tracked(0),
            Err(crate::Error::BadWindow(0))
        ));
        let mut empty = History::new(10).unwrap();
        assert!(empty.median_tracked(1000).unwrap().is_nan());
        empty.update(2.0, None);
        assert_eq!(empty.median_tracked(1000).unwrap(), 2.0);
    }

    #[test]
    fn bad_windows_are_errors() {
        let h = filled(10, 3);
        assert!(matches!(h.median(0), Err(crate::Error::BadWindow(0))));
        assert!(matches!(h.avg(-2), Err(crate::Error::BadWindow(-2))));
        assert!(History::new(0).is_err());
    }

    #[test]
    fn empty_history() {
        let h = History::new(4).unwrap();
        assert!(h.median(3).unwrap().is_nan());
        assert!(h.avg(3).unwrap().is_nan());
        assert!(matches!(h.latest(), Err(crate::Error::EmptyHistory)));
        assert_eq!(h.count_samples(20), 0);
        assert!(h.values().is_empty());
    }

    #[test]
    fn irregular_iterations_round_trip() {
        let its = [0, 3, 3, 4, 10, 20, 30, 31, -5, 7];
        let mut h = History::new(6).unwrap();
        for (k, it) in its.iter().enumerate() {
            h.update(k as f64, Some(Iter::Int(*it)));
        }
        let got: Vec<Iter> = h.values().into_iter().map(|(_, it)| it).collect();
        let want: Vec<Iter> = its[4..].iter().map(|&i| Iter::Int(i)).collect();
        assert_eq!(got, want);
        assert_eq!(h.latest_entry(), Some((9.0, Iter::Int(7))));
    }

    #[test]
    fn float_iterations_read_back_as_floats() {
        let mut h = History::new(4).unwrap();
        h.update(1.0, Some(Iter::Float(0.5)));
        h.update(2.0, Some(Iter::Int(1)));
        assert_eq!(
            h.values(),
            vec![(1.0, Iter::Float(0.5)), (2.0, Iter::Float(1.0))]
        );
    }

    #[test]
    fn windowed_median_of_a_lone_newest_entry_equals_counting_and_sorting() {
        // Iterations that repeat, skip, go back and take fractions: wherever the newest entry
        // is alone in its window (the shortcut) or not, the answer is count_samples' median.
        let steps = [
            1.0, 1.0, 0.0, 3.0, 1.0, 0.5, 0.5, -2.0, 25.0, 1.0, 0.0, 0.0, 40.0, 1.0,
        ];
        let mut h = History::new(16).unwrap();
        let mut it = 0.0f64;
        let mut state = 7u64;
        for round in 0..200 {
            it += steps[round % steps.len()];
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let value = (state >> 33) as f64 / 1e6;
            let iteration = if it.fract() == 0.0 {
                Iter::Int(it as i64)
            } else {
                Iter::Float(it)
            };
            h.update(value, Some(iteration));
            for w in [1, 2, 3, 20, 30] {
                let n = h.count_samples(w).max(1) as i64;
                assert_eq!(
                    h.windowed_median(w).unwrap(),
                    h.median(n).unwrap(),
                    "w {w} r {round}"
                );
            }
        }
    }

    #[test]
    fn windowed_median_kept_until_the_next_update_and_per_window() {
        let mut h = History::new(8).unwrap();
        let fresh = |h: &History, w: i64| {
            let n = h.count_samples(w).max(1) as i64;
            h.median(n).unwrap()
        };
        for (i, v) in [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 0.5, 7.0, 6.0, 8.0, 2.5]
            .iter()
            .enumerate()
        {
            h.update(*v, Some(Iter::Int(2 * i as i64)));
            for w in [1, 3, 4, 7, 100, 3] {
                // asked twice: the kept answer equals a fresh one, through evictions (past 8)
                assert_eq!(
                    h.windowed_median(w).unwrap(),
                    fresh(&h, w),
                    "window {w} at {i}"
                );
                assert_eq!(h.windowed_median(w).unwrap(), fresh(&h, w));
            }
        }
        assert!(matches!(
            h.windowed_median(0),
            Err(crate::Error::BadWindow(0))
        ));
        let restored = History::from_state(h.state(None)).unwrap();
        assert_eq!(restored.windowed_median(4).unwrap(), fresh(&h, 4));
    }

    #[test]
    fn count_samples_counts_iterations_not_samples() {
        let mut h = History::new(100).unwrap();
        for it in (0..100).step_by(10) {
            h.update(1.0, Some(Iter::Int(it)));
        }
        // last = 90; within 20 iterations: 90, 80 (> 70).
        assert_eq!(h.count_samples(20), 2);
        assert_eq!(h.count_samples(1), 1);
        assert_eq!(h.count_samples(1000), 10);
    }

    #[test]
    fn count_samples_equals_a_walk_back_over_the_entries() {
        // Runs that rise by one or by several, repeat an iteration, fall, or hold floats; the
        // count from each run's arithmetic equals a walk back entry by entry.
        let walk = |h: &History, w: i64| {
            let entries = h.values();
            let Some(&(_, last)) = entries.last() else {
                return 0;
            };
            let threshold = last.as_f64() - w as f64;
            entries
                .iter()
                .rev()
                .take_while(|(_, it)| it.as_f64() > threshold)
                .count()
        };
        let mut next = crate::testutil::xorshift(0x0123_4567_89AB_CDEF);
        for max_length in [7usize, 100, 5000] {
            let mut h = History::new(max_length).unwrap();
            assert_eq!(h.count_samples(20), 0);
            let mut it = 0.0f64;
            for step in 0..3000 {
                let r = next();
                it += match (step / 300) % 5 {
                    0 => 1.0,
                    1 => [1.0, 1.0, 0.0, 3.0][(r % 4) as usize],
                    2 => -2.0,
                    3 => 7.0,
                    _ => [0.5, 1.0, 2.25][(r % 3) as usize],
                };
                h.update(1.0, Some(Iter::Float(it)));
                for w in [1, 2, 20, 21, 1000] {
                    assert_eq!(h.count_samples(w), walk(&h, w), "step {step} window {w}");
                }
            }
        }
    }

    #[test]
    fn regular_iterations_cost_one_run() {
        let h = filled(1000, 5000);
        assert_eq!(h.runs.len(), 1);
        assert!(h.values.capacity() <= 1000);
        assert!(h.heap_bytes() <= 1000 * 8 + 64);
    }

    #[test]
    fn capacity_never_exceeds_max_length() {
        let h = filled(1_000_000, 1_200_000);
        assert_eq!(h.values.capacity(), 1_000_000);
    }

    #[test]
    fn avg_matches_numpy_bit_for_bit() {
        // numpy.mean([1/(i+1) for i in range(24)]) == 0.15733159073972947 (numpy 2.4); a naive
        // left-to-right sum gives ...944.
        let mut h = History::new(1000).unwrap();
        for i in 0..24 {
            h.update(1.0 / (i as f64 + 1.0), None);
        }
        assert_eq!(h.avg(24).unwrap(), 0.15733159073972947);
    }

    #[test]
    fn state_round_trips_after_eviction() {
        let mut h = filled(4, 10);
        h.update(2.5, Some(Iter::Float(20.5)));
        let back = History::from_state(h.state(None)).unwrap();
        assert_eq!(back.values(), h.values());
        assert_eq!(
            (back.count(), back.global_avg()),
            (h.count(), h.global_avg())
        );
        assert_eq!(back.max_length(), 4);
        let recent = History::from_state(h.state(Some(2))).unwrap();
        assert_eq!(recent.values(), h.values()[2..].to_vec());
        assert_eq!(recent.count(), h.count());
    }

    #[test]
    fn inconsistent_state_is_an_error() {
        let mut state = filled(4, 4).state(None);
        state.max_length = 2;
        assert!(matches!(
            History::from_state(state),
            Err(crate::Error::BadState { .. })
        ));
    }
}
