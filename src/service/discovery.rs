//! Asking discovered engines for their ranks while the service runs: one task per engine with
//! `discover`, its question asked on the runtime (the endpoints it names checked on the
//! blocking pool), so that an engine whose API server is slow or down (each question may take
//! `Limits::whole`, 5 s) never delays another engine or the rest of the service.
//!
//! Owns when each engine is asked: at start, on reload (SIGHUP, `POST /reload`), every
//! `discover_interval_s`, early when one of its ranks looks restarted or stays disconnected
//! (with `tcp://*:0` a restarted rank binds another port), and, while it fails, after a backoff
//! from 1 s doubling up to the interval, all on tokio time (a test pauses and advances it).
//! Owns what each outcome logs, counts and puts on the board. Never: touches the registry or
//! the plan itself: a new answer is handed to the service's `apply` (the reloader), which
//! applies it through `plan` and `Registry::apply` exactly as a reload, so unchanged ranks keep
//! their socket and blocks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{info, warn};

use super::tasks::{blocking, Stopped, Task};
use crate::config::{Config, DiscoverConfig};
use crate::discover::{
    Board, Client, Disagreement, DiscoverError, Discovery, EndpointPolicy, EngineApi, EngineKind,
    Failure,
};
use crate::metrics::{DiscoveryOutcome, EndpointSource, EngineMetrics, LayoutKey, Metrics};
use crate::plan::WorkerKey;
use crate::registry::{ListenerView, RanksReader};

/// The first wait after a failed question; doubles up to the engine's interval.
const BACKOFF_MIN: Duration = Duration::from_secs(1);

/// The least time between two early questions (a rank looks restarted or disconnected). A
/// restarted vLLM rank takes seconds to come back, so asking more often than every 2 s would
/// only repeat the old answer; each early question that changes nothing doubles the spacing,
/// up to the interval.
const EARLY_MIN: Duration = Duration::from_secs(2);

/// Hands an engine's new answer to the service, which applies it like a reload: the engine's
/// name, the API it asked (so an answer racing a reload that changed `discover` is dropped)
/// and the answer. It blocks (the reloader's lock, listener starts): it is called on the
/// blocking pool.
pub type ApplyFn = dyn Fn(&EngineApi, Discovery) + Send + Sync;

/// Why an engine's task is woken before its next question is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    /// A reload: ask now.
    Reload,
    /// One of its ranks looks restarted or stays disconnected: ask soon (rate limited).
    Suspect,
}

/// One engine's asking task; dropping it stops the task without waiting (see `Askers::stop`).
struct Asker {
    settings: DiscoverConfig,
    wake: mpsc::UnboundedSender<Wake>,
    task: Task,
}

/// Every discovered engine's asking task.
pub struct Askers {
    runtime: Handle,
    client: Arc<Client>,
    policy: Arc<EndpointPolicy>,
    board: Arc<Board>,
    metrics: Arc<Metrics>,
    apply: Arc<ApplyFn>,
    /// One answer applied at a time: the reloader applies them one at a time anyway, and
    /// waiting for that here, on the runtime, keeps the blocking pool's threads for other work.
    applying: Arc<tokio::sync::Mutex<()>>,
    engines: BTreeMap<String, Asker>,
}

impl Askers {
    /// Askers whose tasks run on `runtime`.
    pub fn new(
        runtime: Handle,
        client: Client,
        policy: Arc<EndpointPolicy>,
        board: Arc<Board>,
        metrics: Arc<Metrics>,
        apply: Arc<ApplyFn>,
    ) -> Askers {
        Askers {
            runtime,
            client: Arc::new(client),
            policy,
            board,
            metrics,
            apply,
            applying: Arc::default(),
            engines: BTreeMap::new(),
        }
    }

