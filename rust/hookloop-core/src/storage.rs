//! `Storage`: the state behind detectron2's `EventStorage` — one `History` per scalar name, the
//! latest (value, iteration) of each, smoothing hints, the current iteration and name prefix,
//! and the histograms waiting for a writer.
//!
//! Not synchronised itself: the binding wraps it in one `Mutex`, taken once per Python call.

use std::sync::Arc;

use indexmap::IndexMap;
use rustc_hash::FxBuildHasher;

use crate::history::{History, HistoryState};
use crate::iter::Iter;
use crate::media::MediaQueue;
use crate::record::HistogramPoint;
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
    /// `name_scope` prefixes, per thread: a scope opened on one thread does not rename what
    /// another thread puts meanwhile. Empty outside any scope (the common, fast case).
    prefixes: Vec<(std::thread::ThreadId, String)>,
    max_length: usize,
    histograms: MediaQueue<HistogramPoint>,
    /// Where the names of deferred puts belong: the number of names the storage held when
    /// the first put still waiting was made ([`Storage::mark_deferred`]). detectron2 keeps a
    /// name where it was first put, so reading a value later must not move its name later.
    deferred_at: Option<usize>,
    /// Names whose history was read (`histories()[name]`) before any value was put: detectron2's
    /// `histories()` is its `defaultdict`, so such a read creates the (empty) history there and
    /// `histories()` lists it at that place from then on. Each entry is the number of scalars
    /// the storage held at the read (where the name goes in [`Storage::history_names`]).
    read_first: Vec<(usize, Arc<str>)>,
    /// The histories of names read but not put yet (empty unless a view was updated): the first
    /// put of the name continues this history.
    unput: IndexMap<Arc<str>, History, FxBuildHasher>,
    /// The smoothing hints of forgotten names ([`Storage::forget`]), as detectron2's
    /// `_smoothing_hints` keeps them: a later put of the name is checked against its hint.
    forgotten: IndexMap<Arc<str>, bool, FxBuildHasher>,
}

impl Storage {
    /// A storage starting at `start_iter` (within ±2**53, as every iteration). Histories keep
    /// `max_length` entries each; at most `max_histograms` histograms wait for a writer (older
    /// ones are dropped first).
    pub fn new(start_iter: i64, max_length: usize, max_histograms: usize) -> Result<Self> {
        let start_iter = crate::iter::exact_iter("start_iter", start_iter)?;
        if max_length == 0 {
            return Err(Error::BadMaxLength(0));
        }
        Ok(Storage {
            scalars: IndexMap::default(),
            iter: start_iter,
            prefixes: Vec::new(),
            max_length,
            histograms: MediaQueue::new(max_histograms),
            deferred_at: None,
            read_first: Vec::new(),
            unput: IndexMap::default(),
            forgotten: IndexMap::default(),
        })
    }

    /// A put is deferred (its value read later): the names it creates belong at the storage's
    /// current end. Only the first deferral since the last [`Storage::end_deferred`] counts.
    pub fn mark_deferred(&mut self) {
        if self.deferred_at.is_none() {
            self.deferred_at = Some(self.scalars.len());
        }
    }

    /// The deferred puts made since the mark have just been put: the names they created
    /// (those from index `first_new` on) move back to where the puts were made, in their
    /// order, ahead of the names put meanwhile. Puts of a later deferred batch go after them.
    pub fn place_deferred(&mut self, first_new: usize) {
        let Some(mark) = self.deferred_at else {
            return;
        };
        let end = self.scalars.len();
        let mark = mark.min(first_new);
        for (k, from) in (first_new..end).enumerate() {
            self.scalars.move_index(from, mark + k);
        }
        self.deferred_at = Some(mark + end.saturating_sub(first_new));
    }

    /// Every deferred put has been put: the next deferral marks a new place.
    pub fn end_deferred(&mut self) {
        self.deferred_at = None;
    }

    /// The current iteration.
    pub fn iter(&self) -> i64 {
        self.iter
    }

    /// Sets the current iteration (within ±2**53, as every iteration).
    pub fn set_iter(&mut self, iter: i64) -> Result<()> {
        self.iter = crate::iter::exact_iter("EventStorage.iter", iter)?;
        Ok(())
    }

