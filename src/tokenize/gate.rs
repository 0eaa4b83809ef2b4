//! The tokenizing gate: how much tokenizing runs at once, shared by every route that tokenizes a
//! text or chat prompt (the route front end, `/query`, `/select`).
//!
//! Tokenizing is CPU work that holds about `BYTES_PER_PROMPT_BYTE` times the prompt's bytes
//! while it runs (docs/performance.md "Heavy requests: bench_heavy"): unbounded, a few large
//! prompts at once take the process's memory and its cores. The gate admits a prompt when a
//! place (one per core) and its bytes within the byte budget are free; a prompt waits for them
//! at most `WAIT`, and one larger than the whole budget is never admitted. An admitted prompt
//! is tokenized on one of the gate's threads, one per place, niced so that the threads that
//! answer (`/health`, small requests) run first. A caller whose client goes away leaves: the
//! async wait when its future is dropped, a blocking one when its `Cancel` is set, and an
//! admitted prompt at its next step (`check_cancelled`, called before each piece's encode,
//! the first after the template's render).
//!
//! Owns: the places and their threads, the budget, the wait's bound and the cancellation
//! flag. Never: decides what is tokenized or the status a refusal is answered with (the routes
//! do: 429, or 413).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};

/// What tokenizing holds at its peak per byte of prompt, measured (`bench_heavy`'s
/// "tokenizing cost" lines: 120 to 147): the tokenizer's `Encoding` (a token's id, offsets,
/// string, masks) and its pre-tokenized splits with their per-byte alignments.
pub const BYTES_PER_PROMPT_BYTE: usize = 150;

/// The bytes of prompts tokenized at once: with `BYTES_PER_PROMPT_BYTE`, about 315 MB at the
/// peak, so that the process stays within 512 MB under any load of text prompts. It is also
/// the largest prompt ever tokenized: 2 MiB is over 400,000 tokens of English, more than most
/// served models' context.
pub const BUDGET_BYTES: usize = 2 << 20;

/// A prompt this small passes without a place or bytes, and is tokenized where it is read: it
/// holds about a megabyte for under a millisecond, about the hop to another thread and back
/// (docs/performance.md "Why a short prompt is tokenized where it is read"), and the threads
/// that run it (the runtime's, the API's pool) bound how many.
pub const UNGATED_BYTES: usize = 8 << 10;

/// Niceness of the tokenizing threads: a flood of long prompts yields the cores to the threads
/// that answer, so `/health` and small requests keep their latency (as the pollers' +10).
const TOKENIZING_NICENESS: i32 = 10;

/// How long a prompt waits for a place and its bytes before it is refused.
pub const WAIT: Duration = Duration::from_secs(2);

/// Why a prompt was not admitted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    /// Past the budget, for longer than `WAIT`: a retry may pass.
    #[error(
        "the server is tokenizing as many prompts as it can at once ({budget} bytes of text \
         on {places} threads); this one waited {waited_ms} ms: retry shortly"
    )]
    Busy {
        budget: usize,
        places: usize,
        waited_ms: u128,
    },
    /// Larger than the whole budget: no retry passes.
    #[error(
        "the prompt's {bytes} bytes are over the tokenizing budget of {budget} bytes (the \
         largest prompt tokenized): send token_ids"
    )]
    TooLarge { bytes: usize, budget: usize },
    /// The client went away.
    #[error("the client went away")]
    Cancelled,
}

/// The gate: one per process, shared by the route front end and the API.
pub struct Gate {
    /// The tokenizing threads' queue: a job is sent only with a place, so one always waits.
    /// Started with the first job: a process that tokenizes no long prompt has no such thread.
    jobs: OnceLock<mpsc::Sender<Job>>,
    places: Arc<Semaphore>,
    place_count: usize,
    /// The budget in KiB (a semaphore counts in `u32`).
    budget: Arc<Semaphore>,
    budget_bytes: usize,
    wait: Duration,
}

type Job = Box<dyn FnOnce() + Send>;