    /// Makes the tasks match `config` (at start and on reload): an engine gone, or whose
    /// `discover` settings changed, has its task stopped; a new one (or a changed one) gets
    /// a task that asks at once; an engine that stays is asked now.
    pub fn sync(&mut self, config: &Config) {
        let wanted: BTreeMap<&str, &DiscoverConfig> = config
            .engines
            .iter()
            .filter_map(|engine| Some((engine.name.as_str(), engine.discover()?)))
            .collect();
        // Dropped: told to stop, not waited for (see `stop`).
        self.engines
            .retain(|name, asker| wanted.get(name.as_str()) == Some(&&asker.settings));
        for (name, settings) in wanted {
            match self.engines.get(name) {
                Some(asker) => {
                    // A task that has ended (it panicked) has nothing left to ask.
                    let _ = asker.wake.send(Wake::Reload);
                }
                None => {
                    let asker = self.spawn(settings.clone());
                    self.engines.insert(name.to_string(), asker);
                }
            }
        }
    }

    /// Asks `engine` soon: one of its ranks looks restarted or stays disconnected.
    pub fn suspect(&self, engine: &str) {
        if let Some(asker) = self.engines.get(engine) {
            let _ = asker.wake.send(Wake::Suspect);
        }
    }

    /// Stops every task and waits for them, which is at once: a task stops where it waits,
    /// even for a question under way (that may take `Limits::whole`, 5 s, and SIGTERM must end
    /// the process within a second): the question is dropped with its task (its connection
    /// closed); an apply under way finishes against a registry whose shutdown signal is
    /// raised (it starts nothing).
    pub async fn stop(self) {
        for asker in self.engines.into_values() {
            asker.task.stop().await;
        }
    }

    fn spawn(&self, settings: DiscoverConfig) -> Asker {
        let (wake, woken) = mpsc::unbounded_channel();
        let name = settings.api.engine.clone();
        let asking = Asking {
            settings: settings.clone(),
            client: Arc::clone(&self.client),
            policy: Arc::clone(&self.policy),
            board: Arc::clone(&self.board),
            metrics: self.metrics.engine(&name),
            refusals: Arc::clone(&self.metrics),
            apply: Arc::clone(&self.apply),
            applying: Arc::clone(&self.applying),
            hint: None,
            last_ranks: None,
            reported: Vec::new(),
            logged_error: None,
        };
        let task = Task::spawn(&self.runtime, |stopped| asking.run(woken, stopped));
        Asker {
            settings,
            wake,
            task,
        }
    }
}

/// One engine's task state.
struct Asking {
    settings: DiscoverConfig,
    client: Arc<Client>,
    policy: Arc<EndpointPolicy>,
    board: Arc<Board>,
    metrics: EngineMetrics,
    /// Where refused endpoints are counted.
    refusals: Arc<Metrics>,
    apply: Arc<ApplyFn>,
    applying: Arc<tokio::sync::Mutex<()>>,
    /// The kind that answered last: its route is asked first.
    hint: Option<EngineKind>,
    /// The ranks of the last answer taken, for the log.
    last_ranks: Option<Vec<u32>>,
    /// The disagreements last warned about: each distinct set is warned about once.
    reported: Vec<Disagreement>,
    /// The failure last warned about: a repeat of it is not logged again.
    logged_error: Option<(Failure, String)>,
}

impl Asking {
    async fn run(mut self, mut woken: mpsc::UnboundedReceiver<Wake>, mut stopped: Stopped) {
        let interval = Duration::from_secs(u64::from(self.settings.interval_s));
        let mut backoff = BACKOFF_MIN;
        let mut early_spacing = EARLY_MIN;
        let mut last_asked: Option<Instant> = None;
        let mut due = Instant::now();
        loop {
            let early = tokio::select! {
                biased;
                () = stopped.wait() => return,
                wake = woken.recv() => match wake {
                    Some(Wake::Reload) => false,
                    Some(Wake::Suspect) => {
                        if last_asked.is_some_and(|at| at.elapsed() < early_spacing) {
                            continue;
                        }
                        true
                    }
                    None => return,
                },
                () = tokio::time::sleep_until(due) => false,
            };
            last_asked = Some(Instant::now());
            let Some(asked) = stopped.unless(self.ask()).await else {
                return;
            };
            match asked {
                Ok(changed) => {
                    backoff = BACKOFF_MIN;
                    early_spacing = match (early, changed) {
                        (true, false) => (early_spacing * 2).min(interval.max(EARLY_MIN)),
                        _ => EARLY_MIN,
                    };
                    due = Instant::now() + interval;
                }
                Err(()) => {
                    due = Instant::now() + backoff;
                    backoff = (backoff * 2).min(interval.max(BACKOFF_MIN));
                }
            }
        }
    }

