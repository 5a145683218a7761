//! `MediaQueue`: the images and histograms a storage holds until its writers take them.
//!
//! detectron2 lets one writer take them (`TensorboardXWriter` reads `_vis_data`, then calls
//! `clear_images()`); hookloop's TensorBoard, MLflow and W&B writers each want every one. The
//! rule, in one place:
//!
//! - A writer reads through its reader id ([`MediaQueue::read`]) and gets each item put since
//!   its last read, once. An item stays queued until every reader the queue knows has read it.
//! - A reader is known from its first read or [`MediaQueue::subscribe`] (`PeriodicWriter`
//!   subscribes its writers before training). One that comes later, in the iteration where the
//!   others took an item, still gets it: the item is retired, not dropped, until the iteration
//!   moves on. So writers called one after the other at one iteration (a hand-written loop's
//!   `for w in writers: w.write()`) each get the items, whoever reads first.
//! - At most `max` items wait (retired ones aside); past that the oldest is dropped, so a
//!   reader that stopped reading holds no more than the bound.
//! - A reader that unsubscribes ([`MediaQueue::unsubscribe`], a closed writer) is forgotten:
//!   nothing waits for it any more (what the remaining readers have all read is retired).
//! - `take` (detectron2's `clear_images`, a writer of its own that reads `_vis_data`) empties
//!   the queue for everyone.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

/// A reader id no other writer in the process has.
pub fn new_reader_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A bounded queue of items read by several readers, each item kept until all have read it.
/// Items are numbered in put order (`seq`); a reader's cursor is the next number it reads.
#[derive(Debug)]
pub struct MediaQueue<T> {
    /// `retired` items that every known reader has read, then the waiting ones, oldest first.
    items: VecDeque<T>,
    /// The number of `items[0]`.
    first_seq: u64,
    /// How many of the first items are retired, and the iteration that retired them.
    retired: usize,
    retired_iter: i64,
    /// (reader id, next number it reads).
    readers: Vec<(u64, u64)>,
    max: usize,
    dropped: u64,
}

impl<T> MediaQueue<T> {
    /// An empty queue holding at most `max` waiting items (`max` is at least 1).
    pub fn new(max: usize) -> Self {
        MediaQueue {
            items: VecDeque::new(),
            first_seq: 0,
            retired: 0,
            retired_iter: i64::MIN,
            readers: Vec::new(),
            max: max.max(1),
            dropped: 0,
        }
    }

    fn next_seq(&self) -> u64 {
        self.first_seq + self.items.len() as u64
    }

    /// Drops the items an earlier iteration retired (returned: Python objects are released by
    /// the caller after its lock).
    fn expire(&mut self, iter: i64, out: &mut Vec<T>) {
        if self.retired > 0 && iter != self.retired_iter {
            out.extend(self.items.drain(..self.retired));
            self.first_seq += self.retired as u64;
            self.retired = 0;
        }
    }

    /// Appends `item`, put at iteration `iter`. Returns what left the queue (the oldest
    /// waiting item past the bound, retired items of an earlier iteration), and whether an
    /// item was dropped by the bound for the first time (the caller warns once).
    pub fn push(&mut self, item: T, iter: i64) -> (Vec<T>, bool) {
        let mut out = Vec::new();
        self.expire(iter, &mut out);
        self.items.push_back(item);
        let mut first_drop = false;
        if self.len() > self.max {
            // The oldest waiting item goes; retired ones before it stay (they are read).
            if let Some(item) = self.items.remove(self.retired) {
                out.push(item);
            }
            // Numbers shift down by one past the retired prefix: readers that had not read
            // the dropped item keep their place relative to the rest.
            let dropped_seq = self.first_seq + self.retired as u64;
            for (_, cursor) in &mut self.readers {
                if *cursor > dropped_seq {
                    *cursor -= 1;
                }
            }
            self.dropped += 1;
            first_drop = self.dropped == 1;
        }
        (out, first_drop)
    }

    /// Registers `reader` (if new) at iteration `iter`: it will read every item waiting now,
    /// and those retired at this iteration.
    pub fn subscribe(&mut self, reader: u64, iter: i64) {
        if !self.readers.iter().any(|(r, _)| *r == reader) {
            let start = if self.retired_iter == iter {
                self.first_seq
            } else {
                self.first_seq + self.retired as u64
            };
            self.readers.push((reader, start));
        }
    }

