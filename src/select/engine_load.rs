//! The engines' own load (docs.md "Engine load"): the last figures each engine's Prometheus
//! endpoint gave for each of its ranks, as the scraper (`proxy::scrape`) hands them over, and
//! the part of them selection weighs.
//!
//! Owns: each engine's last scrape (its figures per rank, or why it failed), its time, and the
//! rule that a request is never counted twice: a rank's outside requests are its running and
//! waiting requests less the router's own reservations open when the scrape was recorded, and
//! its outside blocks the KV blocks the engine says it holds less those reservations' decode
//! blocks (the reservations are weighed by their blocks, as before, and so are the ones made
//! since). Never: scrapes (it is given figures), reads a clock (it is given the time), or
//! weighs a scrape that failed or is older than `STALE_INTERVALS` intervals: that rank falls
//! back to reservations alone.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::plan::WorkerKey;

/// A scrape older than this many `load_interval_ms` (plus its own timeout) is stale.
pub const STALE_INTERVALS: u32 = 3;

/// The longest a scrape may take, whatever the interval: an engine answering slowly never
/// holds a round of scrapes longer.
pub const MAX_SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);
/// The shortest timeout a scrape is given, however short the interval.
const MIN_SCRAPE_TIMEOUT: Duration = Duration::from_millis(100);

/// How long one scrape may take at `interval`: the interval, within 100 ms ..= 2 s.
pub fn scrape_timeout(interval: Duration) -> Duration {
    interval.clamp(MIN_SCRAPE_TIMEOUT, MAX_SCRAPE_TIMEOUT)
}

/// When a scrape recorded at `interval` stops counting.
pub fn stale_after(interval: Duration) -> Duration {
    interval * STALE_INTERVALS + scrape_timeout(interval)
}

/// One rank's figures as its engine reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankFigures {
    /// Requests in the running batch (`vllm:num_requests_running`, `sglang:num_running_reqs`).
    pub running: f64,
    /// Requests queued (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`).
    pub waiting: f64,
    /// The fraction of the KV cache in use, 0 to 1 (`vllm:kv_cache_usage_perc`,
    /// `sglang:token_usage`), when reported.
    pub kv_usage: Option<f64>,
    /// The tokens the running requests hold in the KV cache (`sglang:num_used_tokens`, or
    /// vLLM's usage times `vllm:cache_config_info`'s `num_gpu_blocks` × `block_size`), when
    /// reported.
    pub held_tokens: Option<f64>,
}

/// What the router itself had open on a rank when its scrape was recorded.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Own {
    pub reservations: u64,
    /// Their prompts' and expected outputs' blocks (`Load::active_decode_blocks`).
    pub decode_blocks: u64,
}

/// One rank's engine load as `/loads`, `/select` and `/workers` show it.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineLoad {
    /// Not scraped: the engine has no `metrics_url`, scraping is off, or no scrape has ended.
    Unscraped,
    /// The last scrape, weighed.
    Fresh {
        age: Duration,
        figures: RankFigures,
        /// `figures`' running and waiting less the reservations open at the scrape.
        outside_requests: f64,
        /// `figures`' held tokens, in blocks, less those reservations' decode blocks; 0 when
        /// the engine does not say what it holds.
        outside_blocks: f64,
    },
    /// Not weighed (reservations alone): why.
    Stale(String),
}

impl EngineLoad {
    /// The outside requests the cost weighs: none but a fresh scrape's.
    pub fn outside_requests(&self) -> f64 {
        match self {
            EngineLoad::Fresh {
                outside_requests, ..
            } => *outside_requests,
            _ => 0.0,
        }
    }

    /// The outside blocks the cost weighs: none but a fresh scrape's.
    pub fn outside_blocks(&self) -> f64 {
        match self {
            EngineLoad::Fresh { outside_blocks, .. } => *outside_blocks,
            _ => 0.0,
        }
    }
}

