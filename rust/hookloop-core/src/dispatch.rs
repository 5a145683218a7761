//! The hook table: per stage, which hooks run, filtered by period, timed per hook.
//!
//! The binding fills a `Table` with its callables (Python bound methods) and calls, per stage,
//! the entries `due` returns. The period rule of every periodic hook lives here once
//! (`periodic_due`), so a hook that runs every N iterations costs nothing in between.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// A stage of `HookBase`, in the order of `STAGES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    BeforeTrain = 0,
    AfterTrain = 1,
    BeforeStep = 2,
    AfterStep = 3,
    AfterBackward = 4,
}

/// The stage names, as the Python methods are called.
pub const STAGES: [&str; 5] = [
    "before_train",
    "after_train",
    "before_step",
    "after_step",
    "after_backward",
];

impl Stage {
    /// Every stage, in table order.
    pub const ALL: [Stage; 5] = [
        Stage::BeforeTrain,
        Stage::AfterTrain,
        Stage::BeforeStep,
        Stage::AfterStep,
        Stage::AfterBackward,
    ];

    /// The stage at `index` in `STAGES`.
    pub fn from_index(index: usize) -> Option<Stage> {
        Stage::ALL.get(index).copied()
    }

    /// The Python method name.
    pub fn name(self) -> &'static str {
        STAGES[self as usize]
    }

    /// Whether the stage runs once per iteration (where a period filter applies).
    pub fn per_step(self) -> bool {
        matches!(
            self,
            Stage::BeforeStep | Stage::AfterStep | Stage::AfterBackward
        )
    }
}

/// The period rule shared by every periodic hook (detectron2's `PeriodicWriter`, fvcore's
/// `PeriodicCheckpointer`): due when `iter + 1` is a multiple of `period`, and at the last
/// iteration `max_iter - 1`. Hooks with a stricter rule (an evaluation skipped at the last
/// iteration) check it themselves inside what this lets through.
pub fn periodic_due(iter: i64, period: u64, max_iter: i64) -> bool {
    let next = i128::from(iter) + 1;
    next.rem_euclid(i128::from(period.max(1))) == 0 || next == i128::from(max_iter)
}

/// The dispatcher's clock: raw ticks of a calibrated invariant TSC where the CPU has one (a
/// read costs 10-20 ns, where `std::time::Instant` costs about 40 ns on a VM), else the OS's
/// monotonic clock. Ticks are converted to nanoseconds only when statistics are read.
fn clock() -> &'static quanta::Clock {
    static CLOCK: OnceLock<quanta::Clock> = OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}

/// Calibrates the clock now (the first read would otherwise pay for it).
pub fn start_clock() {
    clock();
}

/// The clock now, in ticks; differences of two reads go to `HookStats::record`.
#[inline]
pub fn now_ticks() -> u64 {
    clock().raw()
}

/// A tick count as nanoseconds (the scaling is linear: sums and maxima convert as well).
pub fn ticks_to_ns(ticks: u64) -> u64 {
    clock().delta_as_nanos(0, ticks)
}

/// Per-hook, per-stage call statistics, in clock ticks.
///
/// One thread records at a time (the binding records with the GIL held), so each field is
/// updated with a relaxed load and store, not a read-modify-write: a plain `mov` each, where a
/// locked add costs several nanoseconds, on a path taken at every hook call. Readers on other
/// threads see consistent-enough counts (each field is read atomically).
#[derive(Debug, Default)]
pub struct HookStats {
    calls: AtomicU64,
    total_ticks: AtomicU64,
    max_ticks: AtomicU64,
}

/// A copy of `HookStats`, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HookStatsSnapshot {
    pub calls: u64,
    pub total_ns: u64,
    pub max_ns: u64,
}

impl HookStats {
    /// Records one call that took `ticks` (a difference of two `now_ticks()`).
    #[inline]
    pub fn record(&self, ticks: u64) {
        let calls = self.calls.load(Ordering::Relaxed);
        self.calls.store(calls.saturating_add(1), Ordering::Relaxed);
        let total = self.total_ticks.load(Ordering::Relaxed);
        self.total_ticks
            .store(total.saturating_add(ticks), Ordering::Relaxed);
        if ticks > self.max_ticks.load(Ordering::Relaxed) {
            self.max_ticks.store(ticks, Ordering::Relaxed);
        }
    }

