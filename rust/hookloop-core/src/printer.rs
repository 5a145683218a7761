//! The console line of detectron2's `CommonMetricPrinter`, formatted here; the binding hands
//! the finished line to Python's logging.

use std::fmt::Write as _;

use crate::pyexact::{push_f, push_g, timedelta_str};
use crate::storage::Storage;
use crate::Result;

/// State of one printer: its configuration and the wall-clock fallback for the ETA.
#[derive(Debug, Clone)]
pub struct Printer {
    max_iter: Option<i64>,
    window_size: i64,
    epochs: Option<i64>,
    /// (iteration, seconds on the caller's monotonic clock) of the last ETA estimate from
    /// wall time: detectron2's `_last_write`, which subclasses read and set.
    pub last_write: Option<(i64, f64)>,
}

impl Printer {
    /// `epochs`, when given with `max_iter`, adds `epoch: e/E` (iterations split evenly).
    pub fn new(max_iter: Option<i64>, window_size: i64, epochs: Option<i64>) -> Result<Printer> {
        if window_size <= 0 {
            return Err(crate::Error::BadWindow(window_size));
        }
        Ok(Printer {
            max_iter,
            window_size,
            epochs,
            last_write: None,
        })
    }

    /// The run's last iteration, for the ETA.
    pub fn max_iter(&self) -> Option<i64> {
        self.max_iter
    }

    /// Changes the run's last iteration (a subclass resuming with another schedule).
    pub fn set_max_iter(&mut self, max_iter: Option<i64>) {
        self.max_iter = max_iter;
    }

    /// The smoothing window of the losses.
    pub fn window_size(&self) -> i64 {
        self.window_size
    }

    /// The log line for the storage's current iteration, or `None` once training reached
    /// `max_iter` (the printer reports progress only). May put `eta_seconds` into `storage`.
    ///
    /// `now` is the caller's monotonic clock in seconds (Python's `time.perf_counter()`), for
    /// the ETA's wall-time fallback. `epoch`, `(current, total)` counted from 1, is the
    /// trainer's own epoch (a finite loader): shown as `epoch: current/total`, in place of the
    /// even split of `max_iter` that the printer's `epochs` gives.
    pub fn format(
        &mut self,
        storage: &mut Storage,
        max_mem_mb: Option<f64>,
        now: f64,
        epoch: Option<(i64, i64)>,
    ) -> Result<Option<String>> {
        let iteration = storage.iter();
        if Some(iteration) == self.max_iter {
            return Ok(None);
        }
        let w = self.window_size;
        let (avg_data_time, last_data_time) = match storage.scalar("data_time") {
            Ok(s) => {
                let n = s.history.count_samples(w).max(1) as i64;
                (Some(s.history.avg(n)?), Some(s.history.latest()?))
            }
            Err(_) => (None, None),
        };
        let (avg_time, last_time) = match storage.scalar("time") {
            Ok(s) => (Some(s.history.global_avg()), Some(s.history.latest()?)),
            Err(_) => (None, None),
        };
        let lr = match storage.scalar("lr") {
            Ok(s) => Some(s.history.latest()?),
            Err(_) => None,
        };
        let eta = self.eta(storage, now)?;

        let mut line = String::with_capacity(256);
        line.push(' ');
        if let Some(eta) = eta.filter(|e| !e.is_empty()) {
            let _ = write!(line, "eta: {eta}  ");
        }
        let _ = write!(line, "iter: {iteration}  ");
        if let Some((current, total)) = epoch {
            let _ = write!(line, "epoch: {current}/{total}  ");
        } else if let (Some(epochs), Some(max_iter)) = (self.epochs, self.max_iter) {
            // In i128: max_iter + epochs - 1 can pass i64::MAX.
            let (m, e) = (i128::from(max_iter), i128::from(epochs));
            let per_epoch = ((m + e - 1) / e).max(1);
            let epoch = (i128::from(iteration) / per_epoch + 1).clamp(1, e);
            let _ = write!(line, "epoch: {epoch}/{epochs}  ");
        }
        // detectron2: "  ".join(losses), "  ", "  ".join(metrics), "  ", each item
        // `name: {median:.4g}`; a name with both "loss" and "[metric]" is in both.
        for pattern in ["loss", "[metric]"] {
            let mut first = true;
            for (name, s) in storage.scalars() {
                if !name.contains(pattern) {
                    continue;
                }
                if !first {
                    line.push_str("  ");
                }
                first = false;
                line.push_str(name);
                line.push_str(": ");
                push_g(&mut line, s.history.windowed_median(w)?, 4);
            }
            line.push_str("  ");
        }
        let times = [
            ("time: ", avg_time),
            ("last_time: ", last_time),
            ("data_time: ", avg_data_time),
            ("last_data_time: ", last_data_time),
        ];
        for (label, t) in times {
            if let Some(t) = t {
                line.push_str(label);
                push_f(&mut line, t, 4);
                line.push_str("  ");
            }
        }
        line.push_str(" lr: ");
        match lr {
            Some(lr) => push_g(&mut line, lr, 5),
            None => line.push_str("N/A"),
        }
        line.push_str("  ");
        if let Some(mb) = max_mem_mb {
            line.push_str("max_mem: ");
            push_f(&mut line, mb, 0);
            line.push('M');
        }
        Ok(Some(line))
    }