/// A rank's figures as kept, with the outside load worked out when they were recorded.
#[derive(Clone, Copy, Debug)]
struct Kept {
    figures: RankFigures,
    outside_requests: f64,
    outside_blocks: f64,
}

/// One engine's last scrape.
struct Scraped {
    at: Instant,
    outcome: Result<HashMap<u32, Kept>, String>,
}

/// Every engine's last scrape, by engine name.
#[derive(Default)]
pub(super) struct EngineLoads {
    engines: HashMap<String, Scraped>,
}

impl EngineLoads {
    /// Records `engine`'s scrape ended `at`: figures per dp rank, or why it failed.
    /// `own(rank)` is what the router has open on the rank now; blocks are of `block_size`
    /// tokens.
    pub(super) fn record(
        &mut self,
        engine: &str,
        at: Instant,
        outcome: Result<Vec<(u32, RankFigures)>, String>,
        block_size: u32,
        own: impl Fn(u32) -> Own,
    ) {
        let outcome = outcome.map(|ranks| {
            ranks
                .into_iter()
                .map(|(rank, figures)| {
                    let reported = figures.running + figures.waiting;
                    let own = own(rank);
                    let held_blocks = figures
                        .held_tokens
                        .map_or(0.0, |tokens| tokens / f64::from(block_size.max(1)));
                    let kept = Kept {
                        figures,
                        outside_requests: (reported - own.reservations as f64).max(0.0),
                        outside_blocks: (held_blocks - own.decode_blocks as f64).max(0.0),
                    };
                    (rank, kept)
                })
                .collect()
        });
        match self.engines.get_mut(engine) {
            Some(scraped) => *scraped = Scraped { at, outcome },
            None => {
                self.engines
                    .insert(engine.to_owned(), Scraped { at, outcome });
            }
        }
    }

    /// `key`'s engine load at `now`, scrapes every `interval` (zero: scraping is off).
    pub(super) fn view(&self, key: &WorkerKey, now: Instant, interval: Duration) -> EngineLoad {
        if interval.is_zero() {
            return EngineLoad::Unscraped;
        }
        let Some(scraped) = self.engines.get(&key.engine) else {
            return EngineLoad::Unscraped;
        };
        let age = now.saturating_duration_since(scraped.at);
        let ranks = match &scraped.outcome {
            Err(why) => return EngineLoad::Stale(why.clone()),
            Ok(ranks) => ranks,
        };
        if age > stale_after(interval) {
            return EngineLoad::Stale(format!(
                "the last scrape is {} ms old (more than {STALE_INTERVALS} load_interval_ms)",
                age.as_millis()
            ));
        }
        match ranks.get(&key.dp_rank) {
            Some(kept) => EngineLoad::Fresh {
                age,
                figures: kept.figures,
                outside_requests: kept.outside_requests,
                outside_blocks: kept.outside_blocks,
            },
            None => EngineLoad::Stale(format!(
                "the engine's metrics have no series for dp rank {}",
                key.dp_rank
            )),
        }
    }

