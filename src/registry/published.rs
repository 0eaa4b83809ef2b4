//! A value the registry replaces whole and readers take a handle on: the way HTTP reads what
//! is running without the registry's lock.
//!
//! Owns: the swap of one `Arc` under a lock held for a pointer copy. Never: hands out a
//! reference into a value being built, or makes a reader wait for a reload (a reload holds the
//! registry, never this lock, while it starts engines).

use std::sync::Arc;

use parking_lot::RwLock;

/// A cheap, cloneable handle on the latest value the registry published.
pub struct Published<T>(Arc<RwLock<Arc<T>>>);

impl<T> Published<T> {
    pub fn current(&self) -> Arc<T> {
        Arc::clone(&self.0.read())
    }

    pub(super) fn publish(&self, value: T) {
        *self.0.write() = Arc::new(value);
    }
}

impl<T> Clone for Published<T> {
    fn clone(&self) -> Self {
        Published(Arc::clone(&self.0))
    }
}

impl<T: Default> Default for Published<T> {
    fn default() -> Self {
        Published(Arc::new(RwLock::new(Arc::new(T::default()))))
    }
}
