//! The listener's stop signal: an eventfd the owner raises once and every wait of the listener
//! thread watches (next to its sockets in `zmq::poll`, or alone between steps of a recovery).
//! It never blocks the side that raises it, and never resets once raised.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// The listener's stop signal, the thread's side: an eventfd that `StopHandle::raise` writes
/// once and that stays readable from then on, so every later wait sees it. It costs one file
/// descriptor and no ZMQ socket, where an inproc PAIR pair cost two sockets of two descriptors
/// each (this libzmq's mailboxes are socketpairs): at 8,000 ranks that is 24,000 descriptors.
pub(super) struct Stop(Arc<OwnedFd>);

/// The owner's side of a `Stop`.
pub(super) struct StopHandle(Arc<OwnedFd>);

impl Stop {
    /// A new, unraised signal and the handle that raises it.
    pub(super) fn new() -> std::io::Result<(Stop, StopHandle)> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor that
        // nothing else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok((Stop(Arc::clone(&fd)), StopHandle(fd)))
    }

    /// Whether stop was requested; waits at most `wait` for it.
    pub(super) fn requested(&self, wait: Duration) -> bool {
        let timeout = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
        let mut item = [self.as_poll_item()];
        // A poll that fails cannot wait for stop any more: treat it as stop.
        zmq::poll(&mut item, timeout).map_or(true, |ready| ready > 0)
    }

    /// For `zmq::poll` next to the listener's sockets: readable once stop was requested.
    pub(super) fn as_poll_item(&self) -> zmq::PollItem<'_> {
        zmq::PollItem::from_fd(self.0.as_raw_fd(), zmq::POLLIN)
    }
}

impl StopHandle {
    /// Requests stop; idempotent (the counter only grows, the fd stays readable).
    pub(super) fn raise(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to a descriptor this handle keeps
        // open. It cannot block (EFD_NONBLOCK) and fails only if the counter would overflow,
        // which takes 2^64 - 2 raises: nothing to do about it either way.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}
