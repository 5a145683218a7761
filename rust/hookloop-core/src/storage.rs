//! `Storage`: the state behind detectron2's `EventStorage` — one `History` per scalar name, the
//! latest (value, iteration) of each, smoothing hints, the current iteration and name prefix,
//! and the histograms waiting for a writer.
//!
//! Not synchronised itself: the binding wraps it in one `Mutex`, taken once per Python call.

use std::collections::VecDeque;
use std::sync::Arc;

use indexmap::IndexMap;
use rustc_hash::FxBuildHasher;

use crate::history::{History, Iter};
use crate::tfevents::HistogramPoint;
use crate::{Error, Result};

/// One scalar metric.
#[derive(Debug, Clone)]
pub struct Scalar {
    pub history: History,
    pub smoothing_hint: bool,
    /// The value and iteration of the last put (not necessarily the history's newest entry's
    /// iteration order, when `cur_iter` went backwards, but always the last put).
    pub latest: (f64, Iter),
}

/// A scalar as writers see it: the smoothed (or latest) value and its iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct SmoothedScalar {
    /// Shared with the storage's key: a snapshot costs a reference count, not an allocation.
    pub name: Arc<str>,
    pub value: f64,
    pub iter: Iter,
}

/// detectron2's `EventStorage` state, minus the images (Python objects, kept by the binding).
#[derive(Debug)]
pub struct Storage {
    scalars: IndexMap<Arc<str>, Scalar, FxBuildHasher>,
    iter: i64,
    prefix: String,
    max_length: usize,
    histograms: VecDeque<HistogramPoint>,
    max_histograms: usize,
    dropped_histograms: u64,
}

impl Storage {
    /// A storage starting at `start_iter`. Histories keep `max_length` entries each; at most
    /// `max_histograms` histograms wait for a writer (older ones are dropped first).
    pub fn new(start_iter: i64, max_length: usize, max_histograms: usize) -> Result<Self> {
        if max_length == 0 {
            return Err(Error::BadMaxLength(0));
        }
        Ok(Storage {
            scalars: IndexMap::default(),
            iter: start_iter,
            prefix: String::new(),
            max_length,
            histograms: VecDeque::new(),
            max_histograms,
            dropped_histograms: 0,
        })
    }

    /// The current iteration.
    pub fn iter(&self) -> i64 {
        self.iter
    }

    /// Sets the current iteration.
    pub fn set_iter(&mut self, iter: i64) {
        self.iter = iter;
    }

    /// Advances the current iteration by one.
    pub fn step(&mut self) {
        self.iter += 1;
    }

    /// The name prefix set by `name_scope` ("" outside any scope).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Sets the name prefix; `name_scope` stores `name.rstrip("/") + "/"`.
    pub fn set_prefix(&mut self, prefix: String) {
        self.prefix = prefix;
    }

    /// Records `value` for `name` (prefixed) at `cur_iter` or the current iteration.
    ///
    /// A name put again with the other smoothing hint is an error and leaves the storage
    /// unchanged (detectron2 asserts after storing the value).
    pub fn put_scalar(
        &mut self,
        name: &str,
        value: f64,
        smoothing_hint: bool,
        cur_iter: Option<Iter>,
    ) -> Result<()> {
        let iter = cur_iter.unwrap_or(Iter::Int(self.iter));
        if self.prefix.is_empty() {
            self.put_resolved(name, value, smoothing_hint, iter)
        } else {
            let full = format!("{}{}", self.prefix, name);
            self.put_resolved(&full, value, smoothing_hint, iter)
        }
    }

