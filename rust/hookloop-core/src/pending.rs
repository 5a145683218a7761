//! The storage's one queue of scalars put but not read yet.
//!
//! A value that would cost a device synchronization to read now (a trainer's losses kept as
//! tensors, `put_scalar` of a CUDA tensor, later a CUDA graph's ring buffer) waits here with
//! the name and iteration fixed when it was put. Its value is read later, in one batch with
//! every other waiting value, and then stored by the same rules as an immediate put:
//! [`crate::metrics::write_metrics`] for a trainer's losses, [`Storage::put_at`] for a put.
//!
//! The queue does not read values itself (they are the caller's objects: `V` is a Python
//! tensor in the binding); it decides, and the caller executes: when a read is due ([`Due`]),
//! what a read does now ([`Action`]: raise a failure kept for this thread, start a read, or
//! read), in which order the taken reads are finished and when they stop ([`Reading`]), and
//! it applies the values read ([`Pending::store`]). A read of a whole waiting batch may be
//! *started* (a copy to the host not waited for, handle `H`) and finished at the next read of
//! the storage.
//!
//! Invariant: batches are applied in the order their values were put, so each history keeps
//! its values in order, and the names they create keep the place of their put
//! ([`Storage::mark_deferred`]).
//!
//! A non-finite loss belongs to the thread that records the losses (the training thread, the
//! queue's *owner*): a read made on another thread (a dashboard polling `latest()`) that finds
//! one keeps it ([`Read::Kept`]) and the owner gets it at its next record, read or save, still
//! naming its iteration. Once one was found, every save is refused ([`Pending::before_save`]):
//! the weights are those it made.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::ThreadId;

use crate::iter::Iter;
use crate::metrics::{write_metrics, Reduced};
use crate::storage::Storage;
use crate::{Error, Result};

/// One waiting put.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// One iteration's losses of one process (`SimpleTrainer.write_metrics`'s rule at the
    /// read): `data_time`, then the names in the loss dict's order, one value each. The
    /// names are shared: a model returns the same losses every step.
    Losses {
        iter: Iter,
        data_time: f64,
        prefix: String,
        names: Arc<[String]>,
    },
    /// A `put_scalar` of one value: its full name (name scope applied) and iteration, as
    /// [`Storage::resolve_put`] fixed them when it was made.
    Put {
        name: String,
        hint: bool,
        iter: Iter,
    },
}

impl Record {
    /// How many values the record waits for.
    pub fn len(&self) -> usize {
        match self {
            Record::Losses { names, .. } => names.len(),
            Record::Put { .. } => 1,
        }
    }

    /// Whether the record waits for no value (a trainer's empty loss dict still records its
    /// data time).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// When the queue reads what waits, besides every read of the storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// At this many waiting iterations of losses, their read is due (started, or done).
    pub read_every: usize,
    /// At most this many started reads wait to be finished; past that, a due read is done.
    pub max_started: usize,
    /// At this many waiting values, a read is due whatever they are: a storage that is never
    /// read holds a bounded number of tensors.
    pub max_values: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            read_every: 20,
            max_started: 50,
            max_values: 1024,
        }
    }
}

/// What a put asks of the caller after queueing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Nothing: the values wait.
    Nothing,
    /// The waiting batch's read is due: start it if its values allow (a copy not waited for),
    /// else read everything now.
    Start,
    /// Read everything now.
    Read,
}

/// Records waiting with their values, in put order.
#[derive(Debug)]
pub struct Batch<V> {
    pub records: Vec<Record>,
    pub values: Vec<V>,
}

impl<V> Default for Batch<V> {
    fn default() -> Self {
        Batch {
            records: Vec::new(),
            values: Vec::new(),
        }
    }
}

/// A batch whose read was started: its records and the read's handle.
#[derive(Debug)]
pub struct Started<H> {
    pub records: Vec<Record>,
    pub read: H,
}

/// Everything a read takes from the queue: the started reads first, then the waiting batch.
#[derive(Debug)]
pub struct Taken<V, H> {
    pub started: Vec<Started<H>>,
    pub waiting: Batch<V>,
}