    /// The items `reader` has not read yet, mapped by `f`, oldest first; then retires what
    /// every known reader has read. Also returns what left the queue (see [`Self::push`]).
    pub fn read<R>(
        &mut self,
        reader: u64,
        iter: i64,
        mut f: impl FnMut(&T) -> R,
    ) -> (Vec<R>, Vec<T>) {
        let mut out = Vec::new();
        self.subscribe(reader, iter);
        self.expire(iter, &mut out);
        let next = self.next_seq();
        let first = self.first_seq;
        let mut read = Vec::new();
        for (r, cursor) in &mut self.readers {
            if *r == reader {
                let from = (*cursor).max(first);
                read.extend(self.items.range((from - first) as usize..).map(&mut f));
                *cursor = next;
            }
        }
        self.retire_read(iter);
        (read, out)
    }

    /// Retires, at iteration `iter`, the items every known reader has read.
    fn retire_read(&mut self, iter: i64) {
        let first = self.first_seq;
        let oldest_unread = self.readers.iter().map(|(_, c)| *c).min();
        let oldest_unread = oldest_unread.unwrap_or_else(|| self.next_seq());
        let read_by_all = (oldest_unread.max(first) - first) as usize;
        if read_by_all > self.retired {
            self.retired = read_by_all;
            self.retired_iter = iter;
        }
    }

    /// Forgets `reader` (a closed writer) at iteration `iter`: nothing waits for it any more,
    /// and what the remaining readers have all read is retired. With no reader left, the
    /// waiting items stay waiting (for a writer that comes, or detectron2's `_vis_data`).
    pub fn unsubscribe(&mut self, reader: u64, iter: i64) {
        self.readers.retain(|(r, _)| *r != reader);
        if !self.readers.is_empty() {
            self.retire_read(iter);
        }
    }

    /// How many items `reader` would get from [`Self::read`] at iteration `iter`.
    pub fn unread(&self, reader: u64, iter: i64) -> usize {
        let readable = if self.retired_iter == iter {
            self.first_seq
        } else {
            self.first_seq + self.retired as u64
        };
        let from = match self.readers.iter().find(|(r, _)| *r == reader) {
            Some((_, cursor)) => (*cursor).max(readable),
            None => readable,
        };
        (self.next_seq() - from.min(self.next_seq())) as usize
    }

    /// The waiting items, oldest first (detectron2's `_vis_data` view: retired ones are gone).
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &T> {
        self.items.range(self.retired..)
    }

    /// Every item held, retired ones too (for the garbage collector's traversal).
    pub fn iter_all(&self) -> impl ExactSizeIterator<Item = &T> {
        self.items.iter()
    }

    /// Takes every waiting item out, for everyone, and drops the retired ones (returned too,
    /// after the waiting ones' count: `(waiting, all)`).
    pub fn take(&mut self) -> (usize, Vec<T>) {
        let waiting = self.len();
        let retired = self.retired;
        self.first_seq += self.items.len() as u64;
        self.retired = 0;
        let mut all: Vec<T> = self.items.drain(..).collect();
        // Waiting items first, as `take_waiting` callers want them in put order.
        all.rotate_left(retired);
        (waiting, all)
    }

