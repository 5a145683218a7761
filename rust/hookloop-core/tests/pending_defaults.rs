//! The pending queue with its default limits, and infinite losses, through the crate's public
//! API: a default queue makes the read of a trainer's deferred losses due every 20 iterations
//! and reads everything at 1024 waiting values, and a total loss of +inf or -inf stops a read
//! at its iteration as NaN does.

#![expect(clippy::unwrap_used, reason = "test helpers: a panic is the failure")]

use std::sync::Arc;

use hookloop_core::iter::Iter;
use hookloop_core::pending::{apply, Due, Pending};
use hookloop_core::{Error, Storage};

fn storage() -> Storage {
    Storage::new(0, 100, 10).unwrap()
}

/// Queues iteration `it`'s two losses, `v` and `2 * v`.
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

/// Takes everything waiting and applies it, as a read of the storage does.
fn read_all(q: &mut Pending<f64, ()>, s: &mut Storage) -> hookloop_core::Result<()> {
    let taken = q.take();
    assert!(taken.started.is_empty());
    let result = apply(s, &taken.waiting.records, &taken.waiting.values);
    s.end_deferred();
    result
}

fn total_iters(s: &Storage) -> Vec<Iter> {
    let total = s.scalar("total_loss").unwrap().history.values();
    total.into_iter().map(|(_, it)| it).collect()
}

#[test]
fn a_default_queue_makes_the_read_due_at_every_20th_iteration_exactly() {
    let mut s = storage();
    let mut q = Pending::default();
    let mut due_at = Vec::new();
    for it in 0..60 {
        match losses(&mut q, &mut s, it, 1.0) {
            Due::Nothing => {}
            Due::Start => {
                due_at.push(it);
                read_all(&mut q, &mut s).unwrap();
            }
            Due::Read => panic!("the value bound was reached at iteration {it}"),
        }
    }
    assert_eq!(due_at, [19, 39, 59]);
    assert_eq!(total_iters(&s), (0..60).map(Iter::Int).collect::<Vec<_>>());
}

#[test]
fn a_default_queue_reads_everything_at_1024_waiting_values() {
    let mut s = storage();
    let mut q: Pending<f64, ()> = Pending::default();
    for i in 0..1023 {
        let due = q.push_put(&mut s, "x".into(), true, Iter::Int(i), 1.0);
        assert_eq!(due, Due::Nothing, "put {i}");
    }
    let due = q.push_put(&mut s, "x".into(), true, Iter::Int(1023), 1.0);
    assert_eq!(due, Due::Read);
    assert_eq!(q.counts(), (1024, 0));
}

fn assert_stops_at_iteration_1(bad: f64) {
    let mut s = storage();
    let mut q = Pending::default();
    for (it, v) in [(0, 1.0), (1, bad), (2, 1.0)] {
        assert_eq!(losses(&mut q, &mut s, it, v), Due::Nothing);
    }
    let err = read_all(&mut q, &mut s).unwrap_err();
    match &err {
        Error::NonFiniteLoss { iter, losses } => {
            assert_eq!(*iter, Iter::Int(1), "{bad}");
            assert_eq!(
                losses,
                &[("a".to_owned(), bad), ("b".to_owned(), 2.0 * bad)]
            );
        }
        other => panic!("{bad}: {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "Loss became infinite or NaN at iteration=1!"
    );
    // The iterations before it are stored; nothing of it or after it but its data times.
    assert_eq!(total_iters(&s), [Iter::Int(0)]);
    assert_eq!(s.scalar("a").unwrap().history.values().len(), 1);
    assert!(q.is_empty());
}

#[test]
fn a_positive_infinite_loss_stops_the_read_at_its_iteration() {
    assert_stops_at_iteration_1(f64::INFINITY);
}

#[test]
fn a_negative_infinite_loss_stops_the_read_at_its_iteration() {
    assert_stops_at_iteration_1(f64::NEG_INFINITY);
}

#[test]
fn infinite_losses_of_opposite_signs_stop_the_read_too() {
    let mut s = storage();
    let mut q: Pending<f64, ()> = Pending::default();
    let names: Arc<[String]> = Arc::from(["a".to_owned(), "b".to_owned()]);
    let values = vec![f64::INFINITY, f64::NEG_INFINITY]; // a NaN total
    q.push_losses(&mut s, Iter::Int(4), 0.0, String::new(), names, values)
        .unwrap();
    let err = read_all(&mut q, &mut s).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NonFiniteLoss {
                iter: Iter::Int(4),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!s.has_history("total_loss"));
}