/// What a reader does now, under the queue's settle lock ([`Pending::settle`],
/// [`Pending::due_read`]); the caller executes it without the storage's lock.
#[derive(Debug)]
pub enum Action<V, H> {
    /// Raise `error`, a failure another thread's read kept for this one, before reading
    /// anything: `dropped` (what waited, all queued after it) is released unread.
    Raise { error: Error, dropped: Taken<V, H> },
    /// Start the read of `batch` (a copy to the host not waited for) and hand its handle to
    /// [`Pending::started`] with `started` (the reads started earlier). A batch whose read
    /// cannot start is read now instead: a [`Reading`] of `Taken { started, waiting: batch }`.
    Start {
        started: Vec<Started<H>>,
        batch: Batch<V>,
    },
    /// Read everything taken now ([`Reading`]).
    Read(Taken<V, H>),
}

/// One step of a [`Reading`].
#[derive(Debug)]
pub enum Step<V, H> {
    /// Wait for a started read's values, then store them ([`Pending::store`]).
    Finish(Started<H>),
    /// Read the waiting batch's values now, then store them and end the read
    /// ([`Pending::store`], [`Pending::end_read`]) under one lock.
    Read(Batch<V>),
}

/// A read of what was taken, in put order: each started read is finished, then the waiting
/// batch is read. The first step whose values are not stored (an error, or a non-finite loss
/// kept for the owner) stops it: what comes after is dropped unread.
#[derive(Debug)]
pub struct Reading<V, H> {
    started: std::vec::IntoIter<Started<H>>,
    waiting: Option<Batch<V>>,
}

impl<V, H> Reading<V, H> {
    pub fn new(taken: Taken<V, H>) -> Self {
        let Taken { started, waiting } = taken;
        Reading {
            started: started.into_iter(),
            waiting: (!waiting.records.is_empty()).then_some(waiting),
        }
    }

    /// The next step; None when the reading is over.
    pub fn next_step(&mut self) -> Option<Step<V, H>> {
        match self.started.next() {
            Some(s) => Some(Step::Finish(s)),
            None => self.waiting.take().map(Step::Read),
        }
    }

    /// After a step: the reading goes on only when its values were stored (`stored`).
    pub fn after_step(&mut self, stored: bool) {
        if !stored {
            self.stop();
        }
    }

    fn stop(&mut self) {
        self.started = Vec::new().into_iter();
        self.waiting = None;
    }

    /// What the reading has not reached (released by the caller after the lock).
    pub fn into_rest(self) -> (Vec<Started<H>>, Option<Batch<V>>) {
        (self.started.collect(), self.waiting)
    }
}

/// What a read of one batch ([`Pending::store`]) tells its reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// Stored: read the next batch.
    Stored,
    /// A non-finite loss stopped the batch on a thread that is not the owner: what came before
    /// it is stored, the rest is dropped, and the error waits for the owner. The reader gets
    /// the storage as it is (its values are finite).
    Kept,
}

/// The first non-finite loss a read found (what `Error::NonFiniteLoss` says).
#[derive(Debug, Clone, PartialEq)]
struct Failure {
    iter: Iter,
    losses: Vec<(String, f64)>,
}

impl Failure {
    fn error(&self) -> Error {
        Error::NonFiniteLoss {
            iter: self.iter,
            losses: self.losses.clone(),
        }
    }
}

/// The queue. `V`: a value not read yet; `H`: a started read.
#[derive(Debug)]
pub struct Pending<V, H> {
    waiting: Batch<V>,
    /// `Losses` records in `waiting`.
    waiting_iterations: usize,
    started: Vec<Started<H>>,
    /// The names of the waiting and started `Put`s: a plain put under one of them must read
    /// the queue first, so its history keeps the order of the puts.
    put_names: HashSet<String>,
    pub limits: Limits,
    /// The thread that records the losses ([`Pending::recording`]).
    owner: Option<ThreadId>,
    /// The first non-finite loss found, for the queue's lifetime (a storage's run).
    failed: Option<Failure>,
    /// Whether `failed` was found on another thread and the owner has not had it yet.
    kept: bool,
}

impl<V, H> Default for Pending<V, H> {
    fn default() -> Self {
        Pending {
            waiting: Batch::default(),
            waiting_iterations: 0,
            started: Vec::new(),
            put_names: HashSet::new(),
            limits: Limits::default(),
            owner: None,
            failed: None,
            kept: false,
        }
    }
}

