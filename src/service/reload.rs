//! Reload: applying the configuration file (SIGHUP, `POST /reload`) and the discovered
//! engines' answers to the registry, one at a time.
//!
//! Owns: the configuration and the discovered answers in effect (`Applied`), the keys that only
//! a restart changes (kept, with a warning), re-reading `auth_token_file` on every reload (the
//! token it holds then alone is valid; a file that cannot be read rejects the reload), and the
//! discovery askers and neighbour probes that follow the file. Never: applies a plan other than
//! through `Reconciler` (so the runtime registrations are applied with it, the file's
//! winning a clash), or leaves the running configuration half-changed when a file is rejected.
//! Its calls block (the file, the registry's lock, listener starts): tasks make them on the
//! runtime's blocking pool.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{error, info, warn};

use super::discovery::Askers;
use super::load_tokenizers;
use super::neighbours::NeighbourWatch;
use crate::auth::Secret;
use crate::config::{self, keep_restart_only, Config, ConfigError, Source};
use crate::discover::{Board, Discovery, EngineApi};
use crate::listener::Replication;
use crate::metrics::Metrics;
use crate::plan::{self, Discoveries, ListenerSpec};
use crate::proxy::{Proxy, Scraper};
use crate::registry::Reconciler;
use crate::registry::ReloadDiff;
use crate::select::Selector;
use crate::tokenize::SharedTokenizers;

/// What the registry runs, as `plan` inputs.
struct Applied {
    /// The file's configuration as last applied, with the values in effect for the keys that
    /// only a restart changes (`config::RESTART_ONLY`).
    config: Config,
    /// Each discovered engine's last good answer.
    discovered: Discoveries,
}

/// Applies the configuration file and the discovered engines' answers to the registry; its
/// lock serializes reloads and answers.
pub(super) struct Reloader {
    /// The file (if any) and the command line's engines: what a reload reads again.
    source: Source,
    applied: Mutex<Applied>,
    /// The one road to the registry: every plan, the file's and a discovered engine's new
    /// answer, is applied together with the runtime registrations.
    engines: Arc<Reconciler>,
    metrics: Arc<Metrics>,
    board: Arc<Board>,
    /// `None` only while starting and after shutdown.
    askers: Mutex<Option<Askers>>,
    neighbours: Mutex<Option<NeighbourWatch>>,
    /// Its `peers` follow the file; listeners are not touched.
    replication: Arc<Replication>,
    /// `/select`'s state; its `[select]` knobs follow the file.
    selector: Arc<Selector>,
    route: Option<Arc<Proxy>>,
    /// The engines' load scrapes: their `metrics_url` and interval follow the file.
    scraper: Arc<Scraper>,
    /// The models' tokenizers, swapped whole once a reload is accepted.
    tokenizers: Arc<SharedTokenizers>,
}

/// What follows the file beside the registry and the discovered engines: the peers and the
/// token (`replication`), the models' tokenizers and the `[select]` knobs.
pub(super) struct Followers {
    pub replication: Arc<Replication>,
    pub tokenizers: Arc<SharedTokenizers>,
    pub selector: Arc<Selector>,
    /// The route front end, when `[route]` was in the file at start.
    pub route: Option<Arc<Proxy>>,
    pub scraper: Arc<Scraper>,
}

impl Reloader {
    /// The reloader of `config` as just applied at start-up; its askers come with `set_askers`
    /// (they hold a weak reference back to it).
    pub(super) fn new(
        source: Source,
        config: Config,
        engines: Arc<Reconciler>,
        metrics: Arc<Metrics>,
        board: Arc<Board>,
        neighbours: NeighbourWatch,
        Followers {
            replication,
            tokenizers,
            selector,
            route,
            scraper,
        }: Followers,
    ) -> Reloader {
        Reloader {
            selector,
            route,
            scraper,
            source,
            applied: Mutex::new(Applied {
                config,
                discovered: Discoveries::new(),
            }),
            engines,
            metrics,
            board,
            askers: Mutex::new(None),
            neighbours: Mutex::new(Some(neighbours)),
            replication,
            tokenizers,
        }
    }