    /// One question; `Ok(true)` when the answer differs from the last one taken.
    async fn ask(&mut self) -> Result<bool, ()> {
        let policy = Arc::clone(&self.policy);
        let refusals = Arc::clone(&self.refusals);
        let api = self.settings.api.clone();
        let checked = match self.client.discover(&api, self.hint).await {
            // The endpoints' names are resolved by the policy: a blocking lookup.
            Ok(discovery) => {
                blocking(move || check_endpoints(&policy, &refusals, &api, discovery)).await
            }
            Err(error) => Err(error),
        };
        match checked {
            Ok(discovery) => Ok(self.answered(discovery).await),
            Err(error) => {
                self.failed(&error);
                Err(())
            }
        }
    }

    async fn answered(&mut self, discovery: Discovery) -> bool {
        let engine = &self.settings.api.engine;
        self.metrics.discovery(DiscoveryOutcome::Ok);
        self.metrics.set_discovered_ranks(discovery.ranks.len());
        let disagreements = discovery.disagreements(&self.settings.file);
        let keys: Vec<LayoutKey> = disagreements
            .iter()
            .filter_map(|d| LayoutKey::from_key(d.key))
            .collect();
        self.metrics.set_disagreements(&keys);
        if disagreements != self.reported {
            for disagreement in &disagreements {
                warn!(
                    engine = %engine,
                    "engine {engine}: {}; the engine wins: fix or remove `{}` in indexer.toml",
                    disagreement.detail, disagreement.key
                );
            }
            self.reported = disagreements.clone();
        }
        if self.logged_error.take().is_some() {
            info!(engine = %engine, "engine {engine}: {} answers again", discovery.url);
        }
        let ranks: Vec<u32> = discovery.ranks.iter().map(|rank| rank.dp_rank).collect();
        let changed = self.last_ranks.as_ref() != Some(&ranks) || self.hint != Some(discovery.kind);
        if changed && !discovery.publishes_events {
            info!(
                engine = %engine,
                "engine {engine}: {}: one rank with no event link, routed by load alone",
                crate::discover::NO_EVENTS
            );
        } else if changed {
            info!(
                engine = %engine,
                "engine {engine}: {} reports {} rank{} {ranks:?}",
                discovery.url,
                ranks.len(),
                if ranks.len() == 1 { "" } else { "s" },
            );
        }
        self.board.update(engine, |report| {
            if let Some(report) = &mut report.discovery {
                report.answered(discovery.kind, ranks.len(), &disagreements);
            }
        });
        self.hint = Some(discovery.kind);
        self.last_ranks = Some(ranks);
        // The applier compares the whole answer (endpoints included) with the one in effect.
        let _turn = self.applying.lock().await;
        let (apply, api) = (Arc::clone(&self.apply), self.settings.api.clone());
        blocking(move || apply(&api, discovery)).await;
        changed
    }

    fn failed(&mut self, error: &DiscoverError) {
        let engine = &self.settings.api.engine;
        self.metrics.discovery(outcome(error.failure));
        let message = error.to_string();
        let keeping = match &self.last_ranks {
            Some(ranks) => format!("keeping the last good {} ranks", ranks.len()),
            None => "no ranks until it answers".to_string(),
        };
        let again = Some((error.failure, message.clone()));
        if self.logged_error != again {
            warn!(engine = %engine, "{message}; {keeping}, retrying with backoff");
            self.logged_error = again;
        }
        self.board.update(engine, |report| {
            if let Some(report) = &mut report.discovery {
                report.failed(message);
            }
        });
    }
}

