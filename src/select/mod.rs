//! Selection (docs.md "Selection"): which rank a prompt should go to, from the index, the
//! load `/select`'s own reservations put on each rank and the requests and blocks its engine
//! reports beyond them, with the blocks a reservation is about to store counted as predicted
//! on its rank for a short while.
//!
//! Beside `api`, which calls it: it reads the index (`Index::query_prompt`, the public query
//! API) and the registry's published rank board, and keeps its own state behind one lock held
//! for bookkeeping only (the index is read before it is taken). `cost` is the formula, `policy`
//! the order and the pick (`[select] policy`, `cost` its default), `reservations` the open
//! reservations and each rank's load, `engine_load` the engines' own load as last scraped
//! (`route::Scraper` records it; docs.md "Engine load"), `predictions` the predicted blocks
//! (its own reservations', and those a peer route front end told it of,
//! `record_peer_prediction`, counted alike), `clock` the time their time-to-lives are measured
//! on, `cached_reports` whether each engine reports its answers' cached tokens.
//!
//! Time: a `Selector` reads the `Clock` it is made with, never `Instant::now` itself. The
//! service's is `Clock::real()`; a test makes it with `Clock::manual()`, keeps a clone and
//! `advance`s it, so that a reservation or a prediction expires exactly when the test says
//! (a deadline is past once the clock reaches it) and no test waits for a time-to-live.
//!
//! Owns: the candidates (every connected rank of the prompt's model; one not `active` is
//! weighed with nothing matched), the reservations, the predictions and the live prediction
//! metrics. Never: writes the index or shows a prediction as cache, keeps a reservation past
//! its `reservation_ttl_s`, measures a time-to-live on any clock but its `Clock`, or blocks a
//! reader of the index.

mod backoff;
mod cached_reports;
mod clock;
mod cost;
mod engine_load;
mod peers;
mod policy;
mod predictions;
mod reservations;

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::config::Select;
use crate::index::{prompt_keys, Index, PerTier, Prompt, Score, WorkerId};
use crate::metrics::ListenerState;
use crate::metrics::Metrics;
use crate::plan::WorkerKey;
use crate::registry::{RankBoard, RunningRank};
use backoff::Backoffs;
pub use backoff::{BACKOFF_MAX, BACKOFF_MIN};
pub use cached_reports::{CachedTokenReports, Reporting};
pub use clock::Clock;
/// The formula and the order, public so that a benchmark's oracle weighs ground truth with
/// the very same cost (`examples/ladder/main.rs`).
pub use cost::{best_first, cost, Candidate, Costed, Load};
pub use engine_load::{scrape_timeout, EngineLoad, RankFigures};
use engine_load::{EngineLoads, Own};
pub use peers::PeerReservation;
pub use policy::{known as known_policy, names as policy_names, DEFAULT_POLICY};
use predictions::Predictions;
use reservations::{Reservation, Reservations};

/// A rank as select's tables know it: interned once, so a prediction or a reservation holds a
/// number, not a name. Bounded by the ranks ever seen.
type RankSlot = u32;

/// The most tokens a request's context counts, above any model's context length: a larger
/// `expected_output_tokens` (or `max_tokens`), or a larger count an engine reports, is a client
/// or a peer that lies, and is clamped to it (or ignored) before it enters a load or a metric.
pub const MAX_CONTEXT_TOKENS: u64 = 1 << 24;

/// The blocks of a prompt a reservation predicts, and a selection looks up among the
/// predictions: its first 4,096 (65,536 tokens of 16). The lookup and the record run under the
/// selector's lock, so they are bounded whatever the prompt's length, and every selection waits
/// at most for this much work of another (docs/performance.md "A heavy `/select` does not
/// stall the others"). A longer shared prefix is predicted this far: a miss beyond, never a
/// false hit.
pub const MAX_PREDICTED_BLOCKS: usize = 4096;

/// What a `/select` asks beyond the prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Reserve the chosen rank (and predict the prompt's blocks on it).
    pub reserve: bool,
    /// The tokens the request is expected to generate: its decode load while reserved.
    pub expected_output_tokens: u64,
    /// Also weigh the running ranks whose event link is down, by load alone (the route front
    /// end: an engine's OpenAI server may answer whatever its event link does).
    pub unlinked: bool,
}

/// One candidate as the answer shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranked {
    pub key: WorkerKey,
    pub instance_id: u64,
    pub costed: Costed,
    pub engine_load: EngineLoad,
}