    /// The counts so far, in nanoseconds.
    pub fn snapshot(&self) -> HookStatsSnapshot {
        HookStatsSnapshot {
            calls: self.calls.load(Ordering::Relaxed),
            total_ns: ticks_to_ns(self.total_ticks.load(Ordering::Relaxed)),
            max_ns: ticks_to_ns(self.max_ticks.load(Ordering::Relaxed)),
        }
    }

    /// Continues from counts taken with `ticks` (a table rebuilt for an edited hook list).
    pub fn restore(&self, (calls, total, max): (u64, u64, u64)) {
        self.calls.store(calls, Ordering::Relaxed);
        self.total_ticks.store(total, Ordering::Relaxed);
        self.max_ticks.store(max, Ordering::Relaxed);
    }

    /// The counts so far in ticks: `(calls, total, max)`.
    pub fn ticks(&self) -> (u64, u64, u64) {
        (
            self.calls.load(Ordering::Relaxed),
            self.total_ticks.load(Ordering::Relaxed),
            self.max_ticks.load(Ordering::Relaxed),
        )
    }
}

/// One hook's method for one stage.
#[derive(Debug)]
pub struct Entry<C> {
    /// What to call (the binding's bound method).
    pub call: C,
    /// The hook's position in the trainer's hook list (for reporting).
    pub hook: usize,
    /// The hook's identity (the binding's object address): statistics follow it from one
    /// table to the next ([`Table::carry_stats_from`]).
    pub key: u64,
    /// Run only when `periodic_due(iter, period, max_iter)`; `None`: every time.
    pub period: Option<u64>,
    pub stats: HookStats,
}

/// Per stage, the entries to call in order.
#[derive(Debug)]
pub struct Table<C> {
    stages: [Vec<Entry<C>>; 5],
}

impl<C> Default for Table<C> {
    fn default() -> Self {
        Table {
            stages: Default::default(),
        }
    }
}

impl<C> Table<C> {
    /// Appends `call` for `stage` (registration order is call order). A period applies only to
    /// per-step stages; zero means none.
    pub fn push(&mut self, stage: Stage, hook: usize, key: u64, call: C, period: u64) {
        let period = (period > 0 && stage.per_step()).then_some(period);
        self.stages[stage as usize].push(Entry {
            call,
            hook,
            key,
            period,
            stats: HookStats::default(),
        });
    }

    /// A table rebuilt for an edited hook list continues each hook's statistics per stage
    /// from `old` (the same hook: the same `key`); new hooks start at zero. A hook with two
    /// entries in one stage (a part that runs after every other hook's) carries each from
    /// the entry at the same place among its own.
    pub fn carry_stats_from<D>(&self, old: &Table<D>) {
        for stage in Stage::ALL {
            let previous = old.entries(stage);
            for (n, entry) in self.entries(stage).iter().enumerate() {
                let nth = self.entries(stage)[..n]
                    .iter()
                    .filter(|e| e.key == entry.key)
                    .count();
                if let Some(prev) = previous.iter().filter(|e| e.key == entry.key).nth(nth) {
                    entry.stats.restore(prev.stats.ticks());
                }
            }
        }
    }

    /// Every entry of `stage`, due or not.
    pub fn entries(&self, stage: Stage) -> &[Entry<C>] {
        &self.stages[stage as usize]
    }

    /// The entries of `stage` to call at `iter` of a run ending at `max_iter`.
    pub fn due(&self, stage: Stage, iter: i64, max_iter: i64) -> impl Iterator<Item = &Entry<C>> {
        self.stages[stage as usize]
            .iter()
            .filter(move |e| e.period.map_or(true, |p| periodic_due(iter, p, max_iter)))
    }