/// An admitted prompt's place and bytes (none for an ungated one), given back when dropped.
pub struct Pass {
    _place: Option<OwnedSemaphorePermit>,
    _bytes: Option<OwnedSemaphorePermit>,
}

impl Default for Gate {
    fn default() -> Gate {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Gate::new(cores, BUDGET_BYTES, WAIT)
    }
}

impl Gate {
    /// A gate of `places` threads and `budget_bytes` of prompts at once, where a prompt waits
    /// at most `wait`.
    pub fn new(places: usize, budget_bytes: usize, wait: Duration) -> Gate {
        let places = places.max(1);
        Gate {
            jobs: OnceLock::new(),
            places: Arc::new(Semaphore::new(places)),
            place_count: places,
            budget: Arc::new(Semaphore::new(kib(budget_bytes) as usize)),
            budget_bytes,
            wait,
        }
    }

    /// The bytes of the budget taken (to the KiB): by the prompts admitted (ungated ones are
    /// not counted), and in part by the next one waiting, which takes freed bytes as they come.
    pub fn bytes_admitted(&self) -> usize {
        let free = self.budget.available_permits();
        (kib(self.budget_bytes) as usize).saturating_sub(free) * 1024
    }

    /// The largest prompt admitted, in bytes.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Admits a prompt of `bytes`, waiting at most the gate's wait. Dropping the future leaves
    /// the queue.
    pub async fn enter(&self, bytes: usize) -> Result<Pass, Refused> {
        if bytes <= UNGATED_BYTES {
            return Ok(Pass {
                _place: None,
                _bytes: None,
            });
        }
        if bytes > self.budget_bytes {
            return Err(Refused::TooLarge {
                bytes,
                budget: self.budget_bytes,
            });
        }
        let started = std::time::Instant::now();
        let admitted = tokio::time::timeout(self.wait, async {
            // Bytes first: they bound memory; a place only bounds CPU.
            let bytes = Arc::clone(&self.budget)
                .acquire_many_owned(kib(bytes))
                .await
                .ok()?;
            let place = Arc::clone(&self.places).acquire_owned().await.ok()?;
            Some(Pass {
                _place: Some(place),
                _bytes: Some(bytes),
            })
        })
        .await;
        match admitted {
            Ok(Some(pass)) => Ok(pass),
            // The semaphores are never closed: a `None` cannot come, and is a refusal if it did.
            Ok(None) | Err(_) => Err(self.busy(started)),
        }
    }

    /// `enter` from a thread that may block (the API's routes run on the runtime's blocking
    /// threads), leaving the queue when `cancel` is set.
    pub fn enter_blocking(&self, bytes: usize, cancel: &Cancel) -> Result<Pass, Refused> {
        let entering = async {
            tokio::select! {
                entered = self.enter(bytes) => entered,
                () = cancel.cancelled() => Err(Refused::Cancelled),
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => runtime.block_on(entering),
            // A caller outside the runtime (a test of a route): a runtime of its own to wait on.
            Err(_) => tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .map_err(|_| self.busy(std::time::Instant::now()))?
                .block_on(entering),
        }
    }

    /// Runs `tokenize` for an admitted prompt, with `cancel` as its flag (`check_cancelled`):
    /// on a tokenizing thread, or here for an ungated one. `pass` is held until it ends, also
    /// when its caller has gone: its memory is in use until then.
    pub fn run<T: Send + 'static>(
        &self,
        pass: Pass,
        cancel: Cancel,
        tokenize: impl FnOnce() -> T + Send + 'static,
    ) -> Running<T> {
        let (done, running) = oneshot::channel();
        let ungated = pass._place.is_none();
        let job: Job = Box::new(move || {
            let result = cancel.scope(tokenize);
            // Given back before the caller hears: what it does next finds the budget free.
            drop(pass);
            // The caller may have gone: nobody to tell.
            let _ = done.send(result);
        });
        if ungated {
            job();
        } else if let Err(mpsc::SendError(job)) = self.jobs().send(job) {
            // No tokenizing thread could be started: the caller's thread runs it.
            job();
        }
        Running(running)
    }

