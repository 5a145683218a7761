//! hookloop's pure-Rust core. No PyO3 here: the binding crate (`hookloop-py`) converts
//! arguments and calls into these types once per Python call.

pub mod append;
pub mod dispatch;
pub mod error;
pub mod history;
pub mod hooks;
pub mod iter;
pub mod jsonl;
pub mod media;
pub mod metrics;
pub mod pending;
pub mod printer;
pub mod pyexact;
pub mod record;
pub mod schedule;
pub mod storage;
pub mod tfevents;
pub mod writer;

#[cfg(test)]
mod testutil;

pub use error::{Error, Result};
pub use history::History;
pub use storage::Storage;