/// The answer, unless one of its endpoints is refused (`EndpointPolicy`): then the whole answer
/// is, as for any rank kv-indexer cannot use, and each refusal is counted in `refusals`.
/// Blocks while it resolves the endpoints' host names.
fn check_endpoints(
    policy: &EndpointPolicy,
    refusals: &Metrics,
    api: &EngineApi,
    discovery: Discovery,
) -> Result<Discovery, DiscoverError> {
    let endpoints = discovery
        .ranks
        .iter()
        .flat_map(|rank| std::iter::once(&rank.endpoint).chain(&rank.replay));
    let who = format!("engine {}", api.engine);
    let Err(refused) = policy.check(&who, &api.host, endpoints) else {
        return Ok(discovery);
    };
    for refusal in &refused {
        refusals.endpoint_refused(EndpointSource::discovery, refusal.reason);
    }
    /// Enough to see the pattern of a hostile answer without a line per rank.
    const NAMED: usize = 3;
    let mut detail: Vec<String> = refused
        .iter()
        .take(NAMED)
        .map(ToString::to_string)
        .collect();
    if refused.len() > NAMED {
        detail.push(format!("and {} more", refused.len() - NAMED));
    }
    Err(DiscoverError {
        engine: api.engine.clone(),
        url: discovery.url,
        failure: Failure::Shape,
        detail: format!(
            "answered endpoints kv-indexer refuses: {}",
            detail.join("; ")
        ),
    })
}

/// Looks a rank must be seen disconnected in a row before its engine is asked early: the
/// service looks every second, and a listener that has just (re)connected needs a moment for
/// its handshake, so 3 looks (at least 2 s) mean "stays disconnected".
const DISCONNECTED_LOOKS: u32 = 3;

/// How often the rank watch looks at the listeners' statuses (one copy of the published
/// views, no registry lock).
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// The task that looks at every rank once a second and names the engines to ask early.
pub struct RankWatch(Task);

impl RankWatch {
    /// Looks at `ranks` every `LOOK_EVERY` and calls `suspect` with each engine that has a rank
    /// looking restarted or staying disconnected (`Askers::suspect` ignores fixed engines).
    /// `suspect` must not block: it runs on the runtime.
    pub fn spawn(
        runtime: &Handle,
        ranks: RanksReader,
        suspect: impl Fn(&str) + Send + 'static,
    ) -> RankWatch {
        RankWatch(Task::spawn(runtime, |mut stopped| async move {
            let mut looks = RankLooks::default();
            while stopped
                .unless(tokio::time::sleep(LOOK_EVERY))
                .await
                .is_some()
            {
                for engine in looks.look(&ranks.current().views()) {
                    suspect(&engine);
                }
            }
        }))
    }

    /// Stops the task; a look takes no time, so this is at once.
    pub async fn stop(self) {
        self.0.stop().await;
    }
}

/// Which engines have a rank that looks restarted or stays disconnected, from one look at the
/// registry's views to the next.
#[derive(Default)]
struct RankLooks {
    /// By rank: its gap count (a publisher restart counts as one) and the looks in a row it
    /// was seen disconnected.
    seen: BTreeMap<WorkerKey, (u64, u32)>,
}

impl RankLooks {
    /// The engines to ask early after this look: a rank whose gap count grew since the last
    /// look (restarted: its seq went back), or seen disconnected `DISCONNECTED_LOOKS` times in
    /// a row (counted once per streak).
    fn look(&mut self, views: &[ListenerView]) -> BTreeSet<String> {
        let mut suspects = BTreeSet::new();
        let mut seen = BTreeMap::new();
        // A rank with no event link (its engine publishes none) is never connected.
        for view in views.iter().filter(|view| view.spec.publishes_events) {
            let Some(status) = &view.status else { continue };
            let key = &view.spec.key;
            let (gaps, looks) = self.seen.get(key).copied().unwrap_or((status.gaps, 0));
            let looks = if status.connected { 0 } else { looks + 1 };
            if status.gaps > gaps || looks == DISCONNECTED_LOOKS {
                suspects.insert(key.engine.clone());
            }
            seen.insert(key.clone(), (status.gaps, looks));
        }
        self.seen = seen;
        suspects
    }
}