    /// Advances the current iteration by one; at `i64::MAX` that is an error, not a wrap.
    pub fn step(&mut self) -> Result<()> {
        let next = self.iter.checked_add(1).ok_or_else(|| Error::OutOfRange {
            what: "EventStorage.iter + 1".into(),
            value: format!("{} + 1", self.iter),
            range: "int64",
        })?;
        self.iter = crate::iter::exact_iter("EventStorage.iter + 1", next)?;
        Ok(())
    }

    /// The name prefix the calling thread's `name_scope` set ("" outside any scope).
    pub fn prefix(&self) -> &str {
        if self.prefixes.is_empty() {
            return "";
        }
        let me = std::thread::current().id();
        self.prefixes
            .iter()
            .find(|(t, _)| *t == me)
            .map_or("", |(_, p)| p.as_str())
    }

    /// Sets the calling thread's name prefix; `name_scope` stores `name.rstrip("/") + "/"`.
    pub fn set_prefix(&mut self, prefix: String) {
        let me = std::thread::current().id();
        self.prefixes.retain(|(t, _)| *t != me);
        if !prefix.is_empty() {
            self.prefixes.push((me, prefix));
        }
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
        let prefix = self.prefix();
        if prefix.is_empty() {
            self.put_resolved(name, value, smoothing_hint, iter)
        } else {
            let full = format!("{prefix}{name}");
            self.put_resolved(&full, value, smoothing_hint, iter)
        }
    }

    /// Where a put of `name` made now stores its value: the full name (this thread's name
    /// scope applied) and the iteration (`cur_iter`, else the current one), after checking
    /// the name's smoothing hint. A deferred put fixes both when it is made and stores the
    /// value later with [`Storage::put_at`].
    pub fn resolve_put(
        &self,
        name: &str,
        smoothing_hint: bool,
        cur_iter: Option<Iter>,
    ) -> Result<(String, Iter)> {
        let iter = cur_iter.unwrap_or(Iter::Int(self.iter));
        let full = self.full_name(name);
        match self.hint_of(&full) {
            Some(old) if old != smoothing_hint => Err(Error::HintChanged {
                name: full,
                old,
                new: smoothing_hint,
                iter: iter.to_string(),
            }),
            _ => Ok((full, iter)),
        }
    }

    /// The smoothing hint `name` was put with: a scalar's, or a forgotten name's.
    fn hint_of(&self, name: &str) -> Option<bool> {
        match self.scalars.get(name) {
            Some(s) => Some(s.smoothing_hint),
            None => self.forgotten.get(name).copied(),
        }
    }

    /// `name` with this thread's name scope applied.
    pub fn full_name(&self, name: &str) -> String {
        format!("{}{name}", self.prefix())
    }