impl<V, H> Pending<V, H> {
    /// Whether nothing waits (no value, no started read).
    pub fn is_empty(&self) -> bool {
        self.waiting.records.is_empty() && self.started.is_empty()
    }

    /// Queues one iteration's losses (names and values in the same order); `storage` marks
    /// where the names they create belong.
    pub fn push_losses(
        &mut self,
        storage: &mut Storage,
        iter: Iter,
        data_time: f64,
        prefix: String,
        names: Arc<[String]>,
        values: Vec<V>,
    ) -> Result<Due> {
        if names.len() != values.len() {
            return Err(Error::bad_value(
                "pending losses",
                format!("{} names for {} values", names.len(), values.len()),
            ));
        }
        storage.mark_deferred();
        self.waiting.records.push(Record::Losses {
            iter,
            data_time,
            prefix,
            names,
        });
        self.waiting.values.extend(values);
        self.waiting_iterations += 1;
        Ok(self.due())
    }

    /// Queues a put of one value under the full name and iteration fixed now.
    pub fn push_put(
        &mut self,
        storage: &mut Storage,
        name: String,
        hint: bool,
        iter: Iter,
        value: V,
    ) -> Due {
        storage.mark_deferred();
        self.put_names.insert(name.clone());
        self.waiting.records.push(Record::Put { name, hint, iter });
        self.waiting.values.push(value);
        self.due()
    }

    fn due(&self) -> Due {
        if self.waiting.values.len() >= self.limits.max_values {
            Due::Read
        } else if self.waiting_iterations >= self.limits.read_every {
            Due::Start
        } else {
            Due::Nothing
        }
    }

    /// Whether a put under the full name `name` waits.
    pub fn waits_for(&self, name: &str) -> bool {
        !self.put_names.is_empty() && self.put_names.contains(name)
    }

    /// Whether a started read may be added (fewer than `max_started` wait).
    fn may_start(&self) -> bool {
        self.started.len() < self.limits.max_started
    }

    /// Takes everything (for a read, or to release the values held).
    pub fn take(&mut self) -> Taken<V, H> {
        self.waiting_iterations = 0;
        self.put_names.clear();
        Taken {
            started: std::mem::take(&mut self.started),
            waiting: std::mem::take(&mut self.waiting),
        }
    }

