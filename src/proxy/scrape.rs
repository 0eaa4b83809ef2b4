//! The scrapes of the engines' load (docs.md "Engine load"): every `[select] load_interval_ms`,
//! each engine's `metrics_url` is fetched at once (all engines together, each bounded by
//! `select::scrape_timeout` and `MAX_BODY_BYTES`), its gauges read (`exposition`) and handed
//! to the selector, which weighs the last ones it holds. Runs whether or not `[route]` is set:
//! `/select` weighs the same load.
//!
//! Owns: the round of scrapes, which engines it asks (reloaded with the file), the mapping of
//! a series without a rank label to the engine's only rank, and the scrape counter. Never:
//! blocks selection (a slow or huge answer only delays its own figures), or weighs anything
//! itself.

mod exposition;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::upstream::get_body;
use crate::config::Config;
use crate::discover::BaseUrl;
use crate::engine_http::Connections;
use crate::metrics::{Metrics, ScrapeOutcome};
use crate::registry::RanksReader;
use crate::select::{scrape_timeout, RankFigures, Selector};

/// The largest answer read: a vLLM `/metrics` of a few DP ranks is 50–200 KiB.
const MAX_BODY_BYTES: usize = 4 << 20;

/// How often scrapes turned off (`load_interval_ms = 0`) look whether a reload turned them on.
const PAUSED_POLL: Duration = Duration::from_secs(1);

/// An engine whose load is scraped.
struct Target {
    engine: String,
    url: BaseUrl,
}

/// What a round reads: the engines and the interval.
struct Round {
    targets: Vec<Target>,
    interval: Duration,
    /// The index's block size: what an engine holds is weighed in its blocks.
    block_size: u32,
}

impl Round {
    fn of(config: &Config) -> Round {
        Round {
            targets: config
                .engines
                .iter()
                .filter_map(|engine| {
                    let url = engine.metrics_url.clone()?;
                    Some(Target {
                        engine: engine.name.clone(),
                        url,
                    })
                })
                .collect(),
            interval: Duration::from_millis(config.select.load_interval_ms),
            block_size: config.block_size,
        }
    }
}

/// The engines' load scraper: one client (its own pool of connections) for every scrape.
pub struct Scraper {
    connections: Arc<Connections>,
    selector: Arc<Selector>,
    ranks: RanksReader,
    metrics: Arc<Metrics>,
    round: RwLock<Arc<Round>>,
}

impl Scraper {
    pub fn new(
        config: &Config,
        selector: Arc<Selector>,
        ranks: RanksReader,
        metrics: Arc<Metrics>,
    ) -> Scraper {
        let round = Round::of(config);
        for target in &round.targets {
            metrics.engine_load_scrapes_kept(&target.engine, true);
        }
        Scraper {
            connections: Arc::default(),
            selector,
            ranks,
            metrics,
            round: RwLock::new(Arc::new(round)),
        }
    }

    /// Takes a reloaded file: its engines' `metrics_url` and the interval. An engine gone from
    /// the file, or no longer scraped, is forgotten.
    pub fn reload(&self, config: &Config) {
        let round = Arc::new(Round::of(config));
        let scraped: Vec<&str> = round.targets.iter().map(|t| t.engine.as_str()).collect();
        // Swapped first: a scrape recorded before the swap is forgotten below, one ending
        // after it finds its engine gone (`scrape`).
        let before = std::mem::replace(&mut *self.round.write(), Arc::clone(&round));
        self.selector.retain_engine_loads(&scraped);
        for target in &before.targets {
            let kept = scraped.contains(&target.engine.as_str());
            self.metrics.engine_load_scrapes_kept(&target.engine, kept);
        }
        for engine in scraped {
            self.metrics.engine_load_scrapes_kept(engine, true);
        }
    }

    /// Scrapes every engine each interval, until dropped (its task is stopped).
    pub async fn run(self: Arc<Self>) {
        let mut scrapes = JoinSet::new();
        loop {
            let round = self.round.read().clone();
            if round.interval.is_zero() || round.targets.is_empty() {
                tokio::time::sleep(PAUSED_POLL).await;
                continue;
            }
            let next = Instant::now() + round.interval;
            let timeout = scrape_timeout(round.interval);
            for at in 0..round.targets.len() {
                let (scraper, round) = (Arc::clone(&self), Arc::clone(&round));
                scrapes.spawn(async move { scraper.scrape(&round.targets[at], timeout).await });
            }
            // Each scrape is bounded by its timeout: a round ends within it.
            while scrapes.join_next().await.is_some() {}
            tokio::time::sleep_until(next).await;
        }
    }

    async fn scrape(&self, target: &Target, timeout: Duration) {
        let fetched = get_body(&self.connections, &target.url, timeout, MAX_BODY_BYTES)
            .await
            .map_err(|failed| failed.to_string());
        let read = fetched.and_then(|body| {
            let text = std::str::from_utf8(&body)
                .map_err(|_| "the answer is not UTF-8 text".to_owned())?;
            exposition::parse(text).map_err(|err| err.to_string())
        });
        let outcome = read.and_then(|ranks| self.placed(&target.engine, ranks));
        let counted = match &outcome {
            Ok(_) => ScrapeOutcome::ok,
            Err(why) => {
                tracing::debug!(
                    engine = %target.engine,
                    "engine {}: scraping {} failed: {why}",
                    target.engine,
                    target.url.base
                );
                ScrapeOutcome::failed
            }
        };
        let outcome = outcome.map_err(|why| format!("GET {}: {why}", target.url.base));
        // Held while recording: a reload's swap waits, so that no scrape of an engine it
        // dropped is recorded after it.
        let round = self.round.read();
        let current = |t: &Target| t.engine == target.engine && t.url == target.url;
        if round.targets.iter().any(current) {
            self.metrics.engine_load_scraped(&target.engine, counted);
            let block_size = round.block_size;
            self.selector
                .record_engine_load(&target.engine, block_size, outcome);
        }
    }

    /// `ranks` with a series without a rank label given to the engine's only running rank.
    fn placed(
        &self,
        engine: &str,
        ranks: Vec<(Option<u32>, RankFigures)>,
    ) -> Result<Vec<(u32, RankFigures)>, String> {
        let mut placed = Vec::with_capacity(ranks.len());
        for (rank, figures) in ranks {
            let rank = match rank {
                Some(rank) => rank,
                None => {
                    let board = self.ranks.current();
                    let mut own = board
                        .running()
                        .filter(|running| running.spec.key.engine == engine)
                        .map(|running| running.spec.key.dp_rank);
                    match (own.next(), own.next()) {
                        (Some(only), None) => only,
                        _ => {
                            return Err("its series name no rank (no `engine` or `dp_rank` \
                                        label) and it has not exactly one running rank"
                                .to_owned())
                        }
                    }
                }
            };
            placed.push((rank, figures));
        }
        Ok(placed)
    }
}
