//! The neighbour-port watch of fixed engines: a `dp_size` typed too small leaves a rank
//! unindexed without a word, so the port the next rank would use (`zmq_port + dp_rank_start +
//! dp_size`) is probed, and a publisher answering there is made loud: warned about once with the
//! fix, counted (`neighbour_publishers_total`) and shown on `/workers`.
//!
//! Owns: which ports are probed (not one that is another rank of the plan), when (at start, on
//! reload, every 30 s of tokio time), and the transitions a probe reports. Its task waits for
//! each probe's handshake on the blocking pool. Never: subscribes to or indexes anything from
//! that port (`discover::publisher_answers` only waits for the handshake).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::watch;
use tracing::{info, warn};

use super::tasks::{blocking, Stopped, Task};
use crate::config::Config;
use crate::discover::{
    neighbour_port, neighbour_warning, publisher_answers, Board, NeighbourReport,
};
use crate::endpoint::Endpoint;
use crate::metrics::Metrics;
use crate::plan::ListenerSpec;

/// Between two rounds of probes. An engine is scaled by an operator, rarely; one round costs a
/// refused connection per engine (well under a millisecond on a LAN).
const PROBE_INTERVAL: Duration = Duration::from_secs(30);

/// How long one probe waits for a handshake. ZMTP's greeting and handshake take two round
/// trips (well under 1 ms on a LAN, 200 ms over a 100 ms link); only a silent peer costs the
/// whole wait. It also bounds how long `stop` waits for the probe under way.
const PROBE_WAIT: Duration = Duration::from_millis(250);

/// One fixed engine's neighbour port.
struct Target {
    engine: String,
    endpoint: Endpoint,
    port: u16,
    dp_size: u32,
}

/// The probing task; `sync` gives it the fixed engines of a new configuration.
pub struct NeighbourWatch {
    /// What the task probes; a new value wakes it for a round at once.
    targets: watch::Sender<Arc<Vec<Target>>>,
    task: Task,
}

impl NeighbourWatch {
    /// A watch with nothing to probe until `sync`, its task on `runtime`.
    pub fn spawn(runtime: &Handle, board: Arc<Board>, metrics: Arc<Metrics>) -> NeighbourWatch {
        let (targets, probed) = watch::channel(Arc::new(Vec::new()));
        let task = Task::spawn(runtime, |stopped| async move {
            let round = Round {
                zmq: crate::registry::new_context(),
                board,
                metrics,
            };
            round.run(probed, stopped).await;
            // Terminating the context joins its I/O threads: not on a worker of the runtime.
            blocking(move || drop(round)).await;
        });
        NeighbourWatch { targets, task }
    }

    /// Probes the fixed engines of `config` from now on, starting now; a port that is a rank
    /// of `plan` (another engine's) is not probed.
    pub fn sync(&self, config: &Config, plan: &[ListenerSpec]) {
        self.targets.send_replace(Arc::new(targets(config, plan)));
    }

    /// Stops the task; waits at most for the probe under way (`PROBE_WAIT`).
    pub async fn stop(self) {
        self.task.stop().await;
    }
}

/// The neighbour port of every fixed engine of `config`, except a port that is a rank of `plan`
/// (an engine placed right after this one).
fn targets(config: &Config, plan: &[ListenerSpec]) -> Vec<Target> {
    let in_plan: BTreeSet<&Endpoint> = plan
        .iter()
        .flat_map(|spec| std::iter::once(&spec.endpoint).chain(&spec.replay))
        .collect();
    config
        .engines
        .iter()
        .filter_map(|engine| {
            let fixed = engine.fixed()?;
            let port = neighbour_port(fixed.zmq_port, fixed.dp_rank_start, fixed.dp_size)?;
            let endpoint = Endpoint::new(engine.host.clone(), port);
            (!in_plan.contains(&endpoint)).then(|| Target {
                engine: engine.name.clone(),
                endpoint,
                port,
                dp_size: fixed.dp_size,
            })
        })
        .collect()
}

/// What the probes use.
struct Round {
    zmq: zmq::Context,
    board: Arc<Board>,
    metrics: Arc<Metrics>,
}

impl Round {
    /// A round at once when the targets change, else every `PROBE_INTERVAL`, until stopped.
    async fn run(&self, mut probed: watch::Receiver<Arc<Vec<Target>>>, mut stopped: Stopped) {
        // The ports answering now, by engine: a warning is logged when one appears.
        let mut answering: BTreeMap<String, u16> = BTreeMap::new();
        loop {
            tokio::select! {
                biased;
                () = stopped.wait() => return,
                changed = probed.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
            let targets = Arc::clone(&probed.borrow_and_update());
            self.probe(&targets, &mut answering, &stopped).await;
        }
    }

    /// Probes every target once, unless stopped between two probes; logs, counts and shows
    /// each port that starts answering, and clears each that stops (or is no longer the
    /// engine's neighbour after a reload).
    async fn probe(
        &self,
        targets: &[Target],
        answering: &mut BTreeMap<String, u16>,
        stopped: &Stopped,
    ) {
        let (board, metrics) = (&self.board, &self.metrics);
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
            if stopped.is_set() {
                return;
            }
            let (zmq, endpoint) = (self.zmq.clone(), target.endpoint.to_string());
            // Not raced with the stop: the probe's socket closes within `PROBE_WAIT`.
            let answers = blocking(move || publisher_answers(&zmq, &endpoint, PROBE_WAIT)).await;
            let answers = match answers {
                Ok(answers) => answers,
                Err(error) => {
                    warn!(
                        engine = %target.engine,
                        port = target.port,
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
                    warn!(engine = %target.engine, port = target.port, "{warning} (nothing from that port is indexed)");
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
                        engine = %target.engine,
                        port = target.port,
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan;

    #[test]
    fn the_neighbour_is_probed_unless_another_engine_runs_a_rank_there() {
        let text = r#"
[[engine]]
name = "a"
host = "10.0.0.5"
zmq_port = 5557
dp_size = 2
[[engine]]
name = "right-after-a"
host = "10.0.0.5"
zmq_port = 5559
[[engine]]
name = "v6"
host = "fd00::5"
zmq_port = 6000
dp_rank_start = 2
[[engine]]
name = "asked"
discover = "http://10.0.0.5:8000"
"#;
        let config = Config::parse(text, "f").unwrap_or_else(|err| panic!("{err}"));
        let probed: Vec<(String, String)> = targets(&config, &plan::expand(&config))
            .into_iter()
            .map(|t| (t.engine, t.endpoint.to_string()))
            .collect();
        assert_eq!(
            probed,
            [
                (
                    "right-after-a".to_string(),
                    "tcp://10.0.0.5:5560".to_string()
                ),
                ("v6".to_string(), "tcp://[fd00::5]:6003".to_string()),
            ]
        );
    }
}