    /// How many values wait, and how many started reads.
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.values.len(), self.started.len())
    }

    /// The values and started reads held (for a garbage collector's traversal).
    pub fn held(&self) -> (impl Iterator<Item = &V>, impl Iterator<Item = &H>) {
        (
            self.waiting.values.iter(),
            self.started.iter().map(|s| &s.read),
        )
    }

    /// Before `thread` queues losses: it is the owner from now on, and gets the failure kept
    /// for it (raised before this record is queued, naming the iteration it happened at).
    pub fn recording(&mut self, thread: ThreadId) -> Result<()> {
        self.owner = Some(thread);
        self.take_kept(thread).map_or(Ok(()), Err)
    }

    /// The failure kept for the owner, when `reader` is the owner (a read on the owner thread
    /// raises it before reading anything: what waits came after it). None elsewhere.
    fn take_kept(&mut self, reader: ThreadId) -> Option<Error> {
        if !self.kept || !self.is_owner(reader) {
            return None;
        }
        self.kept = false;
        self.failed.as_ref().map(Failure::error)
    }

    /// Whether a failure waits for the owner (every read must then reach the queue).
    pub fn keeps_failure(&self) -> bool {
        self.kept
    }

    fn is_owner(&self, reader: ThreadId) -> bool {
        !matches!(self.owner, Some(o) if o != reader)
    }

    /// [`apply`] on `reader`'s thread: a non-finite loss is the reader's error on the owner
    /// thread; on another thread it is kept for the owner ([`Read::Kept`]). The first one
    /// found is remembered for [`Pending::before_save`].
    pub fn store(
        &mut self,
        storage: &mut Storage,
        records: &[Record],
        values: &[f64],
        reader: ThreadId,
    ) -> Result<Read> {
        match apply(storage, records, values) {
            Ok(()) => Ok(Read::Stored),
            Err(Error::NonFiniteLoss { iter, losses }) => {
                let found = Failure { iter, losses };
                let first = self.failed.get_or_insert_with(|| found.clone()).error();
                if self.is_owner(reader) {
                    // An earlier one kept for the owner comes first.
                    let error = if self.kept { first } else { found.error() };
                    self.kept = false;
                    Err(error)
                } else {
                    self.kept = true;
                    Ok(Read::Kept)
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Before a checkpoint is saved (after a read of everything waiting): the first non-finite
    /// loss found, if any, refuses it, whichever thread found it and whether or not it was
    /// raised before. The owner has it then.
    pub fn before_save(&mut self, reader: ThreadId) -> Result<()> {
        let Some(failed) = &self.failed else {
            return Ok(());
        };
        let error = failed.error();
        if self.is_owner(reader) {
            self.kept = false;
        }
        Err(error)
    }

    /// A read of everything waiting, on `reader`'s thread (every read of the storage first):
    /// on the owner thread, a failure another thread's read kept is raised instead, and what
    /// waits (queued after it) is dropped; else everything is read.
    pub fn settle(&mut self, storage: &mut Storage, reader: ThreadId) -> Action<V, H> {
        match self.take_kept(reader) {
            Some(error) => {
                let dropped = self.take();
                self.end_read(storage);
                Action::Raise { error, dropped }
            }
            None => Action::Read(self.take()),
        }
    }

    /// A read that [`Due::Start`] made due: the waiting batch's read is started while fewer
    /// than `max_started` started reads wait; else (or with no value waiting) everything is
    /// read now.
    pub fn due_read(&mut self) -> Action<V, H> {
        let may_start = self.may_start();
        let Taken { started, waiting } = self.take();
        if may_start && !waiting.values.is_empty() {
            Action::Start {
                started,
                batch: waiting,
            }
        } else {
            Action::Read(Taken { started, waiting })
        }
    }

    /// The read of [`Action::Start`]'s batch started (`read`, its handle): it waits with
    /// `started` (the reads started earlier) ahead of anything queued since the take, and
    /// their put names wait again. Returns the batch's values (released after the lock).
    pub fn started(&mut self, mut started: Vec<Started<H>>, batch: Batch<V>, read: H) -> Vec<V> {
        started.push(Started {
            records: batch.records,
            read,
        });
        self.restore_started(started);
        batch.values
    }

    /// After a read, under the same lock as its last store: the storage's deferred place ends
    /// when nothing waits. Returns whether a failure waits for the owner (every later read
    /// must then reach the queue).
    pub fn end_read(&mut self, storage: &mut Storage) -> bool {
        if self.is_empty() {
            storage.end_deferred();
        }
        self.kept
    }

    /// Gives back what [`Pending::take`] took when the waiting batch's read was started
    /// instead of done: `started` (the reads started earlier, then this one) go ahead of
    /// anything queued since the take. Their put names wait again.
    fn restore_started(&mut self, mut started: Vec<Started<H>>) {
        for s in &started {
            for r in &s.records {
                if let Record::Put { name, .. } = r {
                    self.put_names.insert(name.clone());
                }
            }
        }
        started.append(&mut self.started);
        self.started = started;
    }
}

/// Stores `values` (read from a batch's values, in order) under `records` by the rules of an
/// immediate put, then moves the names they created to where the puts were made. Stops at the
/// first error (a non-finite total loss is `Error::NonFiniteLoss` naming its iteration); the
/// values before it are stored.
pub fn apply(storage: &mut Storage, records: &[Record], values: &[f64]) -> Result<()> {
    let wanted: usize = records.iter().map(Record::len).sum();
    if wanted != values.len() {
        return Err(Error::bad_value(
            "pending values",
            format!("{} values read for {wanted} waiting", values.len()),
        ));
    }
    let first_new = storage.len();
    let mut rest = values;
    let mut result = Ok(());
    for record in records {
        let (mine, after) = rest.split_at(record.len());
        rest = after;
        result = match record {
            Record::Losses {
                iter,
                data_time,
                prefix,
                names,
            } => {
                let losses: Vec<(&str, f64)> = names
                    .iter()
                    .map(String::as_str)
                    .zip(mine.iter().copied())
                    .collect();
                let reduced = Reduced {
                    data_time: *data_time,
                    losses: &losses,
                };
                write_metrics(storage, *iter, prefix, *data_time, Some(reduced))
            }
            Record::Put { name, hint, iter } => storage.put_at(name, mine[0], *hint, *iter),
        };
        if result.is_err() {
            break;
        }
    }
    storage.place_deferred(first_new);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage() -> Storage {
        Storage::new(0, 100, 10).unwrap()
    }

    fn losses(q: &mut Pending<f64, ()>, s: &mut Storage, it: i64, v: f64) -> Due {
        let names: Arc<[String]> = Arc::from(["a".to_owned(), "b".to_owned()]);
        q.push_losses(
            s,
            Iter::Int(it),
            0.5,
            String::new(),
            names,
            vec![v, 2.0 * v],
        )
        .unwrap()
    }

    /// The storage's names in `histories()` order.
    fn names(s: &Storage) -> Vec<String> {
        s.history_names().iter().map(|n| n.to_string()).collect()
    }

    fn read_all(q: &mut Pending<f64, ()>, s: &mut Storage) -> Result<()> {
        let taken = q.take();
        let r = apply(s, &taken.waiting.records, &taken.waiting.values);
        if q.is_empty() {
            s.end_deferred();
        }
        r
    }

    #[test]
    fn losses_are_stored_with_write_metrics_rule_at_their_iterations() {
        let mut s = storage();
        let mut q = Pending::default();
        for it in 0..3 {
            assert_eq!(losses(&mut q, &mut s, it, it as f64), Due::Nothing);
        }
        assert!(s.is_empty(), "nothing is stored before the read");
        read_all(&mut q, &mut s).unwrap();
        assert!(q.is_empty());
        assert_eq!(
            names(&s),
            ["rank_data_time", "data_time", "total_loss", "a", "b"]
        );
        let total = s.scalar("total_loss").unwrap().history.values();
        let it = Iter::Int;
        assert_eq!(total, [(0.0, it(0)), (3.0, it(1)), (6.0, it(2))]);
    }

    #[test]
    fn the_read_is_due_every_read_every_iterations_and_at_the_value_bound() {
        let mut s = storage();
        let mut q: Pending<f64, ()> = Pending {
            limits: Limits {
                read_every: 3,
                max_started: 1,
                max_values: 7,
            },
            ..Pending::default()
        };
        assert_eq!(losses(&mut q, &mut s, 0, 1.0), Due::Nothing);
        assert_eq!(losses(&mut q, &mut s, 1, 1.0), Due::Nothing);
        assert_eq!(losses(&mut q, &mut s, 2, 1.0), Due::Start);
        let taken = q.take();
        assert_eq!(taken.waiting.records.len(), 3);
        q.restore_started(vec![Started {
            records: taken.waiting.records,
            read: (),
        }]);
        assert!(!q.may_start(), "one started read is the bound here");
        assert_eq!(losses(&mut q, &mut s, 3, 1.0), Due::Nothing);
        // Puts count as values, not iterations: the 7th value makes a read due.
        for i in 0..4 {
            let due = q.push_put(&mut s, "x".into(), true, Iter::Int(3), i as f64);
            assert_eq!(
                due,
                if i == 4 { Due::Read } else { Due::Nothing },
                "put {i}"
            );
        }
        assert_eq!(
            q.push_put(&mut s, "x".into(), true, Iter::Int(3), 9.0),
            Due::Read
        );
    }

    #[test]
    fn started_reads_go_ahead_of_what_was_queued_since() {
        let mut s = storage();
        let mut q: Pending<f64, &str> = Pending::default();
        let names = || Arc::from(vec!["a".to_owned()]);
        q.push_losses(&mut s, Iter::Int(0), 0.0, String::new(), names(), vec![1.0])
            .unwrap();
        let first = q.take();
        // queued while the first read was being started
        q.push_losses(&mut s, Iter::Int(1), 0.0, String::new(), names(), vec![2.0])
            .unwrap();
        q.restore_started(vec![Started {
            records: first.waiting.records,
            read: "copy of iteration 0",
        }]);
        let taken = q.take();
        assert_eq!(taken.started.len(), 1);
        assert_eq!(taken.started[0].read, "copy of iteration 0");
        assert_eq!(taken.waiting.values, [2.0]);
    }

    #[test]
    fn a_plain_put_finds_the_waiting_put_of_its_name() {
        let mut s = storage();
        let mut q: Pending<f64, ()> = Pending::default();
        q.push_put(&mut s, "lr".into(), false, Iter::Int(0), 0.1);
        assert!(q.waits_for("lr") && !q.waits_for("loss"));
        let taken = q.take();
        assert!(!q.waits_for("lr"));
        q.restore_started(vec![Started {
            records: taken.waiting.records,
            read: (),
        }]);
        assert!(q.waits_for("lr"), "a started put still waits");
    }

    #[test]
    fn names_keep_the_place_of_their_put() {
        let mut s = storage();
        let mut q: Pending<f64, ()> = Pending::default();
        losses(&mut q, &mut s, 0, 1.0);
        s.put_scalar("lr", 0.1, false, None).unwrap(); // put while the losses wait
        read_all(&mut q, &mut s).unwrap();
        assert_eq!(
            names(&s),
            ["rank_data_time", "data_time", "total_loss", "a", "b", "lr"]
        );
    }

    #[test]
    fn a_non_finite_total_stops_the_read_at_its_iteration() {
        let mut s = storage();
        let mut q: Pending<f64, ()> = Pending::default();
        losses(&mut q, &mut s, 0, 1.0);
        losses(&mut q, &mut s, 1, f64::NAN);
        losses(&mut q, &mut s, 2, 1.0);
        let err = read_all(&mut q, &mut s).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NonFiniteLoss {
                    iter: Iter::Int(1),
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(s.scalar("total_loss").unwrap().history.values().len(), 1);
    }

    /// Another thread's id (a dashboard polling the storage).
    fn other_thread() -> ThreadId {
        std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap()
    }

    /// Queues iterations `0..n` from `owner`, NaN at `nan_at`.
    fn recorded(owner: ThreadId, n: i64, nan_at: i64) -> (Pending<f64, ()>, Storage) {
        let mut s = storage();
        let mut q = Pending::default();
        for it in 0..n {
            q.recording(owner).unwrap();
            losses(
                &mut q,
                &mut s,
                it,
                if it == nan_at { f64::NAN } else { 1.0 },
            );
        }
        (q, s)
    }

    fn store_all(q: &mut Pending<f64, ()>, s: &mut Storage, reader: ThreadId) -> Result<Read> {
        let taken = q.take();
        q.store(s, &taken.waiting.records, &taken.waiting.values, reader)
    }

    fn failed_at(result: Result<impl std::fmt::Debug>) -> Iter {
        match result {
            Err(Error::NonFiniteLoss { iter, .. }) => iter,
            other => panic!("expected a non-finite loss, got {other:?}"),
        }
    }

    #[test]
    fn a_non_finite_loss_read_on_another_thread_waits_for_the_owners_next_record() {
        let owner = std::thread::current().id();
        let (mut q, mut s) = recorded(owner, 5, 2);
        // The poller gets the finite values stored before it, and no error.
        assert_eq!(
            store_all(&mut q, &mut s, other_thread()).unwrap(),
            Read::Kept
        );
        assert_eq!(s.scalar("total_loss").unwrap().history.values().len(), 2);
        assert!(q.keeps_failure());
        // Another thread's reads never take it; the owner's next record raises it once.
        assert!(q.take_kept(other_thread()).is_none());
        assert_eq!(failed_at(q.recording(owner)), Iter::Int(2));
        assert!(!q.keeps_failure());
        q.recording(owner).unwrap();
    }

    #[test]
    fn the_owners_next_read_raises_the_kept_failure_before_a_later_one() {
        let owner = std::thread::current().id();
        let (mut q, mut s) = recorded(owner, 3, 1);
        assert_eq!(
            store_all(&mut q, &mut s, other_thread()).unwrap(),
            Read::Kept
        );
        // Iteration 7 fails too, read on the owner thread: the kept iteration 1 comes first.
        losses(&mut q, &mut s, 7, f64::NAN);
        assert_eq!(failed_at(store_all(&mut q, &mut s, owner)), Iter::Int(1));
        assert!(q.take_kept(owner).is_none(), "raised once");
        // A read that takes it before reading anything.
        let (mut q, mut s) = recorded(owner, 3, 1);
        store_all(&mut q, &mut s, other_thread()).unwrap();
        assert!(matches!(
            q.take_kept(owner),
            Some(Error::NonFiniteLoss {
                iter: Iter::Int(1),
                ..
            })
        ));
    }

    #[test]
    fn on_the_owner_thread_the_read_raises_and_nothing_is_kept() {
        let owner = std::thread::current().id();
        let (mut q, mut s) = recorded(owner, 3, 1);
        assert_eq!(failed_at(store_all(&mut q, &mut s, owner)), Iter::Int(1));
        assert!(!q.keeps_failure());
        q.recording(owner).unwrap();
    }

    #[test]
    fn every_save_after_a_non_finite_loss_is_refused_whoever_found_it() {
        let owner = std::thread::current().id();
        let (mut q, mut s) = recorded(owner, 3, 9);
        store_all(&mut q, &mut s, owner).unwrap();
        q.before_save(owner).unwrap();
        // Found on the owner and raised there: later saves are refused all the same.
        let (mut q, mut s) = recorded(owner, 3, 1);
        store_all(&mut q, &mut s, owner).unwrap_err();
        assert_eq!(failed_at(q.before_save(owner)), Iter::Int(1));
        assert_eq!(failed_at(q.before_save(owner)), Iter::Int(1));
        // Found by a poller: the owner's save raises it (and it is not raised again at a record).
        let (mut q, mut s) = recorded(owner, 3, 1);
        store_all(&mut q, &mut s, other_thread()).unwrap();
        assert_eq!(failed_at(q.before_save(other_thread())), Iter::Int(1));
        assert!(q.keeps_failure(), "a save elsewhere does not deliver it");
        assert_eq!(failed_at(q.before_save(owner)), Iter::Int(1));
        q.recording(owner).unwrap();
    }

    #[test]
    fn other_errors_of_a_read_are_the_readers() {
        let owner = std::thread::current().id();
        let (mut q, mut s) = recorded(owner, 1, 9);
        let taken = q.take();
        let err = q
            .store(&mut s, &taken.waiting.records, &[1.0], other_thread())
            .unwrap_err();
        assert!(matches!(err, Error::BadValue { .. }), "{err:?}");
        assert!(!q.keeps_failure());
        q.before_save(owner).unwrap();
    }

    #[test]
    fn a_settle_reads_everything_taken_and_raises_a_kept_failure_on_the_owner_only() {
        let owner = std::thread::current().id();
        let (mut q, mut s) = recorded(owner, 3, 9);
        match q.settle(&mut s, other_thread()) {
            Action::Read(taken) => assert_eq!(taken.waiting.records.len(), 3),
            other => panic!("expected a read, got {other:?}"),
        }
        assert!(q.is_empty());
        // A failure kept for the owner: another thread reads; the owner raises it first and
        // drops what waits (queued after it), and the deferred place ends.
        let (mut q, mut s) = recorded(owner, 3, 1);
        store_all(&mut q, &mut s, other_thread()).unwrap();
        losses(&mut q, &mut s, 3, 1.0);
        assert!(matches!(q.settle(&mut s, other_thread()), Action::Read(_)));
        losses(&mut q, &mut s, 4, 1.0);
        match q.settle(&mut s, owner) {
            Action::Raise { error, dropped } => {
                assert_eq!(failed_at(Err::<(), _>(error)), Iter::Int(1));
                assert_eq!(dropped.waiting.records.len(), 1);
            }
            other => panic!("expected a raise, got {other:?}"),
        }
        assert!(q.is_empty() && !q.keeps_failure());
        losses(&mut q, &mut s, 5, 1.0); // a name created now goes at the end, not deferred
        assert!(matches!(q.settle(&mut s, owner), Action::Read(_)));
    }

    #[test]
    fn a_due_read_starts_the_batch_until_max_started_wait_then_reads_everything() {
        let mut s = storage();
        let mut q: Pending<f64, &str> = Pending {
            limits: Limits {
                read_every: 1,
                max_started: 1,
                max_values: 100,
            },
            ..Pending::default()
        };
        let names = || Arc::from(vec!["a".to_owned()]);
        q.push_losses(&mut s, Iter::Int(0), 0.0, String::new(), names(), vec![1.0])
            .unwrap();
        let Action::Start { started, batch } = q.due_read() else {
            panic!("the first due read starts");
        };
        assert!(started.is_empty() && q.is_empty());
        q.push_losses(&mut s, Iter::Int(1), 0.0, String::new(), names(), vec![2.0])
            .unwrap();
        assert_eq!(q.started(started, batch, "copy of 0"), [1.0]);
        // One started read is the bound: the next due read reads everything, in put order.
        let Action::Read(taken) = q.due_read() else {
            panic!("past max_started, a due read is done now");
        };
        assert_eq!(taken.started.len(), 1);
        assert_eq!(taken.started[0].read, "copy of 0");
        assert_eq!(taken.waiting.values, [2.0]);
        // Nothing waiting to start: a read (of what was started, if anything).
        assert!(matches!(q.due_read(), Action::Read(t) if t.started.is_empty()));
    }

    #[test]
    fn a_reading_finishes_the_started_reads_then_reads_the_batch_and_stops_at_a_failure() {
        let batch = |v: f64| Batch {
            records: vec![Record::Put {
                name: "x".into(),
                hint: true,
                iter: Iter::Int(0),
            }],
            values: vec![v],
        };
        let started = |h: &'static str| Started {
            records: batch(0.0).records,
            read: h,
        };
        let taken = || Taken {
            started: vec![started("a"), started("b")],
            waiting: batch(1.0),
        };
        let mut r = Reading::new(taken());
        let mut order = Vec::new();
        while let Some(step) = r.next_step() {
            order.push(match step {
                Step::Finish(s) => s.read.to_owned(),
                Step::Read(b) => format!("read {:?}", b.values),
            });
            r.after_step(true);
        }
        assert_eq!(order, ["a", "b", "read [1.0]"]);
        // A step not stored stops it: the rest is handed back unread.
        let mut r = Reading::new(taken());
        assert!(matches!(r.next_step(), Some(Step::Finish(s)) if s.read == "a"));
        r.after_step(false);
        assert!(r.next_step().is_none());
        let (rest, waiting) = r.into_rest();
        assert!(rest.is_empty() && waiting.is_none());
        // An empty batch is no step.
        let mut r: Reading<f64, ()> = Reading::new(Taken {
            started: Vec::new(),
            waiting: Batch::default(),
        });
        assert!(r.next_step().is_none());
    }

    #[test]
    fn end_read_ends_the_deferred_place_when_nothing_waits_and_says_a_failure_waits() {
        let owner = std::thread::current().id();
        let (mut q, mut s) = recorded(owner, 1, 9);
        let taken = q.take();
        q.store(&mut s, &taken.waiting.records, &taken.waiting.values, owner)
            .unwrap();
        assert!(!q.end_read(&mut s), "no failure waits");
        // Ended: a put deferred later marks the end as it is then (after "lr").
        s.put_scalar("lr", 0.1, false, None).unwrap();
        q.push_put(&mut s, "y".into(), true, Iter::Int(1), 1.0);
        let taken = q.take();
        q.store(&mut s, &taken.waiting.records, &taken.waiting.values, owner)
            .unwrap();
        assert_eq!(&names(&s)[3..], ["a", "b", "lr", "y"]);
        // Something still waits: the place stays deferred.
        q.push_put(&mut s, "z".into(), true, Iter::Int(1), 1.0);
        losses(&mut q, &mut s, 2, 1.0);
        let taken = q.take();
        q.push_put(&mut s, "w".into(), true, Iter::Int(2), 1.0); // queued during the read
        q.store(&mut s, &taken.waiting.records, &taken.waiting.values, owner)
            .unwrap();
        q.end_read(&mut s);
        s.put_scalar("late", 0.1, false, None).unwrap();
        read_all(&mut q, &mut s).unwrap();
        assert_eq!(&names(&s)[7..], ["z", "w", "late"]);
        // A failure kept for the owner is reported.
        let (mut q, mut s) = recorded(owner, 2, 1);
        store_all(&mut q, &mut s, other_thread()).unwrap();
        assert!(q.end_read(&mut s), "a failure waits for the owner");
    }

    #[test]
    fn a_read_of_the_wrong_length_is_an_error() {
        let mut s = storage();
        let mut q: Pending<f64, ()> = Pending::default();
        losses(&mut q, &mut s, 0, 1.0);
        let taken = q.take();
        let err = apply(&mut s, &taken.waiting.records, &[1.0]).unwrap_err();
        assert!(
            err.to_string().contains("1 values read for 2 waiting"),
            "{err}"
        );
        assert!(q
            .push_losses(
                &mut s,
                Iter::Int(1),
                0.0,
                String::new(),
                Arc::from([]),
                vec![1.0]
            )
            .is_err());
    }
}
