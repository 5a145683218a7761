//! The per-step rules of the built-in hooks, without Python: `IterationTimer`'s warmup and
//! timing, and what `LRScheduler` records. The binding's hook bases hold these and call them
//! once per stage; the period rule of `PeriodicWriter` is the dispatcher's (`periodic_due`).

use std::time::Instant;

use crate::storage::Storage;
use crate::Result;

/// fvcore's pausable `Timer`, reduced to what `IterationTimer` reads.
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch {
    total: f64,
    running_since: Option<Instant>,
}

impl Stopwatch {
    /// A stopwatch at zero, not running.
    pub fn paused() -> Self {
        Stopwatch {
            total: 0.0,
            running_since: None,
        }
    }

    /// Starts counting (no-op while running).
    pub fn resume(&mut self, now: Instant) {
        if self.running_since.is_none() {
            self.running_since = Some(now);
        }
    }

    /// Stops counting (no-op while paused).
    pub fn pause(&mut self, now: Instant) {
        if let Some(since) = self.running_since.take() {
            self.total += now.duration_since(since).as_secs_f64();
        }
    }

    /// Seconds counted so far.
    pub fn seconds(&self, now: Instant) -> f64 {
        self.total
            + self
                .running_since
                .map_or(0.0, |s| now.duration_since(s).as_secs_f64())
    }
}

/// detectron2's `IterationTimer`: the time of each step after `warmup_iter` steps, as the
/// `time` scalar, and the totals for the end-of-training summary.
#[derive(Debug, Clone)]
pub struct IterationTimer {
    /// Iterations at the start excluded from timing.
    pub warmup_iter: i64,
    /// The first iteration of this run (`trainer.start_iter`).
    start_iter: i64,
    /// When training (or, during warmup, the last warmup step) started.
    start: Instant,
    /// When the current step's before_step ran.
    step_start: Instant,
    /// Time inside steps after warmup (between before_step and after_step).
    in_steps: Stopwatch,
}

impl IterationTimer {
    /// A timer excluding the first `warmup_iter` iterations.
    pub fn new(warmup_iter: i64) -> Self {
        let now = Instant::now();
        IterationTimer {
            warmup_iter,
            start_iter: 0,
            start: now,
            step_start: now,
            in_steps: Stopwatch::paused(),
        }
    }

    /// `before_train`: both clocks restart.
    pub fn start(&mut self, start_iter: i64, now: Instant) {
        self.start_iter = start_iter;
        self.start = now;
        self.in_steps = Stopwatch::paused();
    }

    /// The first iteration of the run, for the warmup count (a hook driven on its own reads it
    /// from its trainer at each step).
    pub fn set_start_iter(&mut self, start_iter: i64) {
        self.start_iter = start_iter;
    }

    /// `before_step`.
    pub fn before_step(&mut self, now: Instant) {
        self.step_start = now;
        self.in_steps.resume(now);
    }

    /// `after_step` at iteration `iter`: the step's seconds once warmup is over (to put as
    /// `time`), or `None` during warmup, which also restarts the clocks.
    pub fn after_step(&mut self, iter: i64, now: Instant) -> Option<f64> {
        // +1 because we're in after_step: the current step is done but not yet counted.
        let iter_done = i128::from(iter) - i128::from(self.start_iter) + 1;
        if iter_done >= i128::from(self.warmup_iter) {
            self.in_steps.pause(now);
            Some(now.duration_since(self.step_start).as_secs_f64())
        } else {
            self.start = now;
            self.in_steps = Stopwatch::paused();
            None
        }
    }

    /// (seconds since this run's start, seconds inside its steps): a resumed run reports its
    /// own part, as detectron2's does.
    pub fn elapsed(&self, now: Instant) -> (f64, f64) {
        (
            now.duration_since(self.start).as_secs_f64(),
            self.in_steps.seconds(now),
        )
    }

    /// `after_step` and the put of `time` into `storage`, in one call.
    pub fn after_step_into(&mut self, storage: &mut Storage, now: Instant) -> Result<()> {
        if let Some(sec) = self.after_step(storage.iter(), now) {
            storage.put_scalar("time", sec, true, None)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::History;
    use std::time::Duration;

    fn storage(iter: i64) -> Storage {
        Storage::new(iter, History::DEFAULT_MAX_LENGTH, 8).unwrap()
    }

    #[test]
    fn warmup_iterations_are_not_timed() {
        let t0 = Instant::now();
        let mut timer = IterationTimer::new(2);
        timer.start(10, t0);
        let ms = |n| t0 + Duration::from_millis(n);
        timer.before_step(ms(0));
        assert_eq!(timer.after_step(10, ms(5)), None); // iter_done = 1 < 2
        timer.before_step(ms(5));
        assert_eq!(timer.after_step(11, ms(8)), Some(0.003));
        // The clocks restarted at the end of warmup (5 ms), so 3 ms in steps, 3 ms in total.
        let (total, in_steps) = timer.elapsed(ms(8));
        assert!((total - 0.003).abs() < 1e-12 && (in_steps - 0.003).abs() < 1e-12);
    }

    #[test]
    fn time_is_put_smoothed_at_the_storage_iteration() {
        let t0 = Instant::now();
        let mut timer = IterationTimer::new(0);
        let mut s = storage(3);
        timer.start(3, t0);
        timer.before_step(t0);
        timer
            .after_step_into(&mut s, t0 + Duration::from_millis(2))
            .unwrap();
        let time = s.scalar("time").unwrap();
        assert!(time.smoothing_hint);
        assert_eq!(time.latest.1, crate::iter::Iter::Int(3));
    }

    #[test]
    fn extreme_iterations_do_not_overflow() {
        let mut timer = IterationTimer::new(i64::MAX);
        timer.start(i64::MIN, Instant::now());
        // iter_done is 2^64: past any warmup, and no wrap to a negative count.
        assert!(timer.after_step(i64::MAX, Instant::now()).is_some());
    }
}