/// A `/select`'s answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    pub query_blocks: u32,
    pub chosen: Ranked,
    /// The best of the others in the policy's order, when there is another.
    pub runner_up: Option<Ranked>,
    /// The `[select] policy` that chose.
    pub policy: &'static str,
    pub reservation_id: Option<u64>,
    /// The prefix the chosen rank is expected to find cached, in tokens: matched, predicted
    /// or held on disk, whichever is longest.
    pub predicted_cached_tokens: u64,
    /// The lowest-cost candidates, best first (`max_candidates` of them, or all).
    pub candidates: Vec<Ranked>,
    /// Why the chosen rank's index was not read, when it was not: it was weighed by load
    /// alone, as a miss.
    pub unindexed: Option<Unindexed>,
    /// The blocks the reservation predicts on the chosen rank, when it made a prediction.
    pub predicted: Option<Predicted>,
}

/// A prediction a reservation made: the prompt's chained block keys (at most
/// `MAX_PREDICTED_BLOCKS`) and how long they count.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    pub keys: Arc<[u64]>,
    pub ttl: Duration,
    /// The blocks the chosen rank prefills for it (`Costed::prefill_blocks`).
    pub prefill_blocks: f64,
}

/// Why a rank was weighed by load alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unindexed {
    /// Its event link is down.
    LinkDown,
    /// It has none: its engine publishes no KV events (`discover::NO_EVENTS`).
    NoEvents,
    /// Its link is up but its index cannot be trusted yet (or any more): its state.
    NotScored(ListenerState),
}

impl Unindexed {
    fn of(connected: bool, state: ListenerState) -> Option<Unindexed> {
        match (connected, state.is_scored()) {
            (false, _) => Some(Unindexed::LinkDown),
            (true, false) => Some(Unindexed::NotScored(state)),
            (true, true) => None,
        }
    }
}

impl std::fmt::Display for Unindexed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unindexed::LinkDown => f.write_str("its event link is down"),
            Unindexed::NoEvents => f.write_str(crate::discover::NO_EVENTS),
            Unindexed::NotScored(state) => write!(f, "its index is {}", state.as_str()),
        }
    }
}

/// One rank's load as `GET /loads` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct RankLoad {
    pub key: WorkerKey,
    pub load: Load,
    pub predicted_prefixes: u32,
    pub engine_load: EngineLoad,
}

/// Why a reservation route found nothing.
#[derive(Debug, PartialEq, Eq)]
pub struct UnknownReservation;

/// The selection state: one per indexer, shared by every HTTP thread.
pub struct Selector {
    state: Mutex<SelectState>,
    cached_reports: CachedTokenReports,
    metrics: Arc<Metrics>,
    clock: Clock,
}

struct SelectState {
    config: Select,
    rng: SmallRng,
    slots: HashMap<WorkerKey, RankSlot>,
    reservations: Reservations,
    predictions: Predictions,
    backoffs: Backoffs,
    engine_loads: EngineLoads,
    /// The peers' reservations weighed here: (sender, its id) → (ours, its deadline).
    peer_reservations: HashMap<(u64, u64), (u64, Instant)>,
    /// Where the next selection's rotation of the board starts: a random rank at first, one
    /// further at each selection.
    rotation: usize,
}

/// A ranks's inputs, gathered before the lock.
struct Gathered<'a> {
    key: &'a WorkerKey,
    instance_id: u64,
    /// Why its index is not read, if it is not.
    unindexed: Option<Unindexed>,
    score: Option<Score>,
}

impl Selector {
    /// The selection on `config`, its time-to-lives measured on `clock`.
    pub fn new(config: Select, metrics: Arc<Metrics>, clock: Clock) -> Selector {
        let mut rng = seeded_from_clock();
        // Two replicas started together must not walk the board in the same order: each
        // rotation starts at a rank of its own.
        let rotation = rng.random::<u32>() as usize;
        Selector {
            cached_reports: CachedTokenReports::default(),
            state: Mutex::new(SelectState {
                rng,
                config,
                slots: HashMap::new(),
                reservations: Reservations::default(),
                predictions: Predictions::default(),
                backoffs: Backoffs::default(),
                engine_loads: EngineLoads::default(),
                peer_reservations: HashMap::new(),
                rotation,
            }),
            metrics,
            clock,
        }
    }

    /// Applies reloaded knobs.
    pub fn set_config(&self, config: Select) {
        self.state.lock().config = config;
    }