/// The metric label of a failure.
fn outcome(failure: Failure) -> DiscoveryOutcome {
    match failure {
        Failure::Unreachable => DiscoveryOutcome::Unreachable,
        Failure::Timeout => DiscoveryOutcome::Timeout,
        Failure::NotHttp => DiscoveryOutcome::NotHttp,
        Failure::Status(_) => DiscoveryOutcome::Status,
        Failure::Redirect(_) => DiscoveryOutcome::Redirect,
        Failure::TooLarge => DiscoveryOutcome::TooLarge,
        Failure::NotJson => DiscoveryOutcome::NotJson,
        Failure::Shape => DiscoveryOutcome::Shape,
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::discover::Limits;

    /// An engine's API server on 127.0.0.1 that answers 503 to its first `failures` questions
    /// and vLLM's `{}` (no ranks) to the rest, `questions` in all, telling `asked` of each
    /// question as it arrives. It runs on the test's runtime, as the question does: a paused
    /// clock then advances only when neither side has a byte to read, never under a question.
    async fn engine_api(
        failures: usize,
        questions: usize,
        asked: mpsc::UnboundedSender<()>,
    ) -> (u16, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the engine's API");
        let port = listener.local_addr().expect("its address").port();
        let server = tokio::spawn(async move {
            for n in 0..questions {
                let (mut socket, _) = listener.accept().await.expect("a question");
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    socket
                        .read_exact(&mut byte)
                        .await
                        .expect("the request head");
                    head.push(byte[0]);
                }
                assert!(head.starts_with(b"GET /kv_event_sources "), "{head:?}");
                let _ = asked.send(());
                let reply: &[u8] = if n < failures {
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
                };
                socket.write_all(reply).await.expect("the answer");
            }
        });
        (port, server)
    }

    /// Paused time: the asker's waits are tokio's, so the test runs through half a minute of
    /// backoff and interval at once. Each question is reported as it arrives, while its GET
    /// and the engine's answer hold the paused clock still, so its time is the time it was
    /// asked.
    #[tokio::test(start_paused = true)]
    async fn a_failing_engine_is_asked_again_after_1_2_4_s_then_every_interval() {
        let (asked, mut questions) = mpsc::unbounded_channel();
        let (port, server) = engine_api(3, 6, asked).await;
        let text = format!(
            "[[engine]]\nname = \"asked\"\ndiscover = \"http://127.0.0.1:{port}\"\n\
             discover_interval_s = 10\n"
        );
        let config = Config::parse(&text, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
        let ignore: Arc<ApplyFn> = Arc::new(|_: &EngineApi, _: Discovery| {});
        let mut askers = Askers::new(
            Handle::current(),
            Client::new(Limits::default()),
            Arc::new(EndpointPolicy::new(Vec::new())),
            Arc::new(Board::default()),
            Arc::new(Metrics::new()),
            ignore,
        );
        let start = Instant::now();
        askers.sync(&config);
        let mut at = Vec::new();
        for _ in 0..6 {
            let asked = tokio::time::timeout(Duration::from_secs(60), questions.recv()).await;
            assert!(matches!(asked, Ok(Some(()))), "no question after {at:?}");
            at.push(start.elapsed().as_secs());
        }
        askers.stop().await;
        server.await.expect("the engine's API");
        // Three 503s: asked again after 1, 2 and 4 s; then answered, asked every 10 s.
        assert_eq!(at, [0, 1, 3, 7, 17, 27]);
    }
}