    /// `[route] drain_s` as the file last applied says (a reload changes it for the next
    /// stop); zero without `[route]`.
    pub(super) fn route_drain(&self) -> Duration {
        let drain_s = self
            .applied
            .lock()
            .config
            .route
            .as_ref()
            .map_or(0, |route| route.drain_s);
        Duration::from_secs(u64::from(drain_s))
    }

    pub(super) fn set_askers(&self, askers: Askers) {
        *self.askers.lock() = Some(askers);
    }

    /// Asks `engine` soon (`Askers::suspect`): one of its ranks looks restarted or stays
    /// disconnected.
    pub(super) fn suspect(&self, engine: &str) {
        if let Some(askers) = self.askers.lock().as_ref() {
            askers.suspect(engine);
        }
    }

    /// Stops asking engines (at once: a question under way is dropped) and probing neighbours
    /// (after the probe under way), and waits for their tasks.
    pub(super) async fn stop_watchers(&self) {
        let askers = self.askers.lock().take();
        if let Some(askers) = askers {
            askers.stop().await;
        }
        let neighbours = self.neighbours.lock().take();
        if let Some(neighbours) = neighbours {
            neighbours.stop().await;
        }
    }

    /// Re-reads the configuration file and applies it; a rejected file changes nothing.
    pub(super) fn reload(&self) -> Result<ReloadDiff, ConfigError> {
        let mut guard = self.applied.lock();
        let applied = &mut *guard;
        let path = self.source.describe();
        let mut config = self
            .source
            .load()
            .map_err(|rejected| self.rejected(rejected))?;
        // Read before anything is applied: a token file that cannot be read rejects the reload
        // whole, and the token in effect stays.
        let secret = match config.replicas.read_auth_token() {
            Ok(text) => text.as_deref().and_then(Secret::from_file_text),
            Err(error) => {
                return Err(self.rejected(ConfigError {
                    problems: vec![format!("{error:#}")],
                }))
            }
        };
        // The route's token and the engines' keys too: read before anything is applied.
        if let Some(route) = &config.route {
            if let Err(error) = route.read_token().and_then(|_| Proxy::check_files(&config)) {
                return Err(self.rejected(ConfigError {
                    problems: vec![format!("{error:#}")],
                }));
            }
        }
        // Read before anything changes: a tokenizer that does not load rejects the whole file.
        let discovered = &applied.discovered;
        let tokenizers = match load_tokenizers(&config, discovered, &self.tokenizers.current()) {
            Ok(tokenizers) => tokenizers,
            Err(failed) => {
                return Err(self.rejected(ConfigError {
                    problems: vec![format!("{failed:#}")],
                }))
            }
        };
        let restart_pending = keep_restart_only(&mut config, &applied.config);
        for pending in &restart_pending {
            warn!("{path}: {pending}");
        }
        if config.replicas.retains_contents() != applied.config.replicas.retains_contents() {
            warn!(
                "{path}: peers were added or all removed: restart kv-indexer to apply that (the \
                 new peers list is applied)"
            );
        }
        self.replication.set_peers(config.replicas.peers.clone());
        let guarded = secret.is_some();
        if self.replication.secret().set(secret) {
            // Never the token itself.
            match &config.replicas.auth_token_file {
                Some(file) if guarded => info!(
                    "{path}: the token of auth_token_file {file} changed: only the new token is \
                     accepted from now on, and peers are sent it"
                ),
                _ => warn!(
                    "{path}: auth_token_file is no longer set: /reload, /snapshot/ and the \
                     Dynamo API's /register and /unregister are open to anyone who can connect"
                ),
            }
        }
        self.selector.set_config(config.select.clone());
        self.scraper.reload(&config);
        // An engine asked at the same API keeps its last good answer: a reload does not drop
        // its ranks until it has answered again.
        let old = &applied.config;
        applied.discovered.retain(|name, _| {
            let api = |config: &Config| {
                let engine = config.engines.iter().find(|engine| &engine.name == name)?;
                engine.discover().map(|discover| discover.api.clone())
            };
            api(old).is_some() && api(old) == api(&config)
        });
        for gone in old
            .engines
            .iter()
            .filter(|engine| !config.engines.iter().any(|e| e.name == engine.name))
        {
            self.metrics.forget_engine(&gone.name);
        }
        let route_changed = config::route_changes(old, &config);
        let plan = plan::expand_with(&config, &applied.discovered);
        let mut diff = self.apply_plan(plan.clone(), &format!("reload of {path}"));
        diff.restart_pending = restart_pending.iter().map(ToString::to_string).collect();
        for change in &route_changed {
            info!("{path}: {change}");
        }
        diff.route_changed = route_changed;
        applied.config = config;
        self.board.retain(&board_engines(&applied.config));
        if let Some(askers) = self.askers.lock().as_mut() {
            askers.sync(&applied.config);
        }
        if let Some(neighbours) = self.neighbours.lock().as_ref() {
            neighbours.sync(&applied.config, &plan);
        }
        self.tokenizers.replace(tokenizers);
        if let Some(front) = &self.route {
            if let Err(error) = front.reload(&applied.config) {
                error!("{path}: [route]: {error:#}");
            }
        }
        self.metrics.reload(true);
        Ok(diff)
    }