    /// Chooses a rank for `prompt` among the connected ranks on `board` serving `model`
    /// (any, when `None`); `None` when there is none.
    pub fn select(
        &self,
        index: &Index,
        board: &RankBoard,
        prompt: &Prompt<'_>,
        model: Option<&str>,
        options: Options,
    ) -> Option<Selection> {
        self.select_but(index, board, prompt, model, options, &|_| false)
    }

    /// `select`, with the ranks `excluded` says left out (the route front end's ranks in
    /// back-off after a failure).
    pub fn select_but(
        &self,
        index: &Index,
        board: &RankBoard,
        prompt: &Prompt<'_>,
        model: Option<&str>,
        options: Options,
        excluded: &dyn Fn(&WorkerKey) -> bool,
    ) -> Option<Selection> {
        let block_size = index.block_size();
        let backed_off = self.backed_off();
        let ranks: Vec<_> = board
            .running()
            .filter(|rank| (rank.status.connected || options.unlinked) && !excluded(&rank.spec.key))
            .filter(|rank| !backed_off.contains(&rank.spec.key))
            .filter(|rank| rank.spec.serves(model))
            .collect();
        if ranks.is_empty() {
            return None;
        }
        // The index is read only for linked ranks whose every held block is held by the engine
        // (`active`, `partial`).
        let unindexed = |rank: &RunningRank| match rank.spec.publishes_events {
            true => Unindexed::of(rank.status.connected, rank.status.state),
            false => Some(Unindexed::NoEvents),
        };
        let mut trusted = Vec::new();
        for rank in ranks.iter().filter(|rank| unindexed(rank).is_none()) {
            let at = rank.worker as usize;
            if trusted.len() <= at {
                trusted.resize(at + 1, false);
            }
            trusted[at] = true;
        }
        let include = |worker: WorkerId| trusted.get(worker as usize).copied().unwrap_or(false);
        let mut scores: HashMap<WorkerId, Score> = index
            .query_prompt(prompt, &include)
            .into_iter()
            .map(|score| (score.worker, score))
            .collect();
        let gathered: Vec<Gathered> = ranks
            .iter()
            .map(|rank| Gathered {
                key: &rank.spec.key,
                instance_id: rank.spec.instance_id,
                unindexed: unindexed(rank),
                score: scores.remove(&rank.worker),
            })
            .collect();
        let query_blocks =
            u32::try_from(prompt.tokens.len() / block_size.max(1) as usize).unwrap_or(u32::MAX);
        let needs_keys = options.reserve || !self.state.lock().predictions.is_empty();
        let keys: Arc<[u64]> = if needs_keys {
            let mut keys = prompt_keys(prompt, block_size, 0);
            keys.truncate(MAX_PREDICTED_BLOCKS);
            keys.into()
        } else {
            Arc::from([])
        };

        let mut state = self.state.lock();
        let now = self.clock.now();
        state.expire(now);
        let state = &mut *state;
        let predicted: HashMap<RankSlot, u32> =
            state.predictions.covered(&keys).into_iter().collect();
        let mut costed: Vec<Costed> = Vec::with_capacity(gathered.len());
        let engine_loads: Vec<EngineLoad> = gathered
            .iter()
            .map(|rank| state.engine_load(rank.key, now))
            .collect();
        let ranks = gathered.len();
        let first_turn = state.rotation % ranks;
        state.rotation = state.rotation.wrapping_add(1);
        for (position, rank) in gathered.iter().enumerate() {
            let slot = state.slots.get(rank.key).copied();
            let (matched_blocks, tiers) = match (&rank.score, rank.unindexed) {
                (Some(score), None) => (score.matched_blocks, score.tiers),
                _ => (0, PerTier::default()),
            };
            let predicted_blocks = slot.and_then(|slot| predicted.get(&slot).copied());
            let predicted_blocks = predicted_blocks.unwrap_or(0);
            if let Some(slot) = slot.filter(|_| predicted_blocks > 0) {
                if matched_blocks >= predicted_blocks {
                    state.predictions.drop_stored(slot, &keys, matched_blocks);
                }
            }
            let candidate = Candidate {
                position,
                turn: (position + ranks - first_turn) % ranks,
                matched_blocks,
                tiers,
                predicted_blocks,
                load: Load {
                    outside_requests: engine_loads[position].outside_requests(),
                    outside_blocks: engine_loads[position].outside_blocks(),
                    ..slot.map_or_else(Load::default, |slot| state.reservations.load(slot))
                },
            };
            costed.push(cost(query_blocks, candidate, &state.config));
        }
        let (policy_name, policy) = policy::configured(state.config.policy);
        costed.sort_unstable_by(|a, b| policy.order(a, b));
        let chosen_at = policy.pick(&costed, &state.config, &mut state.rng);
        let chosen = &costed[chosen_at];
        let runner_up = costed
            .iter()
            .enumerate()
            .find(|(at, _)| *at != chosen_at)
            .map(|(_, costed)| costed);
        let ranked = |costed: &Costed| {
            let rank = &gathered[costed.candidate.position];
            Ranked {
                key: rank.key.clone(),
                instance_id: rank.instance_id,
                costed: costed.clone(),
                engine_load: engine_loads[costed.candidate.position].clone(),
            }
        };
        let cached_blocks = chosen
            .candidate
            .matched_blocks
            .max(chosen.candidate.predicted_blocks)
            .max(chosen.candidate.tiers.disk);
        let predicted_cached_tokens = u64::from(cached_blocks) * u64::from(block_size);
        let reservation_id = options.reserve.then(|| {
            let candidate = &chosen.candidate;
            let slot = state.slot(gathered[candidate.position].key);
            let output_blocks = options
                .expected_output_tokens
                .min(MAX_CONTEXT_TOKENS)
                .div_ceil(u64::from(block_size.max(1)));
            let config = &state.config;
            state.predictions.record(
                slot,
                Arc::clone(&keys),
                now + Duration::from_secs_f64(config.predicted_ttl_s),
            );
            state.reservations.open(Reservation {
                rank: slot,
                prefill_blocks: chosen.prefill_blocks,
                decode_blocks: u64::from(query_blocks) + output_blocks,
                prefill_complete: false,
                deadline: now + Duration::from_secs_f64(config.reservation_ttl_s),
                predicted_tokens: predicted_cached_tokens,
                reported: false,
            })
        });
        let predicted = (reservation_id.is_some() && !keys.is_empty()).then(|| Predicted {
            keys,
            ttl: Duration::from_secs_f64(state.config.predicted_ttl_s),
            prefill_blocks: chosen.prefill_blocks,
        });
        let shown = match state.config.max_candidates {
            0 => costed.len(),
            limit => limit.min(costed.len()),
        };
        Some(Selection {
            query_blocks,
            chosen: ranked(chosen),
            runner_up: runner_up.map(ranked),
            policy: policy_name,
            reservation_id,
            predicted_cached_tokens,
            candidates: costed[..shown].iter().map(ranked).collect(),
            unindexed: gathered[chosen.candidate.position].unindexed,
            predicted,
        })
    }