    /// Forgets the engines not in `engines` (gone from the file).
    pub(super) fn retain(&mut self, engines: &[&str]) {
        self.engines
            .retain(|name, _| engines.contains(&name.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(rank: u32) -> WorkerKey {
        WorkerKey {
            engine: "a".into(),
            dp_rank: rank,
        }
    }

    fn figures(running: f64, waiting: f64) -> RankFigures {
        RankFigures {
            running,
            waiting,
            kv_usage: Some(0.5),
            held_tokens: None,
        }
    }

    fn own(reservations: u64) -> Own {
        Own {
            reservations,
            decode_blocks: 0,
        }
    }

    const INTERVAL: Duration = Duration::from_millis(500);

    /// The router's own requests, already weighed by their reservations' blocks, are taken out
    /// of the engine's count; more reservations than the engine counts (not arrived yet, or
    /// done but not released) leave no negative load.
    #[test]
    fn the_routers_own_reservations_are_never_counted_twice() {
        let mut loads = EngineLoads::default();
        let at = Instant::now();
        let mine = |rank: u32| own([3, 9][rank as usize]);
        let ranks = vec![(0, figures(4.0, 2.0)), (1, figures(5.0, 0.0))];
        loads.record("a", at, Ok(ranks), 16, mine);
        let later = at + Duration::from_millis(100);
        match loads.view(&key(0), later, INTERVAL) {
            EngineLoad::Fresh {
                age,
                figures,
                outside_requests,
                outside_blocks,
            } => {
                assert_eq!(age, Duration::from_millis(100));
                assert_eq!((figures.running, figures.waiting), (4.0, 2.0));
                assert_eq!(outside_requests, 3.0, "4 running + 2 waiting - 3 own");
                assert_eq!(
                    outside_blocks, 0.0,
                    "the engine says nothing of what it holds"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(loads.view(&key(1), later, INTERVAL).outside_requests(), 0.0);
    }

    /// A rank weighs what its engine holds beyond the router's own requests: 3,200 tokens
    /// (200 blocks of 16) less its reservations' 50 decode blocks is 150 outside blocks; the
    /// router's own blocks beyond what the engine holds leave none.
    #[test]
    fn the_blocks_an_engine_holds_beyond_the_routers_own_are_outside_blocks() {
        let mut loads = EngineLoads::default();
        let at = Instant::now();
        let holding = |tokens: f64| RankFigures {
            held_tokens: Some(tokens),
            ..figures(2.0, 0.0)
        };
        let mine = |rank: u32| Own {
            reservations: 1,
            decode_blocks: [50, 500][rank as usize],
        };
        let ranks = vec![(0, holding(3_200.0)), (1, holding(3_200.0))];
        loads.record("a", at, Ok(ranks), 16, mine);
        let zero = loads.view(&key(0), at, INTERVAL);
        assert_eq!(
            (zero.outside_requests(), zero.outside_blocks()),
            (1.0, 150.0)
        );
        assert_eq!(loads.view(&key(1), at, INTERVAL).outside_blocks(), 0.0);
        loads.record("a", at, Err("GET /metrics: 500".into()), 16, mine);
        assert_eq!(loads.view(&key(0), at, INTERVAL).outside_blocks(), 0.0);
    }

    #[test]
    fn a_failed_old_or_missing_scrape_weighs_nothing_and_says_why() {
        let mut loads = EngineLoads::default();
        let at = Instant::now();
        assert_eq!(loads.view(&key(0), at, INTERVAL), EngineLoad::Unscraped);
        loads.record("a", at, Ok(vec![(0, figures(7.0, 0.0))]), 16, |_| own(0));
        let fresh = loads.view(&key(0), at + stale_after(INTERVAL), INTERVAL);
        assert_eq!(fresh.outside_requests(), 7.0, "fresh up to its bound");
        let old = loads.view(
            &key(0),
            at + stale_after(INTERVAL) + Duration::from_millis(1),
            INTERVAL,
        );
        assert!(
            matches!(&old, EngineLoad::Stale(why) if why.contains("2001 ms old")),
            "{old:?}"
        );
        assert_eq!(old.outside_requests(), 0.0);
        assert!(
            matches!(loads.view(&key(3), at, INTERVAL), EngineLoad::Stale(why) if why.contains("dp rank 3"))
        );
        assert_eq!(
            loads.view(&key(0), at, Duration::ZERO),
            EngineLoad::Unscraped
        );
        loads.record("a", at, Err("GET /metrics: 500".into()), 16, |_| own(0));
        assert_eq!(
            loads.view(&key(0), at, INTERVAL),
            EngineLoad::Stale("GET /metrics: 500".into())
        );
        loads.retain(&[]);
        assert_eq!(loads.view(&key(0), at, INTERVAL), EngineLoad::Unscraped);
    }
}
