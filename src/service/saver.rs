//! Saving every rank's state to `state_dir` (docs.md "Restarts"): every `state_interval_s` the
//! pollers hand over each exact rank's state, and the blocking pool writes one file per rank;
//! a stop saves once more before the listeners go.
//!
//! Owns: when the index is saved, and what a failed write says. Never: decides what a rank's
//! state is (the listener does: only an `active` rank's), how a file is laid out or written
//! (`state`), or saves on a worker of the runtime (taking and writing states block).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tracing::{info, warn};

use super::tasks::{blocking, Task};
use crate::listener::Pollers;
use crate::metrics::Metrics;

/// How long the pollers have to hand over their ranks' states: each export is a copy of a
/// rank's maps and a parent lookup per block (docs/performance.md "Saved state: bench_state"
/// measures it), well under this for every rank of a poller.
const HANDOVER: Duration = Duration::from_secs(10);

/// Where states go and who hands them over.
#[derive(Clone)]
pub(super) struct Saving {
    pub(super) pollers: Pollers,
    pub(super) dir: PathBuf,
    pub(super) metrics: Arc<Metrics>,
}

/// The periodic save.
pub(super) struct Saver(Task);

impl Saver {
    pub(super) fn spawn(runtime: &Handle, saving: Saving, every: Duration) -> Saver {
        Saver(Task::spawn(runtime, move |mut stopped| async move {
            while stopped.unless(tokio::time::sleep(every)).await.is_some() {
                let saving = saving.clone();
                blocking(move || saving.save_all()).await;
            }
        }))
    }

    pub(super) async fn stop(self) {
        self.0.stop().await;
    }
}

impl Saving {
    /// Writes the state of every rank that is exact now, one file each; blocks.
    pub(super) fn save_all(&self) {
        let started = Instant::now();
        let states = self.pollers.saved_states(HANDOVER);
        let (mut files, mut bytes, mut failed) = (0, 0, 0);
        for state in &states {
            match crate::state::write(&self.dir, state) {
                Ok(written) => {
                    files += 1;
                    bytes += written.bytes;
                    self.metrics.state_write(true);
                }
                Err(error) => {
                    failed += 1;
                    self.metrics.state_write(false);
                    warn!(
                        engine = %state.identity.engine,
                        rank = state.identity.dp_rank,
                        "engine {} rank {}: saving its state: {error}",
                        state.identity.engine, state.identity.dp_rank
                    );
                }
            }
        }
        let took = started.elapsed();
        let dir = self.dir.display();
        if failed > 0 {
            warn!(
                "{failed} of {} rank states not saved to {dir}",
                states.len()
            );
        }
        info!(
            "saved {files} rank states ({} KiB) to {dir} in {took:.1?}",
            bytes >> 10
        );
    }
}