    fn put_resolved(&mut self, name: &str, value: f64, hint: bool, iter: Iter) -> Result<()> {
        if let Some(scalar) = self.scalars.get_mut(name) {
            if scalar.smoothing_hint != hint {
                return Err(Error::HintChanged {
                    name: name.to_owned(),
                    old: scalar.smoothing_hint,
                    new: hint,
                    iter: iter.to_string(),
                });
            }
            scalar.history.update(value, Some(iter));
            scalar.latest = (value, iter);
            return Ok(());
        }
        let mut history = History::new(self.max_length)?;
        history.update(value, Some(iter));
        self.scalars.insert(
            Arc::from(name),
            Scalar {
                history,
                smoothing_hint: hint,
                latest: (value, iter),
            },
        );
        Ok(())
    }

    /// The scalar called `name` (no prefix applied), or `UnknownMetric`.
    pub fn scalar(&self, name: &str) -> Result<&Scalar> {
        self.scalars
            .get(name)
            .ok_or_else(|| Error::UnknownMetric(name.to_owned()))
    }

    /// Mutable access to the history of `name`, for `HistoryBuffer.update` on a storage view.
    pub fn history_mut(&mut self, name: &str) -> Result<&mut History> {
        self.scalars
            .get_mut(name)
            .map(|s| &mut s.history)
            .ok_or_else(|| Error::UnknownMetric(name.to_owned()))
    }

    /// All scalars in the order they were first put.
    pub fn scalars(&self) -> impl ExactSizeIterator<Item = (&str, &Scalar)> {
        self.scalars.iter().map(|(k, v)| (&**k, v))
    }

    /// Number of distinct scalar names.
    pub fn len(&self) -> usize {
        self.scalars.len()
    }

    /// True when no scalar was ever put.
    pub fn is_empty(&self) -> bool {
        self.scalars.is_empty()
    }

    /// detectron2's `count_samples`: how many recent entries of `name` lie in the last
    /// `window_size` iterations. Unknown names are an error and create nothing.
    pub fn count_samples(&self, name: &str, window_size: i64) -> Result<usize> {
        Ok(self.scalar(name)?.history.count_recent(window_size))
    }

    /// detectron2's `latest_with_smoothing_hint`: per scalar, the median over the last
    /// `window_size` iterations if its hint is set, else its latest value; with the latest
    /// iteration. In first-put order.
    pub fn latest_with_smoothing_hint(&self, window_size: i64) -> Result<Vec<SmoothedScalar>> {
        self.smoothed_newer_than(window_size, f64::NEG_INFINITY)
    }

    /// `latest_with_smoothing_hint` restricted to scalars whose latest iteration is after
    /// `after`: what a writer that already wrote up to `after` needs, without computing
    /// medians it would throw away.
    pub fn smoothed_newer_than(&self, window_size: i64, after: f64) -> Result<Vec<SmoothedScalar>> {
        if window_size <= 0 {
            return Err(Error::BadWindow(window_size));
        }
        let mut out = Vec::with_capacity(self.scalars.len());
        for (name, s) in &self.scalars {
            if s.latest.1.as_f64() <= after {
                continue;
            }
            let value = if s.smoothing_hint {
                windowed_median(&s.history, window_size)?
            } else {
                s.latest.0
            };
            out.push(SmoothedScalar {
                name: name.clone(),
                value,
                iter: s.latest.1,
            });
        }
        Ok(out)
    }

    /// Queues a histogram for the TensorBoard writer, dropping the oldest past the bound.
    /// Returns true the first time one was dropped, so the caller can log it once.
    pub fn put_histogram(&mut self, hist: HistogramPoint) -> bool {
        self.histograms.push_back(hist);
        if self.histograms.len() > self.max_histograms {
            self.histograms.pop_front();
            self.dropped_histograms += 1;
            return self.dropped_histograms == 1;
        }
        false
    }

    /// The queued histograms, oldest first.
    pub fn histograms(&self) -> impl ExactSizeIterator<Item = &HistogramPoint> {
        self.histograms.iter()
    }

    /// Takes every queued histogram out of the storage.
    pub fn take_histograms(&mut self) -> Vec<HistogramPoint> {
        self.histograms.drain(..).collect()
    }