    /// Logs and counts a rejected reload; the running configuration is unchanged.
    fn rejected(&self, rejected: ConfigError) -> ConfigError {
        for problem in &rejected.problems {
            error!("reload rejected: {problem}");
        }
        error!(
            "reload of {} rejected; the running configuration is unchanged",
            self.source.describe()
        );
        self.metrics.reload(false);
        rejected
    }

    /// Applies a discovered engine's answer, asked at `api`, unless a reload has changed the
    /// engine's `discover` since it was asked, or it is the answer in effect.
    pub(super) fn apply_discovery(&self, api: &EngineApi, discovery: Discovery) {
        let mut guard = self.applied.lock();
        let applied = &mut *guard;
        let current = applied
            .config
            .engines
            .iter()
            .find(|engine| engine.name == api.engine)
            .and_then(|engine| engine.discover());
        if current.map(|discover| &discover.api) != Some(api)
            || applied.discovered.get(&api.engine) == Some(&discovery)
        {
            return;
        }
        let model = discovery.model.clone();
        applied.discovered.insert(api.engine.clone(), discovery);
        // A model first known from the engine's answer: its tokenizer from the Hugging Face
        // cache, as a model the file names gets at start, in place before its ranks start.
        let current = self.tokenizers.current();
        if model.is_some_and(|model| current.source(&model).is_none()) {
            match load_tokenizers(&applied.config, &applied.discovered, &current) {
                Ok(tokenizers) => self.tokenizers.replace(tokenizers),
                Err(failed) => {
                    warn!(engine = %api.engine, "engine {}: tokenizers: {failed:#}", api.engine)
                }
            }
        }
        let plan = plan::expand_with(&applied.config, &applied.discovered);
        let what = format!("engine {}: its new answer", api.engine);
        self.apply_plan(plan.clone(), &what);
        if let Some(neighbours) = self.neighbours.lock().as_ref() {
            neighbours.sync(&applied.config, &plan);
        }
    }

    /// `Reconciler::apply_file_plan` (the plan with the runtime registrations, then
    /// `Registry::apply`), logged as `what`: the one road from a plan to the listeners.
    fn apply_plan(&self, plan: Vec<ListenerSpec>, what: &str) -> ReloadDiff {
        let diff = self.engines.apply_file_plan(plan);
        let names = |keys: &[plan::WorkerKey]| -> String {
            keys.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        };
        info!(
            "{what} applied: added [{}], removed [{}], replaced [{}], {} unchanged",
            names(&diff.added),
            names(&diff.removed),
            names(&diff.replaced),
            diff.unchanged
        );
        for failure in &diff.failed {
            warn!("{failure}; retrying in the background");
        }
        if diff.interrupted > 0 {
            info!(
                "{what} interrupted by shutdown: {} engines not started",
                diff.interrupted
            );
        }
        diff
    }
}

/// Every engine of `config`, with its `discover` URL if it has one: what the board lists.
pub(super) fn board_engines(config: &Config) -> Vec<(String, Option<String>)> {
    config
        .engines
        .iter()
        .map(|engine| {
            let url = engine.discover().map(|d| d.api.url.base.clone());
            (engine.name.clone(), url)
        })
        .collect()
}
