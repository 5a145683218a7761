//! The rule of detectron2's `SimpleTrainer.write_metrics`, once, for one process and many: what
//! is put into the storage for one iteration's losses and data time.

use crate::iter::Iter;
use crate::pyexact::python_sum;
use crate::storage::Storage;
use crate::{Error, Result};

/// What the main process records after reducing over ranks (with one process: its own values).
#[derive(Debug, Clone, Copy)]
pub struct Reduced<'a> {
    /// `data_time` to record: the maximum over ranks (the slowest rank is the latency).
    pub data_time: f64,
    /// Each loss: the mean over ranks.
    pub losses: &'a [(&'a str, f64)],
}

/// Records one iteration's metrics at `iter`:
/// - `rank_data_time`: this rank's own data time, on every rank;
/// - with `reduced` (the main process): `data_time`, then the sum of the losses as
///   `{prefix}total_loss`, and, when there are several losses, each of them.
///
/// A total that is not finite is `Error::NonFiniteLoss` (detectron2's `FloatingPointError`)
/// and, as in detectron2, only the data times were put.
pub fn write_metrics(
    storage: &mut Storage,
    iter: Iter,
    prefix: &str,
    rank_data_time: f64,
    reduced: Option<Reduced<'_>>,
) -> Result<()> {
    storage.put_scalar("rank_data_time", rank_data_time, true, Some(iter))?;
    let Some(reduced) = reduced else {
        return Ok(());
    };
    storage.put_scalar("data_time", reduced.data_time, true, Some(iter))?;
    let total = python_sum(reduced.losses.iter().map(|&(_, v)| v));
    if !total.is_finite() {
        return Err(Error::NonFiniteLoss {
            iter,
            losses: reduced
                .losses
                .iter()
                .map(|&(k, v)| (k.to_owned(), v))
                .collect(),
        });
    }
    let name = if prefix.is_empty() {
        std::borrow::Cow::Borrowed("total_loss")
    } else {
        std::borrow::Cow::Owned(format!("{prefix}total_loss"))
    };
    storage.put_scalar(&name, total, true, Some(iter))?;
    if reduced.losses.len() > 1 {
        for &(name, value) in reduced.losses {
            storage.put_scalar(name, value, true, Some(iter))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::History;

    fn storage() -> Storage {
        Storage::new(0, History::DEFAULT_MAX_LENGTH, 4).unwrap()
    }

    fn names(s: &Storage) -> Vec<String> {
        s.scalars().map(|(k, _)| k.to_owned()).collect()
    }

    #[test]
    fn one_loss_puts_only_the_total() {
        let mut s = storage();
        let losses = [("loss", 0.5)];
        let reduced = Reduced {
            data_time: 0.01,
            losses: &losses,
        };
        write_metrics(&mut s, Iter::Int(3), "", 0.01, Some(reduced)).unwrap();
        assert_eq!(names(&s), ["rank_data_time", "data_time", "total_loss"]);
        assert_eq!(s.scalar("total_loss").unwrap().latest, (0.5, Iter::Int(3)));
    }

    #[test]
    fn several_losses_are_put_each_with_the_prefixed_total() {
        let mut s = storage();
        let losses = [("a", 1.0), ("b", 2.0)];
        let reduced = Reduced {
            data_time: 0.2,
            losses: &losses,
        };
        write_metrics(&mut s, Iter::Int(0), "val_", 0.1, Some(reduced)).unwrap();
        assert_eq!(
            names(&s),
            ["rank_data_time", "data_time", "val_total_loss", "a", "b"]
        );
        assert_eq!(s.scalar("val_total_loss").unwrap().latest.0, 3.0);
        // rank_data_time is this rank's; data_time the reduced one.
        assert_eq!(s.scalar("rank_data_time").unwrap().latest.0, 0.1);
        assert_eq!(s.scalar("data_time").unwrap().latest.0, 0.2);
    }

    #[test]
    fn other_ranks_put_only_their_data_time() {
        let mut s = storage();
        write_metrics(&mut s, Iter::Int(0), "", 0.3, None).unwrap();
        assert_eq!(names(&s), ["rank_data_time"]);
    }

    #[test]
    fn non_finite_total_is_an_error_after_the_data_times() {
        let mut s = storage();
        let losses = [("a", f64::NAN), ("b", 1.0)];
        let reduced = Reduced {
            data_time: 0.0,
            losses: &losses,
        };
        let err = write_metrics(&mut s, Iter::Int(7), "", 0.0, Some(reduced)).unwrap_err();
        assert!(
            matches!(err, Error::NonFiniteLoss { iter: Iter::Int(7), ref losses } if losses.len() == 2)
        );
        assert_eq!(names(&s), ["rank_data_time", "data_time"]);
    }
}