    /// The tokenizing threads' queue, the threads started on first use.
    fn jobs(&self) -> &mpsc::Sender<Job> {
        self.jobs.get_or_init(|| {
            let (jobs, queue) = mpsc::channel::<Job>();
            let queue = Arc::new(Mutex::new(queue));
            for n in 0..self.place_count {
                let queue = Arc::clone(&queue);
                let spawned = std::thread::Builder::new()
                    .name(format!("kvi-tokenize-{n}"))
                    .spawn(move || tokenizing_thread(&queue));
                if let Err(error) = spawned {
                    tracing::warn!(
                        "tokenizing thread {n} not started ({error}); fewer run at once"
                    );
                }
            }
            jobs
        })
    }

    fn busy(&self, since: std::time::Instant) -> Refused {
        Refused::Busy {
            budget: self.budget_bytes,
            places: self.place_count,
            waited_ms: since.elapsed().as_millis(),
        }
    }
}

/// A tokenizing thread: niced, it runs the queue's jobs until the gate is dropped.
fn tokenizing_thread(queue: &Mutex<mpsc::Receiver<Job>>) {
    crate::thread_priority::lower_this_thread(TOKENIZING_NICENESS, "tokenizing thread");
    loop {
        let job = queue.lock().recv();
        match job {
            // A tokenizer that panics ends its job (its caller sees `None`), not the thread.
            Ok(job) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            }
            Err(mpsc::RecvError) => return,
        }
    }
}

/// A tokenizing under way; its result once it ends.
pub struct Running<T>(oneshot::Receiver<T>);

impl<T> Running<T> {
    /// Its result; `None` if it panicked.
    pub async fn finished(self) -> Option<T> {
        self.0.await.ok()
    }

    /// Its result, waited for on a thread that may block.
    pub fn wait(self) -> Option<T> {
        self.0.blocking_recv().ok()
    }
}

fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

/// Set when the client that asked for a tokenizing has gone.
#[derive(Clone, Default)]
pub struct Cancel(Arc<CancelState>);

#[derive(Default)]
struct CancelState {
    set: AtomicBool,
    notify: Notify,
}

impl Cancel {
    pub fn cancel(&self) {
        self.0.set.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.set.load(Ordering::Acquire)
    }

    async fn cancelled(&self) {
        loop {
            let notified = self.0.notify.notified();
            if self.is_cancelled() {
                return;
            }
            notified.await;
        }
    }

    /// Sets the flag when the guard is dropped: held by the future a client's disconnect drops.
    pub fn on_drop(&self) -> CancelOnDrop {
        CancelOnDrop(self.clone())
    }

    /// Runs `tokenize` with this flag as the thread's, for `check_cancelled` to read.
    pub fn scope<T>(&self, tokenize: impl FnOnce() -> T) -> T {
        let previous = CURRENT.with(|current| current.replace(Some(self.clone())));
        let result = tokenize();
        CURRENT.with(|current| *current.borrow_mut() = previous);
        result
    }
}

