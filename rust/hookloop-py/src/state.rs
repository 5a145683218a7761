//! The storage's state and the lock that guards it.
//!
//! `Shared<T>` makes "never call into Python while holding the lock" a property of the type:
//! the only way in is `with`, whose closure must be `Send`, so it cannot capture a `Python`
//! token or a `Bound` reference (both `!Send`) and so cannot run Python code; and whatever it
//! removes from the state (Python objects whose `__del__` may call back into the storage) is
//! returned and released after the lock.

use std::sync::{Arc, Mutex};

use hookloop_core::media::MediaQueue;
use hookloop_core::storage::Storage;
use pyo3::prelude::*;

/// A value behind a mutex that no Python code can run under.
pub struct Shared<T> {
    inner: Mutex<T>,
}

impl<T> Shared<T> {
    pub fn new(value: T) -> Self {
        Shared {
            inner: Mutex::new(value),
        }
    }

    /// Runs `f` with the lock held. Poisoning is ignored: no closure panics while holding it
    /// (panics are bugs that the tests guard against), and a usable storage is worth more than
    /// an exception on every later call.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R + Send) -> R {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    /// `with`, without blocking: `None` while another thread holds the lock (for the garbage
    /// collector's traversal, which must not wait).
    pub fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R + Send) -> Option<R> {
        self.inner.try_lock().ok().map(|mut g| f(&mut g))
    }

    /// For the garbage collector's traversal only: `f` may hold a `PyVisit` (not `Send`),
    /// whose calls run no Python code. `None` while another thread holds the lock.
    pub fn try_visit<R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        self.inner.try_lock().ok().map(|g| f(&g))
    }
}

/// An image put with `put_image`, held as the caller's object until a writer converts it
/// (reading a CUDA tensor would wait for the device).
///
/// The object sits in an `Arc` so that the lock's closures can copy handles out without the
/// GIL; the last handle is always released outside the lock.
pub struct PendingImage {
    pub name: String,
    pub image: Arc<Py<PyAny>>,
    pub iter: i64,
}

/// The storage's pending queue: values and started reads are Python objects.
pub type Queue = hookloop_core::pending::Pending<Py<PyAny>, Py<PyAny>>;

/// Everything behind an `EventStorage`'s lock.
pub struct State {
    pub core: Storage,
    /// The values put but not read yet (core `pending`; read by `crate::pending`).
    pub pending: Queue,
    pub images: MediaQueue<PendingImage>,
}

/// A storage's state, shared by the storage and the `HistoryBuffer` views of it.
pub type SharedState = Arc<Shared<State>>;