    /// The engine has prefilled reservation `id`; `cached_tokens`, when it says how much of
    /// the prompt it found cached, is weighed against what the selection predicted.
    pub fn prefill_complete(
        &self,
        id: u64,
        cached_tokens: Option<u64>,
    ) -> Result<(), UnknownReservation> {
        let mut state = self.state.lock();
        state.expire(self.clock.now());
        state
            .reservations
            .prefill_complete(id)
            .ok_or(UnknownReservation)?;
        let predicted = cached_tokens.and_then(|_| state.reservations.take_report(id));
        drop(state);
        if let (Some(predicted), Some(served)) = (predicted, cached_tokens) {
            self.metrics.observe_prediction(predicted, served);
        }
        Ok(())
    }

    /// The engine says it found `served` tokens of reservation `id`'s prompt cached (at the
    /// end of a stream, after `prefill_complete`): weighed against the prediction once.
    pub fn report_cached_tokens(&self, id: u64, served: u64) -> Result<(), UnknownReservation> {
        let mut state = self.state.lock();
        state.expire(self.clock.now());
        let predicted = state.reservations.take_report(id);
        let known = predicted.is_some() || state.reservations.contains(id);
        drop(state);
        if let Some(predicted) = predicted {
            self.metrics.observe_prediction(predicted, served);
        }
        known.then_some(()).ok_or(UnknownReservation)
    }

    /// Releases reservation `id`.
    pub fn release(&self, id: u64) -> Result<(), UnknownReservation> {
        let mut state = self.state.lock();
        state.expire(self.clock.now());
        if state.reservations.release(id) {
            Ok(())
        } else {
            Err(UnknownReservation)
        }
    }

    /// Every running rank on `board` with its load, in the board's order.
    pub fn loads(&self, board: &RankBoard) -> Vec<RankLoad> {
        let mut state = self.state.lock();
        let now = self.clock.now();
        state.expire(now);
        board
            .running()
            .map(|rank| {
                let slot = state.slots.get(&rank.spec.key).copied();
                let engine_load = state.engine_load(&rank.spec.key, now);
                RankLoad {
                    key: rank.spec.key.clone(),
                    load: Load {
                        outside_requests: engine_load.outside_requests(),
                        outside_blocks: engine_load.outside_blocks(),
                        ..slot.map_or_else(Load::default, |slot| state.reservations.load(slot))
                    },
                    predicted_prefixes: slot.map_or(0, |slot| state.predictions.held(slot)),
                    engine_load,
                }
            })
            .collect()
    }