    /// All entries with their stage, for statistics.
    pub fn all(&self) -> impl Iterator<Item = (Stage, &Entry<C>)> {
        Stage::ALL
            .iter()
            .flat_map(move |&s| self.stages[s as usize].iter().map(move |e| (s, e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periodic_rule_matches_detectron2() {
        let due: Vec<i64> = (0..12).filter(|&i| periodic_due(i, 5, 12)).collect();
        assert_eq!(due, vec![4, 9, 11]);
        assert!(periodic_due(0, 1, 10));
        // At the extremes nothing overflows.
        assert!(periodic_due(i64::MAX, 1, 0));
        assert!(!periodic_due(i64::MIN, 3, 0));
    }

    #[test]
    fn period_filter_applies_to_per_step_stages_only() {
        let mut t: Table<&str> = Table::default();
        t.push(Stage::AfterStep, 0, 10, "every", 0);
        t.push(Stage::AfterStep, 1, 11, "fifth", 5);
        t.push(Stage::AfterTrain, 1, 11, "train", 5);
        let names = |i| {
            t.due(Stage::AfterStep, i, 100)
                .map(|e| e.call)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(3), vec!["every"]);
        assert_eq!(names(4), vec!["every", "fifth"]);
        assert_eq!(names(99), vec!["every", "fifth"]);
        assert_eq!(t.due(Stage::AfterTrain, 3, 100).count(), 1);
    }

    #[test]
    fn statistics_follow_a_hook_into_a_rebuilt_table() {
        let mut old: Table<&str> = Table::default();
        old.push(Stage::AfterStep, 0, 10, "a", 0);
        old.push(Stage::BeforeStep, 1, 11, "b", 0);
        old.entries(Stage::AfterStep)[0].stats.record(7);
        old.entries(Stage::BeforeStep)[0].stats.record(5);
        // b removed, c added before a: a keeps its counts at its new position.
        let mut new: Table<&str> = Table::default();
        new.push(Stage::AfterStep, 0, 12, "c", 0);
        new.push(Stage::AfterStep, 1, 10, "a", 0);
        new.push(Stage::AfterTrain, 1, 10, "a", 0);
        new.carry_stats_from(&old);
        let ticks: Vec<_> = new.all().map(|(_, e)| (e.call, e.stats.ticks())).collect();
        assert_eq!(
            ticks,
            [("a", (0, 0, 0)), ("c", (0, 0, 0)), ("a", (1, 7, 7))]
        );
    }

    #[test]
    fn two_entries_of_one_hook_carry_their_own_statistics() {
        let mut old: Table<&str> = Table::default();
        old.push(Stage::AfterStep, 0, 10, "capture", 0);
        old.push(Stage::AfterStep, 1, 11, "b", 0);
        old.push(Stage::AfterStep, 0, 10, "finish", 0);
        old.entries(Stage::AfterStep)[0].stats.record(3);
        old.entries(Stage::AfterStep)[2].stats.record(9);
        old.entries(Stage::AfterStep)[2].stats.record(9);
        let mut new: Table<&str> = Table::default();
        new.push(Stage::AfterStep, 0, 10, "capture", 0);
        new.push(Stage::AfterStep, 0, 10, "finish", 0);
        new.carry_stats_from(&old);
        let ticks: Vec<_> = new.all().map(|(_, e)| (e.call, e.stats.ticks())).collect();
        assert_eq!(ticks, [("capture", (1, 3, 3)), ("finish", (2, 18, 9))]);
    }

    #[test]
    fn stats_record_calls_total_and_max() {
        let s = HookStats::default();
        s.record(30);
        s.record(10);
        assert_eq!(s.ticks(), (2, 40, 30));
        s.record(u64::MAX); // saturates, never wraps
        assert_eq!(s.ticks(), (3, u64::MAX, u64::MAX));
        let t = HookStats::default();
        t.restore((2, 40, 30));
        t.record(50);
        assert_eq!(t.ticks(), (3, 90, 50));
    }

    #[test]
    fn clock_ticks_convert_to_elapsed_time() {
        start_clock();
        let t0 = now_ticks();
        let wall = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let ticks = now_ticks() - t0;
        let measured = ticks_to_ns(ticks);
        let elapsed = u64::try_from(wall.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // The sleep's length, to the calibration's precision (5% is far wider than it).
        assert!(measured >= 19_000_000, "{measured} ns");
        assert!(
            measured <= elapsed + elapsed / 20 + 1_000_000,
            "{measured} ns > {elapsed} ns"
        );
        // Linear: a sum converts as the sum of its parts (to rounding).
        let half = ticks_to_ns(ticks / 2);
        assert!(measured.abs_diff(2 * half) <= 2);
    }

    #[test]
    fn stage_names_round_trip() {
        for (i, name) in STAGES.iter().enumerate() {
            assert_eq!(Stage::from_index(i).map(Stage::name), Some(*name));
        }
        assert_eq!(Stage::from_index(5), None);
    }
}