    /// Stores `value` under the full name and iteration that [`Storage::resolve_put`] fixed.
    pub fn put_at(&mut self, full_name: &str, value: f64, hint: bool, iter: Iter) -> Result<()> {
        self.put_resolved(full_name, value, hint, iter)
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
        if let Some(old) = self.forgotten.swap_remove(name) {
            if old != hint {
                self.forgotten.insert(Arc::from(name), old);
                return Err(Error::HintChanged {
                    name: name.to_owned(),
                    old,
                    new: hint,
                    iter: iter.to_string(),
                });
            }
        }
        let mut history = match self.unput.swap_remove(name) {
            Some(read_first) => read_first,
            None => History::new(self.max_length)?,
        };
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

    /// Makes `history` the history of `name` (no prefix applied). A known name keeps its hint
    /// and its latest value, as detectron2's `_latest_scalars` is not touched by assigning
    /// into `histories()`; a new name is smoothed, with the history's newest entry as its
    /// latest value. An empty history is an error (a scalar always has a latest value).
    pub fn set_history(&mut self, name: &str, history: History) -> Result<()> {
        let Some(latest) = history.latest_entry() else {
            return Err(Error::bad_value(
                format!("history '{name}'"),
                "is empty: put a value into it before assigning it to a storage",
            ));
        };
        match self.scalars.get_mut(name) {
            Some(s) => s.history = history,
            None => {
                let smoothing_hint = self.forgotten.swap_remove(name).unwrap_or(true);
                self.scalars.insert(
                    Arc::from(name),
                    Scalar {
                        history,
                        smoothing_hint,
                        latest,
                    },
                );
            }
        }
        Ok(())
    }

    /// Forgets `name`'s latest value and history, as detectron2 code that leaves the name out
    /// of the dicts it assigns to `_latest_scalars` and `_history` does (a validation hook
    /// pruning its `val_*` losses between its steps). The smoothing hint stays, as in
    /// detectron2's `_smoothing_hints`: a later put of the name is checked against it and
    /// starts a new history, listed last. Call it with no deferred put waiting (the binding
    /// settles first). Returns whether the name was known.
    pub fn forget(&mut self, name: &str) -> bool {
        let known = if let Some((k, key, scalar)) = self.scalars.shift_remove_full(name) {
            self.forgotten.insert(key, scalar.smoothing_hint);
            // Places recorded as "scalars held then" after the removed one move up by one.
            for (at, _) in &mut self.read_first {
                if *at > k {
                    *at -= 1;
                }
            }
            if let Some(mark) = self.deferred_at.as_mut() {
                if *mark > k {
                    *mark -= 1;
                }
            }
            true
        } else {
            self.unput.shift_remove(name).is_some()
        };
        self.read_first.retain(|(_, n)| &**n != name);
        known
    }

    /// `{name: smoothing_hint}` as detectron2's `_smoothing_hints`: every scalar's, in
    /// first-put order, then those of forgotten names.
    pub fn smoothing_hints(&self) -> Vec<(Arc<str>, bool)> {
        let scalars = self
            .scalars
            .iter()
            .map(|(k, s)| (k.clone(), s.smoothing_hint));
        let forgotten = self.forgotten.iter().map(|(k, &h)| (k.clone(), h));
        scalars.chain(forgotten).collect()
    }

    /// The scalar called `name` (no prefix applied), or `UnknownMetric`.
    pub fn scalar(&self, name: &str) -> Result<&Scalar> {
        self.scalars
            .get(name)
            .ok_or_else(|| Error::UnknownMetric(name.to_owned()))
    }

    /// Mutable access to the history of `name`, for `HistoryBuffer.update` on a storage view:
    /// a scalar's, or the history of a name read before it was put.
    pub fn history_mut(&mut self, name: &str) -> Result<&mut History> {
        match self.scalars.get_mut(name) {
            Some(s) => Ok(&mut s.history),
            None => self
                .unput
                .get_mut(name)
                .ok_or_else(|| Error::UnknownMetric(name.to_owned())),
        }
    }

    /// Whether `name` has a history: it was put, or read with [`Storage::read_history`].
    pub fn has_history(&self, name: &str) -> bool {
        self.scalars.contains_key(name) || self.unput.contains_key(name)
    }

    /// detectron2's `histories()[name]` for a name never put: the name gets an empty history
    /// now, listed at this place by [`Storage::history_names`] (also after its first put,
    /// which continues that history). Writers and `latest()` see the name only once it is put.
    /// Known names are left as they are.
    pub fn read_history(&mut self, name: &str) -> Result<()> {
        if self.has_history(name) {
            return Ok(());
        }
        let name: Arc<str> = Arc::from(name);
        self.unput
            .insert(name.clone(), History::new(self.max_length)?);
        self.read_first.push((self.scalars.len(), name));
        Ok(())
    }

    /// The names with a history, in detectron2's `histories()` order: where each was first put
    /// or, for a name read before its first put, first read.
    pub fn history_names(&self) -> Vec<Arc<str>> {
        if self.read_first.is_empty() {
            return self.scalars.keys().cloned().collect();
        }
        let mut out = Vec::with_capacity(self.scalars.len() + self.unput.len());
        let mut slots = self.read_first.iter().peekable();
        for (k, name) in self.scalars.keys().enumerate() {
            while let Some((_, slot)) = slots.next_if(|(at, _)| *at <= k) {
                out.push(slot.clone());
            }
            if !self.read_first.iter().any(|(_, n)| n == name) {
                out.push(name.clone());
            }
        }
        out.extend(slots.map(|(_, n)| n.clone()));
        out
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
        if window_size <= 0 {
            return Err(Error::BadWindow(window_size));
        }
        Ok(self.scalar(name)?.history.count_samples(window_size))
    }

    /// detectron2's `latest_with_smoothing_hint`: per scalar, the median over the last
    /// `window_size` iterations if its hint is set, else its latest value; with the latest
    /// iteration. In first-put order.
    pub fn latest_with_smoothing_hint(&self, window_size: i64) -> Result<Vec<SmoothedScalar>> {
        self.smoothed_newer_than(window_size, f64::NEG_INFINITY)
    }

    /// What a writer that wrote up to `*last_write` writes next: the smoothed scalars whose
    /// latest iteration is after it (without computing medians it would throw away); advances
    /// `*last_write` to the newest iteration returned. The one `last_write` rule of every
    /// writer.
    pub fn smoothed_since(
        &self,
        window_size: i64,
        last_write: &mut f64,
    ) -> Result<Vec<SmoothedScalar>> {
        let out = self.smoothed_newer_than(window_size, *last_write)?;
        for s in &out {
            *last_write = last_write.max(s.iter.as_f64());
        }
        Ok(out)
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
                s.history.windowed_median(window_size)?
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
        let iter = self.iter;
        self.histograms.push(hist, iter).1
    }

    /// The queued histograms, oldest first.
    pub fn histograms(&self) -> impl ExactSizeIterator<Item = &HistogramPoint> {
        self.histograms.iter()
    }

    /// Takes every queued histogram out of the storage, for every writer (detectron2's
    /// `clear_histograms`).
    pub fn take_histograms(&mut self) -> Vec<HistogramPoint> {
        self.histograms.take_waiting()
    }

    /// The histograms `reader` has not read yet (see [`MediaQueue`]: each stays queued until
    /// every writer reading histograms has it).
    pub fn read_histograms(&mut self, reader: u64) -> Vec<HistogramPoint> {
        let iter = self.iter;
        self.histograms.read(reader, iter, Clone::clone).0
    }

    /// Registers a writer that will read the histograms (see [`MediaQueue::subscribe`]).
    pub fn subscribe_histograms(&mut self, reader: u64) {
        let iter = self.iter;
        self.histograms.subscribe(reader, iter);
    }

    /// Forgets a reader of the histograms (see [`MediaQueue::unsubscribe`]).
    pub fn unsubscribe_histograms(&mut self, reader: u64) {
        let iter = self.iter;
        self.histograms.unsubscribe(reader, iter);
    }

    /// Heap bytes held by all histories (for the memory benchmark and `__sizeof__`).
    pub fn heap_bytes(&self) -> usize {
        self.scalars.values().map(|s| s.history.heap_bytes()).sum()
    }
}

/// One scalar of a `StorageState`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalarState {
    pub name: String,
    pub smoothing_hint: bool,
    pub latest: (f64, Iter),
    pub history: HistoryState,
}