    /// detectron2's `_get_eta`: from the median iteration time over the last 1000 samples when
    /// a `time` metric exists (and then stored as `eta_seconds`), else from wall time between
    /// writes. `None` when it cannot be estimated yet.
    pub fn eta(&mut self, storage: &mut Storage, now: f64) -> Result<Option<String>> {
        let iteration = storage.iter();
        let Some(max_iter) = self.max_iter else {
            return Ok(Some(String::new()));
        };
        // In i128: the difference of two i64s can overflow them.
        let remaining = (i128::from(max_iter) - i128::from(iteration) - 1) as f64;
        if let Ok(time) = storage.history_mut("time") {
            // A sorted copy of the last 1,000 times, brought up to date here (median_tracked).
            let eta_seconds = time.median_tracked(1000)? * remaining;
            storage.put_scalar("eta_seconds", eta_seconds, false, None)?;
            // int() of a NaN/inf ETA would raise in detectron2; leave the field out instead.
            return Ok(eta_seconds
                .is_finite()
                .then(|| timedelta_str(eta_seconds as i64)));
        }
        let mut eta = None;
        if let Some((last_iter, last_time)) = self.last_write {
            if iteration != last_iter {
                let per_iter =
                    (now - last_time) / (i128::from(iteration) - i128::from(last_iter)) as f64;
                let eta_seconds = per_iter * remaining;
                if eta_seconds.is_finite() {
                    eta = Some(timedelta_str(eta_seconds as i64));
                }
            }
        }
        self.last_write = Some((iteration, now));
        Ok(eta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::History;

    fn storage() -> Storage {
        Storage::new(0, History::DEFAULT_MAX_LENGTH, 8).unwrap()
    }

    #[test]
    fn full_line_matches_detectron2_layout() {
        let mut s = storage();
        for i in 0..20 {
            s.set_iter(i).unwrap();
            s.put_scalar("total_loss", 1.0 + i as f64, true, None)
                .unwrap();
            s.put_scalar("[metric]acc", 0.5, true, None).unwrap();
            s.put_scalar("time", 0.25, true, None).unwrap();
            s.put_scalar("data_time", 0.125, true, None).unwrap();
            s.put_scalar("lr", 0.02, false, None).unwrap();
        }
        let mut p = Printer::new(Some(100), 20, None).unwrap();
        let line = p.format(&mut s, None, 0.0, None).unwrap().unwrap();
        assert_eq!(
            line,
            " eta: 0:00:20  iter: 19  total_loss: 10.5  [metric]acc: 0.5  time: 0.2500  \
             last_time: 0.2500  data_time: 0.1250  last_data_time: 0.1250   lr: 0.02  "
        );
        assert_eq!(s.scalar("eta_seconds").unwrap().latest.0, 20.0);
    }

    #[test]
    fn a_name_with_loss_and_metric_is_in_both_lists_in_put_order() {
        let mut s = storage();
        s.set_iter(3).unwrap();
        for (name, v) in [
            ("[metric]acc", 0.5),
            ("[metric]loss_x", 0.25),
            ("loss_y", 2.0),
        ] {
            s.put_scalar(name, v, true, None).unwrap();
        }
        let mut p = Printer::new(None, 20, None).unwrap();
        assert_eq!(
            p.format(&mut s, None, 0.0, None).unwrap().unwrap(),
            concat!(
                " iter: 3  [metric]loss_x: 0.25  loss_y: 2  ",
                "[metric]acc: 0.5  [metric]loss_x: 0.25   lr: N/A  "
            )
        );
    }

    #[test]
    fn minimal_line_and_end_of_training() {
        let mut s = storage();
        s.set_iter(5).unwrap();
        let mut p = Printer::new(None, 20, None).unwrap();
        assert_eq!(
            p.format(&mut s, Some(1024.4), 0.0, None).unwrap().unwrap(),
            " iter: 5       lr: N/A  max_mem: 1024M"
        );
        let mut p = Printer::new(Some(5), 20, None).unwrap();
        assert_eq!(p.format(&mut s, None, 0.0, None).unwrap(), None);
    }

    #[test]
    fn epoch_field() {
        let mut s = storage();
        s.set_iter(250).unwrap();
        let mut p = Printer::new(Some(1000), 20, Some(4)).unwrap();
        let line = p.format(&mut s, None, 0.0, None).unwrap().unwrap();
        assert!(line.contains("iter: 250  epoch: 2/4  "), "{line}");
        // The trainer's epoch wins over the even split.
        let line = p.format(&mut s, None, 0.0, Some((3, 7))).unwrap().unwrap();
        assert_eq!(line, " iter: 250  epoch: 3/7       lr: N/A  ");
    }
}
