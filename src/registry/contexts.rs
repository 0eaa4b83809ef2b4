//! The pool of ZMQ contexts the registry's listeners share.
//!
//! Owns: how many listeners each context carries, and making a new context when all are full.
//! Never: creates a socket (listeners do), or frees a context while a listener may use it (a
//! context's count only goes down when its listener is stopped).

use parking_lot::Mutex;

/// Listeners per ZMQ context: a context holds at most 1,023 sockets (ZMQ_MAX_SOCKETS: the zmq
/// crate neither sets it nor exposes the raw context to `zmq_ctx_set`) and a listener uses up
/// to 4 (SUB, the monitor's PAIR pair, a replay DEALER while recovering). Each context adds
/// two threads and eight descriptors, against 7 descriptors per listener (listeners have no
/// threads of their own: they run on the registry's pollers).
const LISTENERS_PER_CONTEXT: usize = 250;

/// A ZMQ context whose I/O thread and reaper are already running, started from a thread named
/// `kvi-zmq`: libzmq starts them at a context's first socket, and a new thread takes the name of
/// the one that starts it, so without this they would carry the name of whichever runtime or
/// poller thread opened that socket, and `threads_by_kind` could not tell them apart.
pub fn new_context() -> zmq::Context {
    let context = zmq::Context::new();
    let starting = context.clone();
    let started = std::thread::Builder::new()
        .name("kvi-zmq".into())
        .spawn(move || drop(starting.socket(zmq::PAIR)));
    // Not started here (no thread to be had): libzmq starts them at the first socket.
    if let Ok(thread) = started {
        let _ = thread.join();
    }
    context
}

/// ZMQ contexts, each given at most `LISTENERS_PER_CONTEXT` listeners, so 1,000 engines × 8
/// ranks fit. Shared by the starter threads, hence the lock.
pub(super) struct ContextPool {
    contexts: Mutex<Vec<(zmq::Context, usize)>>,
}

impl ContextPool {
    /// A pool whose first context is `first`.
    pub(super) fn new(first: zmq::Context) -> ContextPool {
        ContextPool {
            contexts: Mutex::new(vec![(first, 0)]),
        }
    }

    /// The index and a handle of a context with room for one more listener.
    pub(super) fn take(&self) -> (usize, zmq::Context) {
        let mut contexts = self.contexts.lock();
        let slot = match contexts
            .iter()
            .position(|(_, used)| *used < LISTENERS_PER_CONTEXT)
        {
            Some(slot) => slot,
            None => {
                contexts.push((new_context(), 0));
                contexts.len() - 1
            }
        };
        let (context, used) = &mut contexts[slot];
        *used += 1;
        (slot, context.clone())
    }

    /// Puts `fresh` in slot 0 and returns the context it held: for a test to terminate the
    /// old one under its listeners while restarts get a working one.
    #[cfg(test)]
    pub(super) fn replace_first(&self, fresh: zmq::Context) -> zmq::Context {
        std::mem::replace(&mut self.contexts.lock()[0].0, fresh)
    }

    pub(super) fn give_back(&self, slot: usize) {
        if let Some((_, used)) = self.contexts.lock().get_mut(slot) {
            *used = used.saturating_sub(1);
        }
    }
}