/// The scalar part of a `Storage` as plain data: what pickling and checkpoints save. Images and
/// histograms waiting for a writer are not part of it.
#[derive(Debug, Clone, PartialEq)]
pub struct StorageState {
    pub iter: i64,
    pub max_length: usize,
    pub scalars: Vec<ScalarState>,
}

impl Storage {
    /// The scalar state; with `keep`, each history keeps only its newest `keep` entries (what
    /// smoothing over a window of `keep` iterations needs after a resume).
    pub fn state(&self, keep: Option<usize>) -> StorageState {
        StorageState {
            iter: self.iter,
            max_length: self.max_length,
            scalars: self
                .scalars
                .iter()
                .map(|(name, s)| ScalarState {
                    name: name.to_string(),
                    smoothing_hint: s.smoothing_hint,
                    latest: s.latest,
                    history: s.history.state(keep),
                })
                .collect(),
        }
    }

    /// Replaces the scalars and the iteration with `state`'s (queued histograms stay).
    pub fn load_state(&mut self, state: StorageState) -> Result<()> {
        if state.max_length == 0 {
            return Err(Error::BadMaxLength(0));
        }
        let iter = crate::iter::exact_iter("the state's iter", state.iter)?;
        for s in &state.scalars {
            if let Iter::Int(i) = s.latest.1 {
                crate::iter::exact_iter(&format!("the state's iteration of '{}'", s.name), i)?;
            }
        }
        let mut scalars = IndexMap::with_capacity_and_hasher(state.scalars.len(), FxBuildHasher);
        for s in state.scalars {
            let history = History::from_state(s.history)?;
            scalars.insert(
                Arc::from(s.name.as_str()),
                Scalar {
                    history,
                    smoothing_hint: s.smoothing_hint,
                    latest: s.latest,
                },
            );
        }
        self.scalars = scalars;
        self.iter = iter;
        self.max_length = state.max_length;
        self.deferred_at = None;
        self.read_first.clear();
        self.unput.clear();
        self.forgotten.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage() -> Storage {
        Storage::new(0, History::DEFAULT_MAX_LENGTH, 8).unwrap()
    }

    fn names(s: &Storage) -> Vec<&str> {
        s.scalars().map(|(n, _)| n).collect()
    }

    #[test]
    fn a_name_read_before_its_put_keeps_the_place_of_the_read() {
        let mut s = storage();
        s.put_scalar("loss", 1.0, true, None).unwrap();
        s.read_history("val_loss").unwrap();
        s.put_scalar("lr", 0.1, false, None).unwrap();
        // Listed where it was read; invisible to writers until put.
        let listed = |s: &Storage| -> Vec<String> {
            s.history_names().iter().map(|n| n.to_string()).collect()
        };
        assert_eq!(listed(&s), ["loss", "val_loss", "lr"]);
        assert_eq!(names(&s), ["loss", "lr"]);
        assert!(s.scalar("val_loss").is_err());
        assert!(s.has_history("val_loss"));
        assert_eq!(s.history_mut("val_loss").unwrap().len(), 0);
        // A value added through the read history is kept by the first put.
        s.history_mut("val_loss")
            .unwrap()
            .update(7.0, Some(Iter::Int(0)));
        s.set_iter(3).unwrap();
        s.put_scalar("val_loss", 2.0, false, None).unwrap();
        assert_eq!(listed(&s), ["loss", "val_loss", "lr"]);
        // The latest values keep detectron2's first-put order.
        assert_eq!(names(&s), ["loss", "lr", "val_loss"]);
        assert_eq!(s.scalar("val_loss").unwrap().history.len(), 2);
        // A name read first and at the end, before anything was put after it.
        s.read_history("test").unwrap();
        s.read_history("loss").unwrap(); // known: unchanged
        assert_eq!(listed(&s), ["loss", "val_loss", "lr", "test"]);
    }

    #[test]
    fn deferred_names_keep_the_place_of_their_put() {
        let mut s = storage();
        s.put_scalar("early", 1.0, true, None).unwrap();
        s.mark_deferred(); // iteration 0's losses wait
        s.put_scalar("time", 0.1, true, None).unwrap();
        s.put_scalar("lr", 0.1, false, None).unwrap();
        s.mark_deferred(); // iteration 1's: the first mark stands
        s.put_scalar("val_loss", 2.0, false, None).unwrap();
        // The settle: two batches (an earlier copy, then the rest), then the end.
        let first = s.len();
        s.put_scalar("total_loss", 1.0, true, None).unwrap();
        s.put_scalar("early", 1.0, true, None).unwrap(); // known names stay where they are
        s.place_deferred(first);
        let second = s.len();
        s.put_scalar("loss_b", 1.0, true, None).unwrap();
        s.place_deferred(second);
        s.end_deferred();
        assert_eq!(
            names(&s),
            ["early", "total_loss", "loss_b", "time", "lr", "val_loss"]
        );
        // Without a mark, a put lands at the end.
        s.put_scalar("new", 1.0, true, None).unwrap();
        let end = s.len();
        s.place_deferred(end - 1);
        assert_eq!(names(&s).last(), Some(&"new"));
    }

    #[test]
    fn a_forgotten_name_keeps_its_hint_and_starts_a_new_history_last() {
        let mut s = storage();
        s.put_scalar("loss", 1.0, true, None).unwrap();
        s.put_scalar("val_loss", 2.0, false, None).unwrap();
        s.read_history("val_acc").unwrap(); // read first, listed after val_loss
        s.put_scalar("lr", 0.1, false, None).unwrap();
        assert!(s.forget("val_loss"));
        assert!(s.forget("val_acc"));
        assert!(!s.forget("val_loss") && !s.forget("never"));
        assert_eq!(names(&s), ["loss", "lr"]);
        let listed: Vec<String> = s.history_names().iter().map(|n| n.to_string()).collect();
        assert_eq!(listed, ["loss", "lr"]);
        assert!(s.scalar("val_loss").is_err() && !s.has_history("val_acc"));
        // The hint stays (detectron2's _smoothing_hints), listed after the scalars'.
        let hints: Vec<(String, bool)> = s
            .smoothing_hints()
            .iter()
            .map(|(n, h)| (n.to_string(), *h))
            .collect();
        let expect = [("loss", true), ("lr", false), ("val_loss", false)];
        assert_eq!(hints, expect.map(|(n, h)| (n.to_string(), h)));
        // A put with another hint is refused, now or deferred, and changes nothing.
        assert!(matches!(
            s.put_scalar("val_loss", 3.0, true, None),
            Err(Error::HintChanged {
                old: false,
                new: true,
                ..
            })
        ));
        assert!(s.resolve_put("val_loss", true, None).is_err());
        assert_eq!(s.smoothing_hints().len(), 3);
        // The same hint: a new history of one value, listed last.
        s.set_iter(5).unwrap();
        s.put_scalar("val_loss", 3.0, false, None).unwrap();
        assert_eq!(names(&s), ["loss", "lr", "val_loss"]);
        let val = s.scalar("val_loss").unwrap();
        assert_eq!((val.history.len(), val.latest), (1, (3.0, Iter::Int(5))));
        assert_eq!(s.smoothing_hints().len(), 3);
    }

    #[test]
    fn forgetting_keeps_the_places_of_reads_and_deferred_puts() {
        let mut s = storage();
        s.put_scalar("a", 1.0, true, None).unwrap();
        s.put_scalar("b", 1.0, true, None).unwrap();
        s.read_history("r").unwrap(); // after b
        s.put_scalar("c", 1.0, true, None).unwrap();
        s.forget("a");
        let listed: Vec<String> = s.history_names().iter().map(|n| n.to_string()).collect();
        assert_eq!(listed, ["b", "r", "c"]);
        // A history assigned to a forgotten name takes its hint back.
        s.put_scalar("h", 1.0, false, None).unwrap();
        s.forget("h");
        let mut history = History::new(4).unwrap();
        history.update(2.0, Some(Iter::Int(1)));
        s.set_history("h", history).unwrap();
        assert!(!s.scalar("h").unwrap().smoothing_hint);
        // A deferral's mark past the forgotten name moves up with the names.
        s.mark_deferred(); // the losses of this iteration wait: their place is after h
        s.put_scalar("x", 1.0, true, None).unwrap(); // put meanwhile
        s.forget("b");
        let first = s.len();
        s.put_scalar("loss", 1.0, true, None).unwrap(); // the settle
        s.place_deferred(first);
        assert_eq!(names(&s), ["c", "h", "loss", "x"]);
    }

    #[test]
    fn put_and_read_back() {
        let mut s = storage();
        s.put_scalar("loss", 1.0, true, None).unwrap();
        s.step().unwrap();
        s.put_scalar("loss", 3.0, true, None).unwrap();
        let loss = s.scalar("loss").unwrap();
        assert_eq!(loss.latest, (3.0, Iter::Int(1)));
        assert_eq!(
            loss.history.values(),
            vec![(1.0, Iter::Int(0)), (3.0, Iter::Int(1))]
        );
    }

    #[test]
    fn set_history_keeps_a_known_names_latest_value() {
        let mut s = storage();
        s.put_scalar("lr", 0.1, false, None).unwrap();
        let mut h = History::new(10).unwrap();
        h.update(9.0, Some(Iter::Int(0)));
        h.update(8.0, Some(Iter::Int(3)));
        s.set_history("lr", h.clone()).unwrap();
        let lr = s.scalar("lr").unwrap();
        assert_eq!((lr.latest, lr.smoothing_hint), ((0.1, Iter::Int(0)), false));
        assert_eq!(lr.history.len(), 2);
        s.set_history("new", h).unwrap();
        let new = s.scalar("new").unwrap();
        assert_eq!(
            (new.latest, new.smoothing_hint),
            ((8.0, Iter::Int(3)), true)
        );
    }

    #[test]
    fn hint_change_is_an_error_and_stores_nothing() {
        let mut s = storage();
        s.put_scalar("lr", 0.1, false, None).unwrap();
        s.set_iter(120).unwrap();
        let err = s.put_scalar("lr", 0.2, true, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "smoothing_hint for 'lr' changed from False to True at iter 120"
        );
        assert_eq!(s.scalar("lr").unwrap().history.len(), 1);
    }

    #[test]
    fn a_deferred_put_keeps_the_scope_and_iteration_of_when_it_was_made() {
        let mut s = storage();
        s.put_scalar("val/lr", 0.1, false, None).unwrap();
        s.set_prefix("val/".into());
        s.set_iter(7).unwrap();
        let (name, iter) = s.resolve_put("acc", true, None).unwrap();
        assert_eq!((name.as_str(), iter), ("val/acc", Iter::Int(7)));
        // The hint is checked when the put is made, against what is stored by then.
        let err = s.resolve_put("lr", true, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "smoothing_hint for 'val/lr' changed from False to True at iter 7"
        );
        s.set_prefix(String::new());
        s.set_iter(9).unwrap();
        s.put_at(&name, 0.5, true, iter).unwrap();
        assert_eq!(s.scalar("val/acc").unwrap().latest, (0.5, Iter::Int(7)));
        assert_eq!(
            s.resolve_put("x", true, Some(Iter::Int(3))).unwrap(),
            ("x".to_owned(), Iter::Int(3))
        );
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
    fn prefix_is_per_thread() {
        let mut s = storage();
        s.set_prefix("val/".into());
        let mut s = std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    assert_eq!(s.prefix(), "");
                    s.put_scalar("loss", 1.0, true, None).unwrap();
                    s
                })
                .join()
                .unwrap()
        });
        assert!(s.scalar("loss").is_ok());
        assert_eq!(s.prefix(), "val/");
        s.set_prefix(String::new());
        assert_eq!(s.prefix(), "");
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
            s.set_iter(i).unwrap();
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

    #[test]
    fn state_round_trips() {
        let mut s = storage();
        for i in 0..30 {
            s.set_iter(i).unwrap();
            s.put_scalar("loss", i as f64, true, None).unwrap();
            s.put_scalar("lr", 0.1, false, None).unwrap();
        }
        let mut back = Storage::new(0, 5, 8).unwrap();
        back.load_state(s.state(None)).unwrap();
        assert_eq!(back.iter(), 29);
        assert_eq!(back.state(None), s.state(None));
        assert_eq!(
            back.latest_with_smoothing_hint(20).unwrap(),
            s.latest_with_smoothing_hint(20).unwrap()
        );
        // Keeping the last 20 entries is enough for the same smoothed values.
        let mut recent = storage();
        recent.load_state(s.state(Some(20))).unwrap();
        assert_eq!(
            recent.latest_with_smoothing_hint(20).unwrap(),
            s.latest_with_smoothing_hint(20).unwrap()
        );
        assert_eq!(recent.scalar("loss").unwrap().history.len(), 20);
    }

    #[test]
    fn step_at_the_top_is_an_error() {
        let top = crate::iter::MAX_EXACT_ITER;
        let mut s = Storage::new(top, 4, 4).unwrap();
        assert!(matches!(s.step(), Err(Error::OutOfRange { .. })));
        assert_eq!(s.iter(), top);
    }

    #[test]
    fn every_way_in_of_an_iteration_keeps_it_exact() {
        let top = crate::iter::MAX_EXACT_ITER;
        let out_of_range = |r: Result<()>, what: &str| match r {
            Err(Error::OutOfRange { what: w, .. }) => assert_eq!(w, what),
            other => panic!("{what}: {other:?}"),
        };
        for bad in [top + 1, -top - 1, i64::MAX, i64::MIN] {
            out_of_range(Storage::new(bad, 4, 4).map(drop), "start_iter");
            let mut s = Storage::new(-top, 4, 4).unwrap();
            out_of_range(s.set_iter(bad), "EventStorage.iter");
            assert_eq!(s.iter(), -top);
            let mut state = s.state(None);
            state.iter = bad;
            out_of_range(s.load_state(state), "the state's iter");
        }
    }
}
