//! Lowering a thread's own CPU priority, for the threads whose work may wait behind the route
//! front end's and the API's answers: the pollers (`listener`) and the tokenizing threads
//! (`tokenize::gate`).
//!
//! Owns: the one call (`setpriority` of this thread's id, which on Linux sets that thread
//! alone; a thread may lower its own priority without privileges). Never: raises a priority
//! (an unprivileged process cannot take one back), or fails a thread that is refused (logged).

/// Adds `niceness` to this thread's (from 0 to `niceness`); `what` names the thread in the log
/// line of a refusal.
pub fn lower_this_thread(niceness: i32, what: &str) {
    let this_thread = rustix::thread::gettid();
    if let Err(error) = rustix::process::setpriority_process(Some(this_thread), niceness) {
        tracing::debug!("{what}: setpriority refused: {error}");
    }
}