    /// Records the end of a scrape of `engine`'s load: its figures per dp rank, or why there
    /// are none (docs.md "Engine load"); the index's blocks are of `block_size` tokens.
    pub fn record_engine_load(
        &self,
        engine: &str,
        block_size: u32,
        scrape: Result<Vec<(u32, RankFigures)>, String>,
    ) {
        let mut state = self.state.lock();
        let now = self.clock.now();
        state.expire(now);
        let state = &mut *state;
        let (slots, reservations) = (&state.slots, &state.reservations);
        let own = |dp_rank: u32| {
            let key = WorkerKey {
                engine: engine.to_owned(),
                dp_rank,
            };
            slots.get(&key).map_or(Own::default(), |&slot| {
                let load = reservations.load(slot);
                Own {
                    reservations: load.reservations,
                    decode_blocks: load.active_decode_blocks,
                }
            })
        };
        state
            .engine_loads
            .record(engine, now, scrape, block_size, own);
    }

    /// Forgets the scrapes of engines not in `engines` (gone from the file).
    pub fn retain_engine_loads(&self, engines: &[&str]) {
        self.state.lock().engine_loads.retain(engines);
    }

    /// Rank `key`'s engine load now (for `/workers`).
    pub fn engine_load(&self, key: &WorkerKey) -> EngineLoad {
        self.state.lock().engine_load(key, self.clock.now())
    }

    /// Rank `key` failed a request before its first byte: it is left out of every selection
    /// for its back-off, which this returns.
    pub fn rank_failed(&self, key: &WorkerKey) -> Duration {
        let mut state = self.state.lock();
        let now = self.clock.now();
        let slot = state.slot(key);
        state.backoffs.failed(slot, now)
    }

    /// Rank `key` answered a request: a back-off it was in is over, and forgotten. Whether
    /// it had one.
    pub fn rank_answered(&self, key: &WorkerKey) -> bool {
        let mut state = self.state.lock();
        match state.slots.get(key) {
            Some(&slot) => state.backoffs.succeeded(slot),
            None => false,
        }
    }

    /// How long rank `key` is still left out, if it is (for `/workers`).
    /// Whether each engine reports its answers' cached tokens (the route front end tells it).
    pub fn cached_token_reports(&self) -> &CachedTokenReports {
        &self.cached_reports
    }

    pub fn backoff_left(&self, key: &WorkerKey) -> Option<Duration> {
        let state = self.state.lock();
        let slot = *state.slots.get(key)?;
        state.backoffs.left(slot, self.clock.now())
    }

    /// Every rank that failed since it last answered, with how long it is still left out.
    pub fn backoffs(&self) -> Vec<(WorkerKey, Option<Duration>)> {
        let state = self.state.lock();
        if state.backoffs.is_empty() {
            return Vec::new();
        }
        let now = self.clock.now();
        state
            .slots
            .iter()
            .filter(|(_, &slot)| state.backoffs.holds(slot))
            .map(|(key, &slot)| (key.clone(), state.backoffs.left(slot, now)))
            .collect()
    }

    /// The ranks in back-off now.
    fn backed_off(&self) -> Vec<WorkerKey> {
        self.backoffs()
            .into_iter()
            .filter_map(|(key, left)| left.map(|_| key))
            .collect()
    }
}

impl SelectState {
    fn expire(&mut self, now: Instant) {
        self.reservations.expire(now);
        self.predictions.expire(now);
    }

    fn engine_load(&self, key: &WorkerKey, now: Instant) -> EngineLoad {
        let interval = Duration::from_millis(self.config.load_interval_ms);
        self.engine_loads.view(key, now, interval)
    }

    fn slot(&mut self, key: &WorkerKey) -> RankSlot {
        let next = RankSlot::try_from(self.slots.len()).unwrap_or(RankSlot::MAX);
        *self.slots.entry(key.clone()).or_insert(next)
    }
}

fn seeded_from_clock() -> SmallRng {
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    SmallRng::seed_from_u64(seed)
}

/// Gives a table's memory back once it is mostly empty (after a burst of reservations).
fn shrink_sparse<K: Eq + Hash, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > 64 && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}