/// Cancels its flag when dropped.
pub struct CancelOnDrop(Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

thread_local! {
    /// The flag of the tokenizing this thread runs (`Cancel::scope`): read between steps, so
    /// that the tokenizer's signatures need not carry it.
    static CURRENT: RefCell<Option<Cancel>> = const { RefCell::new(None) };
}

/// Whether the tokenizing this thread runs was cancelled: the tokenizer calls it between its
/// steps and stops, so that at most the current step runs on after a client has gone.
pub fn check_cancelled() -> bool {
    CURRENT.with(|current| current.borrow().as_ref().is_some_and(Cancel::is_cancelled))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn past_the_budget_a_prompt_waits_then_is_refused_and_a_freed_budget_admits_it() {
        let gate = Gate::new(4, 40 << 10, Duration::from_millis(50));
        runtime().block_on(async {
            let first = gate.enter(30 << 10).await.expect("within the budget");
            let refused = gate.enter(20 << 10).await.err().expect("past the budget");
            assert!(matches!(refused, Refused::Busy { waited_ms, .. } if waited_ms >= 50));
            assert!(refused.to_string().contains("40960 bytes"), "{refused}");
            let second = gate.enter(10 << 10).await.expect("the rest of the budget");
            let _small = gate
                .enter(UNGATED_BYTES)
                .await
                .expect("a small prompt passes");
            drop(first);
            drop(second);
            gate.enter(40 << 10).await.expect("the whole budget, freed");
            let too_large = gate.enter((40 << 10) + 1).await.err().expect("never fits");
            assert_eq!(
                too_large,
                Refused::TooLarge {
                    bytes: (40 << 10) + 1,
                    budget: 40 << 10
                }
            );
        });
    }

    #[test]
    fn places_bound_prompts_at_once_whatever_their_size() {
        let gate = Gate::new(1, 1 << 20, Duration::from_millis(20));
        let size = UNGATED_BYTES + 1;
        runtime().block_on(async {
            let held = gate.enter(size).await.expect("a place");
            assert!(matches!(
                gate.enter(size).await,
                Err(Refused::Busy { places: 1, .. })
            ));
            drop(held);
            let pass = gate.enter(size).await.expect("the place, freed");
            let thread = || std::thread::current().name().map(str::to_owned);
            let ran_on = gate.run(pass, Cancel::default(), thread).finished().await;
            assert_eq!(ran_on.flatten().as_deref(), Some("kvi-tokenize-0"));
            let small = gate.enter(UNGATED_BYTES).await.expect("ungated");
            let here = thread();
            let ran_on = gate.run(small, Cancel::default(), thread).finished().await;
            assert_eq!(
                ran_on,
                Some(here),
                "a small prompt is tokenized where it is read"
            );
        });
    }

    /// A cancelled tokenizing stops at its next step: a chat's encode after its render.
    #[test]
    fn a_cancelled_scope_stops_the_tokenizing_at_its_next_step() {
        let root = tempfile::tempdir().expect("a temporary directory");
        kv_indexer_sim::tokenizer_dir::write_all(root.path()).expect("tokenizer directories");
        let dir = root.path().join("chatml");
        let tokenizers = crate::tokenize::Tokenizers::load(
            [("chatml", dir.as_path())],
            &crate::tokenize::Tokenizers::default(),
        )
        .expect("the tokenizer");
        let messages = serde_json::json!([{ "role": "user", "content": "the cache" }]);
        let chat = crate::tokenize::Prompt::Chat {
            messages: &messages,
            tools: None,
        };
        let cancel = Cancel::default();
        let mut ids = Vec::new();
        cancel
            .scope(|| tokenizers.encode(None, &chat, &mut ids))
            .expect("tokenized while the client is there");
        let whole = ids.len();
        cancel.cancel();
        ids.clear();
        let stopped = cancel
            .scope(|| tokenizers.encode(None, &chat, &mut ids))
            .expect_err("stopped");
        assert!(stopped.to_string().contains("went away"), "{stopped:?}");
        // The added token before the first piece is laid down, the pieces are not.
        assert!(ids.len() < whole, "stopped before the text: {ids:?}");
    }

    #[test]
    fn a_cancelled_blocking_wait_leaves_and_the_flag_reaches_the_scope() {
        let gate = Gate::new(1, 1 << 20, Duration::from_secs(60));
        let size = UNGATED_BYTES + 1;
        let held = runtime().block_on(gate.enter(size)).expect("a place");
        let cancel = Cancel::default();
        let waiter = {
            let cancel = cancel.clone();
            std::thread::spawn(move || gate.enter_blocking(size, &cancel).err())
        };
        drop(cancel.on_drop());
        let left = waiter.join().expect("the waiter");
        assert_eq!(left, Some(Refused::Cancelled));
        drop(held);
        assert!(!check_cancelled(), "outside a scope nothing is cancelled");
        assert!(cancel.scope(check_cancelled));
        assert!(!check_cancelled(), "the scope's flag ends with it");
    }
}