    /// Heap bytes held by all histories (for the memory benchmark and `__sizeof__`).
    pub fn heap_bytes(&self) -> usize {
        self.scalars.values().map(|s| s.history.heap_bytes()).sum()
    }
}

/// Median over the entries of the last `window_size` iterations (at least one entry): the
/// value detectron2's writers and printer show for a smoothed scalar.
pub fn windowed_median(history: &History, window_size: i64) -> Result<f64> {
    if window_size <= 0 {
        return Err(Error::BadWindow(window_size));
    }
    // count_samples counts the newest entry itself, so it is >= 1 for a non-empty history.
    let samples = history.count_recent(window_size).max(1);
    history.median(samples as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage() -> Storage {
        Storage::new(0, History::DEFAULT_MAX_LENGTH, 8).unwrap()
    }

    #[test]
    fn put_and_read_back() {
        let mut s = storage();
        s.put_scalar("loss", 1.0, true, None).unwrap();
        s.step();
        s.put_scalar("loss", 3.0, true, None).unwrap();
        let loss = s.scalar("loss").unwrap();
        assert_eq!(loss.latest, (3.0, Iter::Int(1)));
        assert_eq!(
            loss.history.values(),
            vec![(1.0, Iter::Int(0)), (3.0, Iter::Int(1))]
        );
    }

    #[test]
    fn hint_change_is_an_error_and_stores_nothing() {
        let mut s = storage();
        s.put_scalar("lr", 0.1, false, None).unwrap();
        s.set_iter(120);
        let err = s.put_scalar("lr", 0.2, true, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "smoothing_hint for 'lr' changed from false to true at iter 120"
        );
        assert_eq!(s.scalar("lr").unwrap().history.len(), 1);
    }

    #[test]
    fn prefix_applies_to_names() {
        let mut s = storage();
        s.set_prefix("val/".into());
        s.put_scalar("acc", 0.5, true, None).unwrap();
        assert!(s.scalar("val/acc").is_ok());
        assert!(matches!(s.scalar("acc"), Err(Error::UnknownMetric(_))));
    }

    #[test]
    fn count_samples_on_unknown_name_creates_nothing() {
        let s = storage();
        assert!(s.count_samples("nope", 20).is_err());
        assert!(s.is_empty());
    }

    #[test]
    fn latest_with_smoothing_hint_uses_iteration_window() {
        let mut s = storage();
        for i in 0..30 {
            s.set_iter(i);
            s.put_scalar("loss", i as f64, true, None).unwrap();
            s.put_scalar("lr", i as f64, false, None).unwrap();
        }
        let got = s.latest_with_smoothing_hint(20).unwrap();
        // loss: median of iterations 10..=29 = 19.5; lr: latest.
        assert_eq!(
            got[0],
            SmoothedScalar {
                name: "loss".into(),
                value: 19.5,
                iter: Iter::Int(29)
            }
        );
        assert_eq!(
            got[1],
            SmoothedScalar {
                name: "lr".into(),
                value: 29.0,
                iter: Iter::Int(29)
            }
        );
    }

    #[test]
    fn histograms_are_bounded() {
        let mut s = Storage::new(0, 10, 2).unwrap();
        let h = |step| HistogramPoint {
            tag: "w".into(),
            step,
            min: 0.0,
            max: 1.0,
            num: 1.0,
            sum: 0.5,
            sum_squares: 0.25,
            bucket_limits: vec![1.0],
            bucket_counts: vec![1.0],
        };
        assert!(!s.put_histogram(h(0)));
        assert!(!s.put_histogram(h(1)));
        assert!(s.put_histogram(h(2)));
        assert!(!s.put_histogram(h(3)));
        let steps: Vec<i64> = s.take_histograms().iter().map(|h| h.step).collect();
        assert_eq!(steps, vec![2, 3]);
        assert_eq!(s.histograms().len(), 0);
    }
}