    /// Takes the waiting items out, for everyone (oldest first); retired ones are dropped.
    pub fn take_waiting(&mut self) -> Vec<T> {
        let (waiting, mut all) = self.take();
        all.truncate(waiting);
        all
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Number of items waiting (retired ones aside).
    pub fn len(&self) -> usize {
        self.items.len() - self.retired
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_reader_takes_everything_once() {
        let mut q = MediaQueue::new(8);
        q.push(1u32, 0);
        q.push(2, 0);
        let (read, _) = q.read(7, 0, |x| *x);
        assert_eq!(read, vec![1, 2]);
        assert!(q.is_empty(), "read by its only reader: nothing waits");
        assert_eq!(q.iter().count(), 0);
        assert_eq!(q.unread(7, 0), 0);
        let (read, _) = q.read(7, 0, |x| *x);
        assert!(read.is_empty());
        let (left, _) = q.push(3, 1);
        assert_eq!(left, vec![1, 2], "retired at iteration 0, released at 1");
        let (read, left) = q.read(7, 1, |x| *x);
        assert_eq!((read, left), (vec![3], vec![]));
    }

    #[test]
    fn every_reader_gets_every_item_whoever_reads_first() {
        let mut q = MediaQueue::new(8);
        q.push(1u32, 5);
        // Neither reader known before: the second one, at the same iteration, still gets it.
        assert_eq!(q.read(1, 5, |x| *x).0, vec![1]);
        assert_eq!((q.len(), q.unread(2, 5), q.unread(2, 6)), (0, 1, 0));
        assert_eq!(q.read(2, 5, |x| *x).0, vec![1]);
        q.push(2, 6);
        assert_eq!(q.len(), 1);
        assert_eq!(q.read(2, 6, |x| *x).0, vec![2]);
        assert_eq!(q.len(), 1, "reader 1 has not read it: it waits");
        assert_eq!(q.read(1, 6, |x| *x).0, vec![2]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_subscribed_reader_with_a_longer_period_gets_every_item() {
        let mut q = MediaQueue::new(100);
        q.subscribe(1, 0);
        q.subscribe(2, 0);
        let mut got2 = Vec::new();
        for it in 0..40i64 {
            q.push(it, it);
            if it % 5 == 4 {
                assert_eq!(q.read(1, it, |x| *x).0, ((it - 4)..=it).collect::<Vec<_>>());
            }
            if it % 20 == 19 {
                got2.extend(q.read(2, it, |x| *x).0);
            }
        }
        assert_eq!(got2, (0..40).collect::<Vec<_>>());
    }

    #[test]
    fn a_late_reader_misses_what_an_earlier_iteration_retired() {
        let mut q = MediaQueue::new(8);
        q.push(1u32, 0);
        q.read(1, 0, |x| *x);
        q.push(2, 1);
        assert_eq!(q.read(2, 1, |x| *x).0, vec![2]);
    }

    #[test]
    fn the_bound_drops_the_oldest_waiting_item_and_keeps_cursors_in_place() {
        let mut q = MediaQueue::new(2);
        q.subscribe(1, 0);
        q.subscribe(2, 0);
        q.push(1u32, 0);
        assert_eq!(q.read(1, 0, |x| *x).0, vec![1]);
        q.push(2, 0);
        let (left, first) = q.push(3, 0);
        assert_eq!(
            (left, first),
            (vec![1], true),
            "1 is the oldest waiting (reader 2)"
        );
        assert_eq!(q.read(1, 0, |x| *x).0, vec![2, 3]);
        assert_eq!(q.read(2, 0, |x| *x).0, vec![2, 3]);
        let (left, first) = {
            q.push(4, 0);
            q.push(5, 0)
        };
        assert!(
            left.is_empty() && !first,
            "2 and 3 were retired: 4 and 5 fit"
        );
        let (left, first) = q.push(6, 0);
        assert_eq!((left, first), (vec![4], false));
        assert_eq!(q.read(2, 0, |x| *x).0, vec![5, 6]);
    }

    #[test]
    fn no_reader_keeps_the_newest_max() {
        let mut q = MediaQueue::new(3);
        for i in 0..10u32 {
            q.push(i, 0);
        }
        assert_eq!(q.iter().copied().collect::<Vec<_>>(), vec![7, 8, 9]);
        assert_eq!(q.take_waiting(), vec![7, 8, 9]);
        assert!(q.is_empty());
    }

    #[test]
    fn take_empties_the_queue_for_every_reader() {
        let mut q = MediaQueue::new(8);
        q.push(1u32, 0);
        q.read(1, 0, |x| *x);
        q.push(2, 0);
        q.push(3, 0);
        assert_eq!(q.read(2, 0, |x| *x).0, vec![1, 2, 3]);
        let (waiting, all) = q.take();
        assert_eq!((waiting, all), (2, vec![2, 3, 1]));
        assert!(q.read(1, 0, |x| *x).0.is_empty());
        q.push(4, 1);
        assert_eq!(q.read(1, 1, |x| *x).0, vec![4]);
        assert_eq!(q.read(2, 1, |x| *x).0, vec![4]);
    }

    #[test]
    fn an_unsubscribed_reader_holds_nothing_back() {
        let mut q = MediaQueue::new(2);
        q.subscribe(1, 0);
        q.subscribe(2, 0);
        q.push(1u32, 0);
        assert_eq!(q.read(1, 0, |x| *x).0, vec![1]);
        assert_eq!(q.len(), 1, "reader 2 has not read it");
        q.unsubscribe(2, 0);
        assert!(q.is_empty(), "read by every reader left: retired");
        for i in 2..10u32 {
            let (_, first_drop) = q.push(i, i64::from(i));
            assert!(!first_drop, "reader 1 reads each one: none dropped");
            assert_eq!(q.read(1, i64::from(i), |x| *x).0, vec![i]);
        }
        q.unsubscribe(1, 10);
        q.push(10, 10);
        assert_eq!(
            q.iter().copied().collect::<Vec<_>>(),
            vec![10],
            "no reader: it waits"
        );
        assert_eq!(q.read(3, 10, |x| *x).0, vec![10]);
    }
}
