//! Asking discovered engines for their ranks while the service runs: one thread per engine
//! with `discover`, so that an engine whose API server is slow or down (each question may take
//! `Limits::whole`, 5 s) never delays another engine or the rest of the service.
//!
//! Owns when each engine is asked: at start, on reload (SIGHUP, `POST /reload`), every
//! `discover_interval_s`, early when one of its ranks looks restarted or stays disconnected
//! (with `tcp://*:0` a restarted rank binds another port), and, while it fails, after a backoff
//! from 1 s doubling up to the interval. Owns what each outcome logs, counts and puts on the
//! board. Never: touches the registry or the plan itself: a new answer is handed to the
//! service's `apply` (the reloader), which applies it through `plan` and `Registry::apply`
//! exactly as a reload, so unchanged ranks keep their socket and blocks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use log::{info, warn};

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
/// and the answer.
pub type ApplyFn = dyn Fn(&EngineApi, Discovery) + Send + Sync;

/// Why an engine's thread is woken before its next question is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    /// A reload: ask now.
    Reload,
    /// One of its ranks looks restarted or stays disconnected: ask soon (rate limited).
    Suspect,
}

/// One engine's asking thread; dropping `wake` stops it (the thread is not joined).
struct Asker {
    settings: DiscoverConfig,
    wake: Sender<Wake>,
}

/// Every discovered engine's asking thread.
pub struct Askers {
    client: Arc<Client>,
    policy: Arc<EndpointPolicy>,
    board: Arc<Board>,
    metrics: Arc<Metrics>,
    apply: Arc<ApplyFn>,
    engines: BTreeMap<String, Asker>,
}

impl Askers {
    pub fn new(
        client: Client,
        policy: Arc<EndpointPolicy>,
        board: Arc<Board>,
        metrics: Arc<Metrics>,
        apply: Arc<ApplyFn>,
    ) -> Askers {
        Askers {
            client: Arc::new(client),
            policy,
            board,
            metrics,
            apply,
            engines: BTreeMap::new(),
        }
    }

    /// Makes the threads match `config` (at start and on reload): an engine gone, or whose
    /// `discover` settings changed, has its thread stopped; a new one (or a changed one) gets
    /// a thread that asks at once; an engine that stays is asked now.
    pub fn sync(&mut self, config: &Config) -> anyhow::Result<()> {
        let wanted: BTreeMap<&str, &DiscoverConfig> = config
            .engines
            .iter()
            .filter_map(|engine| Some((engine.name.as_str(), engine.discover()?)))
            .collect();
        let leaving: Vec<String> = self
            .engines
            .iter()
            .filter(|(name, asker)| wanted.get(name.as_str()) != Some(&&asker.settings))
            .map(|(name, _)| name.clone())
            .collect();
        for name in leaving {
            // Its thread ends after the question under way (see `stop`).
            self.engines.remove(&name);
        }
        for (name, settings) in wanted {
            match self.engines.get(name) {
                Some(asker) => {
                    // A thread that is gone has nothing left to ask.
                    let _ = asker.wake.send(Wake::Reload);
                }
                None => {
                    let asker = self.spawn(settings.clone())?;
                    self.engines.insert(name.to_string(), asker);
                }
            }
        }
        Ok(())
    }

    /// Asks `engine` soon: one of its ranks looks restarted or stays disconnected.
    pub fn suspect(&self, engine: &str) {
        if let Some(asker) = self.engines.get(engine) {
            let _ = asker.wake.send(Wake::Suspect);
        }
    }

    /// Tells every thread to stop, without waiting: a question under way may take
    /// `Limits::whole` (5 s), and SIGTERM must end the process within a second. A thread ends
    /// after that question; its answer, if any, reaches a registry whose shutdown signal is
    /// raised (it starts nothing), or an applier that drops it (a reload changed the engine).
    pub fn stop(self) {
        drop(self.engines);
    }

    fn spawn(&self, settings: DiscoverConfig) -> anyhow::Result<Asker> {
        let (wake, woken) = mpsc::channel();
        let name = settings.api.engine.clone();
        let mut asking = Asking {
            settings: settings.clone(),
            client: Arc::clone(&self.client),
            policy: Arc::clone(&self.policy),
            board: Arc::clone(&self.board),
            metrics: self.metrics.engine(&name),
            refusals: Arc::clone(&self.metrics),
            apply: Arc::clone(&self.apply),
            hint: None,
            last_ranks: None,
            reported: Vec::new(),
            logged_error: None,
        };
        std::thread::Builder::new()
            .name(format!("discover-{name}"))
            .spawn(move || asking.run(&woken))
            .with_context(|| format!("engine {name}: spawning its discovery thread"))?;
        Ok(Asker { settings, wake })
    }
}

