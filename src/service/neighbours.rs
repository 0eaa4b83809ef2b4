//! The neighbour-port watch of fixed engines: a `dp_size` typed too small leaves a rank
//! unindexed without a word, so the port the next rank would use (`zmq_port + dp_rank_start +
//! dp_size`) is probed, and a publisher answering there is made loud: warned about once with the
//! fix, counted (`neighbour_publishers_total`) and shown on `/workers`.
//!
//! Owns: which ports are probed (not one that is another rank of the plan), when (at start, on
//! reload, every 30 s), and the transitions a probe reports. Never: subscribes to or indexes
//! anything from that port (`discover::publisher_answers` only waits for the handshake).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use log::{info, warn};
use parking_lot::Mutex;

use crate::config::Config;
use crate::discover::{
    neighbour_port, neighbour_warning, publisher_answers, Board, NeighbourReport,
};
use crate::metrics::Metrics;
use crate::plan::ListenerSpec;

/// Between two rounds of probes. An engine is scaled by an operator, rarely; one round costs a
/// refused connection per engine (well under a millisecond on a LAN).
const PROBE_INTERVAL: Duration = Duration::from_secs(30);

/// How long one probe waits for a handshake. ZMTP's greeting takes one round trip (well under
/// 1 ms on a LAN); only a silent peer costs the whole wait.
const PROBE_WAIT: Duration = Duration::from_millis(500);

/// One fixed engine's neighbour port.
struct Target {
    engine: String,
    endpoint: String,
    port: u16,
    dp_size: u32,
}

/// The probing thread; `sync` gives it the fixed engines of a new configuration.
pub struct NeighbourWatch {
    targets: Arc<Mutex<Vec<Target>>>,
    wake: Sender<()>,
    thread: JoinHandle<()>,
}

impl NeighbourWatch {
    pub fn spawn(board: Arc<Board>, metrics: Arc<Metrics>) -> anyhow::Result<NeighbourWatch> {
        let targets: Arc<Mutex<Vec<Target>>> = Arc::default();
        let (wake, woken) = mpsc::channel::<()>();
        let probed = Arc::clone(&targets);
        let thread = std::thread::Builder::new()
            .name("neighbour-probe".into())
            .spawn(move || {
                let zmq = zmq::Context::new();
                // The ports answering now, by engine: a warning is logged when one appears.
                let mut answering: BTreeMap<String, u16> = BTreeMap::new();
                loop {
                    match woken.recv_timeout(PROBE_INTERVAL) {
                        Ok(()) | Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                    let targets = probed.lock();
                    probe_round(&zmq, &targets, &board, &metrics, &mut answering);
                }
            })
            .context("spawning the neighbour probe thread")?;
        Ok(NeighbourWatch {
            targets,
            wake,
            thread,
        })
    }

    /// Probes the fixed engines of `config` from now on, starting now; a port that is a rank
    /// of `plan` (another engine's) is not probed.
    pub fn sync(&self, config: &Config, plan: &[ListenerSpec]) {
        let in_plan: BTreeSet<&str> = plan
            .iter()
            .flat_map(|spec| std::iter::once(spec.endpoint.as_str()).chain(spec.replay.as_deref()))
            .collect();
        let targets = config.engines.iter().filter_map(|engine| {
            let fixed = engine.fixed()?;
            let port = neighbour_port(fixed.zmq_port, fixed.dp_rank_start, fixed.dp_size)?;
            let endpoint = if engine.host.contains(':') {
                format!("tcp://[{}]:{port}", engine.host)
            } else {
                format!("tcp://{}:{port}", engine.host)
            };
            (!in_plan.contains(endpoint.as_str())).then(|| Target {
                engine: engine.name.clone(),
                endpoint,
                port,
                dp_size: fixed.dp_size,
            })
        });
        *self.targets.lock() = targets.collect();
        let _ = self.wake.send(());
    }

    pub fn stop(self) {
        drop(self.wake);
        // A panicked thread has already logged why.
        let _ = self.thread.join();
    }
}

/// Probes every target once; logs, counts and shows each port that starts answering, and
/// clears each that stops (or is no longer the engine's neighbour after a reload).
fn probe_round(
    zmq: &zmq::Context,
    targets: &[Target],
    board: &Board,
    metrics: &Metrics,
    answering: &mut BTreeMap<String, u16>,
) {
    answering.retain(|engine, port| {
        let still = targets
            .iter()
            .any(|t| &t.engine == engine && t.port == *port);
        if !still {
            board.update(engine, |report| report.neighbour = None);
        }
        still
    });
    for target in targets {
        let answers = match publisher_answers(zmq, &target.endpoint, PROBE_WAIT) {
            Ok(answers) => answers,
            Err(error) => {
                warn!(
                    "engine {}: probing {}: {error:#}",
                    target.engine, target.endpoint
                );
                continue;
            }
        };
        let was = answering.get(&target.engine) == Some(&target.port);
        match (was, answers) {
            (false, true) => {
                let warning = neighbour_warning(&target.engine, target.port, target.dp_size);
                warn!("{warning} (nothing from that port is indexed)");
                metrics.engine(&target.engine).neighbour_publisher();
                answering.insert(target.engine.clone(), target.port);
                board.update(&target.engine, |report| {
                    report.neighbour = Some(NeighbourReport {
                        port: target.port,
                        warning,
                    });
                });
            }
            (true, false) => {
                info!(
                    "engine {}: no publisher answers on {} any more",
                    target.engine, target.port
                );
                answering.remove(&target.engine);
                board.update(&target.engine, |report| report.neighbour = None);
            }
            _ => {}
        }
    }
}