/// One engine's thread state.
struct Asking {
    settings: DiscoverConfig,
    client: Arc<Client>,
    policy: Arc<EndpointPolicy>,
    board: Arc<Board>,
    metrics: EngineMetrics,
    /// Where refused endpoints are counted.
    refusals: Arc<Metrics>,
    apply: Arc<ApplyFn>,
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
    fn run(&mut self, woken: &mpsc::Receiver<Wake>) {
        let interval = Duration::from_secs(u64::from(self.settings.interval_s));
        let mut backoff = BACKOFF_MIN;
        let mut early_spacing = EARLY_MIN;
        let mut last_asked: Option<Instant> = None;
        let mut due = Instant::now();
        loop {
            let wait = due.saturating_duration_since(Instant::now());
            let early = match woken.recv_timeout(wait) {
                Ok(Wake::Reload) => false,
                Ok(Wake::Suspect) => {
                    if last_asked.is_some_and(|at| at.elapsed() < early_spacing) {
                        continue;
                    }
                    true
                }
                Err(RecvTimeoutError::Timeout) => false,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            last_asked = Some(Instant::now());
            match self.ask() {
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
    fn ask(&mut self) -> Result<bool, ()> {
        let api = &self.settings.api;
        let checked = self
            .client
            .discover(api, self.hint)
            .and_then(|discovery| self.check_endpoints(discovery));
        match checked {
            Ok(discovery) => Ok(self.answered(discovery)),
            Err(error) => {
                self.failed(&error);
                Err(())
            }
        }
    }

    /// The answer, unless one of its endpoints is refused (`EndpointPolicy`): then the whole
    /// answer is, as for any rank kv-indexer cannot use, and each refusal is counted.
    fn check_endpoints(&self, discovery: Discovery) -> Result<Discovery, DiscoverError> {
        let api = &self.settings.api;
        let endpoints = discovery
            .ranks
            .iter()
            .flat_map(|rank| std::iter::once(&rank.endpoint).chain(&rank.replay));
        let who = format!("engine {}", api.engine);
        let Err(refused) = self.policy.check(&who, &api.host, endpoints) else {
            return Ok(discovery);
        };
        for refusal in &refused {
            self.refusals
                .endpoint_refused(EndpointSource::discovery, refusal.reason);
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

    fn answered(&mut self, discovery: Discovery) -> bool {
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
                    "engine {engine}: {}; the engine wins: fix or remove `{}` in indexer.toml",
                    disagreement.detail, disagreement.key
                );
            }
            self.reported = disagreements.clone();
        }
        if self.logged_error.take().is_some() {
            info!("engine {engine}: {} answers again", discovery.url);
        }
        let ranks: Vec<u32> = discovery.ranks.iter().map(|rank| rank.dp_rank).collect();
        let changed = self.last_ranks.as_ref() != Some(&ranks) || self.hint != Some(discovery.kind);
        if changed {
            info!(
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
        (self.apply)(&self.settings.api, discovery);
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
            warn!("{message}; {keeping}, retrying with backoff");
            self.logged_error = again;
        }
        self.board.update(engine, |report| {
            if let Some(report) = &mut report.discovery {
                report.failed(message);
            }
        });
    }
}

/// Looks a rank must be seen disconnected in a row before its engine is asked early: the
/// service looks every second, and a listener that has just (re)connected needs a moment for
/// its handshake, so 3 looks (at least 2 s) mean "stays disconnected".
const DISCONNECTED_LOOKS: u32 = 3;

/// How often the rank watch looks at the listeners' statuses (one copy of the published
/// views, no registry lock).
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// The thread that looks at every rank once a second and names the engines to ask early.
pub struct RankWatch {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl RankWatch {
    /// Looks at `ranks` every `LOOK_EVERY` and calls `suspect` with each engine that has a rank
    /// looking restarted or staying disconnected (`Askers::suspect` ignores fixed engines).
    pub fn spawn(
        ranks: RanksReader,
        suspect: impl Fn(&str) + Send + 'static,
    ) -> anyhow::Result<RankWatch> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("rank-watch".into())
            .spawn(move || {
                let mut looks = RankLooks::default();
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(LOOK_EVERY) {
                    for engine in looks.look(&ranks.current().views()) {
                        suspect(&engine);
                    }
                }
            })
            .context("spawning the rank watch thread")?;
        Ok(RankWatch { stop, thread })
    }

    pub fn stop(self) {
        drop(self.stop);
        // A panicked thread has already logged why.
        let _ = self.thread.join();
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
        for view in views {
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
