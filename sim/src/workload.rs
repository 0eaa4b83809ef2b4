//! Prompts for simulated engines and the routing of prompts to ranks: the Mooncake trace expanded
//! into deterministic tokens, synthetic shared-prefix conversations, round-robin or sticky routing.
//!
//! Pure functions of their inputs and seeds; it never touches a cache or a socket. Prompts are
//! made as they are taken (a request's tokens when it is asked for), so a workload of any length
//! holds what one request needs, never the whole run.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

use crate::rng::{mix, SplitMix64};

/// Tokens per hash id of the Mooncake trace.
pub const TRACE_ID_TOKENS: u32 = 512;

/// Token ids are drawn below this (the size of a typical LLM vocabulary).
pub const VOCABULARY: u64 = 150_000;

#[derive(Deserialize)]
struct TraceLine {
    #[serde(default)]
    timestamp: u64,
    input_length: u32,
    #[serde(default)]
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// One request of the trace with its timing, for replays in (virtual) time.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// When it arrives, in ms from the trace's start.
    pub timestamp_ms: u64,
    pub output_length: u32,
    pub prompt: Vec<u32>,
}

/// The Mooncake trace (one JSON object per line), kept as its hash ids: a prompt's tokens are
/// expanded only when it is asked for ([`Trace::prompt`]), so a run of a million requests holds
/// the trace's ids and one prompt at a time, never the million prompts (expanded, the 4,000
/// requests of the shipped trace alone are about 270 MB).
///
/// Each hash id becomes `512 / block_size` blocks of tokens derived from (id, sub-block, offset),
/// the last id only `input_length - 512 * (ids - 1)` tokens. `block_size` must divide 512, so
/// that equal ids give equal blocks.
pub struct Trace {
    requests: Vec<TraceLine>,
    block_size: u32,
}

impl Trace {
    /// Reads and checks every line (an error names the line); expands nothing.
    pub fn load(path: &Path, block_size: u32) -> Result<Trace> {
        ensure!(
            block_size > 0 && TRACE_ID_TOKENS % block_size == 0,
            "block size {block_size} does not divide the trace's {TRACE_ID_TOKENS}-token ids"
        );
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading trace {}", path.display()))?;
        let requests = text
            .lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(index, line)| {
                trace_line(line)
                    .with_context(|| format!("trace {} line {}", path.display(), index + 1))
            })
            .collect::<Result<_>>()?;
        Ok(Trace {
            requests,
            block_size,
        })
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Request `index`'s tokens, expanded now.
    pub fn prompt(&self, index: usize) -> Vec<u32> {
        let request = &self.requests[index];
        let last_index = request.hash_ids.len() - 1;
        let last_tokens = request.input_length - TRACE_ID_TOKENS * last_index as u32;
        let mut prompt = Vec::with_capacity(request.input_length as usize);
        for (index, &id) in request.hash_ids.iter().enumerate() {
            let tokens = if index == last_index {
                last_tokens
            } else {
                TRACE_ID_TOKENS
            };
            prompt.extend((0..tokens).map(|offset| {
                let sub_block = offset / self.block_size;
                let key = mix(
                    id,
                    ((sub_block as u64) << 32) | (offset % self.block_size) as u64,
                );
                (key % VOCABULARY) as u32
            }));
        }
        prompt
    }

    /// Request `index` with its arrival time and output length, its prompt expanded now.
    pub fn request(&self, index: usize) -> TraceRequest {
        let line = &self.requests[index];
        TraceRequest {
            timestamp_ms: line.timestamp,
            output_length: line.output_length,
            prompt: self.prompt(index),
        }
    }

    /// `count` prompts, cycling through the trace, each expanded as it is taken (an empty
    /// trace yields nothing).
    pub fn cycled(self, count: usize) -> impl Iterator<Item = Vec<u32>> {
        let total = if self.is_empty() { 0 } else { count };
        (0..total).map(move |i| self.prompt(i % self.len()))
    }
}

/// [`Trace::load`], every prompt expanded: for the tests and benchmarks that take a few
/// thousand requests at most.
pub fn load_trace(path: &Path, block_size: u32) -> Result<Vec<Vec<u32>>> {
    let trace = Trace::load(path, block_size)?;
    Ok((0..trace.len()).map(|i| trace.prompt(i)).collect())
}

/// [`Trace::load`], every request expanded with its timing.
pub fn load_trace_requests(path: &Path, block_size: u32) -> Result<Vec<TraceRequest>> {
    let trace = Trace::load(path, block_size)?;
    Ok((0..trace.len()).map(|i| trace.request(i)).collect())
}

/// One request, checked: at least one id, and `input_length` fits the ids (only the last one
/// partly filled), so that [`Trace::prompt`] cannot fail.
fn trace_line(line: &str) -> Result<TraceLine> {
    let request: TraceLine = serde_json::from_str(line).context("not a trace request")?;
    let Some(last_index) = request.hash_ids.len().checked_sub(1) else {
        bail!("no hash_ids");
    };
    let covered_before_last = TRACE_ID_TOKENS as u64 * last_index as u64;
    (request.input_length as u64)
        .checked_sub(covered_before_last)
        .filter(|&n| n > 0 && n <= TRACE_ID_TOKENS as u64)
        .with_context(|| {
            format!(
                "input_length {} does not fit {} hash ids of {TRACE_ID_TOKENS} tokens",
                request.input_length,
                request.hash_ids.len()
            )
        })?;
    Ok(request)
}

/// Shape of a synthetic chat workload: a few long system prompts shared by many conversations
/// that grow turn by turn, so prompts share both the system prefix and their own history.
#[derive(Clone, Debug)]
pub struct Conversations {
    pub system_prompts: usize,
    pub system_tokens: usize,
    pub conversations: usize,
    /// Conversations under way at once; the next one starts when one ends. What the workload
    /// holds is these histories, however many conversations there are.
    pub in_progress: usize,
    pub turns: usize,
    /// Tokens a user adds per turn.
    pub user_tokens: usize,
    /// Tokens of the reply appended to the history after each turn.
    pub reply_tokens: usize,
    pub seed: u64,
}

impl Default for Conversations {
    fn default() -> Self {
        Self {
            system_prompts: 4,
            system_tokens: 1024,
            conversations: 100,
            in_progress: 100,
            turns: 5,
            user_tokens: 200,
            reply_tokens: 300,
            seed: 0,
        }
    }
}

impl Conversations {
    /// Every turn of every conversation (`conversations × turns` prompts), made as they are
    /// taken, the conversations under way interleaved at random: each prompt is its system
    /// prompt, its history and the new message.
    pub fn prompts(&self) -> Turns {
        let mut rng = SplitMix64::new(self.seed);
        let systems = (0..self.system_prompts.max(1))
            .map(|_| random_tokens(self.system_tokens, &mut rng))
            .collect();
        Turns {
            shape: self.clone(),
            systems,
            rng,
            in_progress: Vec::new(),
            started: if self.turns == 0 {
                self.conversations
            } else {
                0
            },
        }
    }
}

/// The prompts of [`Conversations::prompts`], one turn at a time.
pub struct Turns {
    shape: Conversations,
    systems: Vec<Vec<u32>>,
    rng: SplitMix64,
    /// Each conversation under way: its history and the turns it has had.
    in_progress: Vec<(Vec<u32>, usize)>,
    /// Conversations started so far.
    started: usize,
}

impl Iterator for Turns {
    type Item = Vec<u32>;

    fn next(&mut self) -> Option<Vec<u32>> {
        while self.in_progress.len() < self.shape.in_progress.max(1)
            && self.started < self.shape.conversations
        {
            let system = &self.systems[self.rng.below(self.systems.len() as u64) as usize];
            self.in_progress.push((system.clone(), 0));
            self.started += 1;
        }
        if self.in_progress.is_empty() {
            return None;
        }
        let pick = self.rng.below(self.in_progress.len() as u64) as usize;
        let (history, turns_done) = &mut self.in_progress[pick];
        history.extend(random_tokens(self.shape.user_tokens, &mut self.rng));
        let prompt = history.clone();
        history.extend(random_tokens(self.shape.reply_tokens, &mut self.rng));
        *turns_done += 1;
        if *turns_done == self.shape.turns {
            self.in_progress.swap_remove(pick);
        }
        Some(prompt)
    }
}

fn random_tokens(count: usize, rng: &mut SplitMix64) -> Vec<u32> {
    (0..count).map(|_| rng.below(VOCABULARY) as u32).collect()
}

/// How prompts are spread over an engine's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    RoundRobin,
    /// By a hash of the first block, so prompts with the same head meet on the same rank.
    Sticky,
}

/// Picks a rank for each prompt.
#[derive(Clone, Debug)]
pub struct Router {
    route: Route,
    dp_size: u32,
    block_size: u32,
    next: u32,
}

impl Router {
    pub fn new(route: Route, dp_size: u32, block_size: u32) -> Self {
        Self {
            route,
            dp_size: dp_size.max(1),
            block_size,
            next: 0,
        }
    }

    pub fn rank_for(&mut self, prompt: &[u32]) -> u32 {
        match self.route {
            Route::RoundRobin => {
                let rank = self.next;
                self.next = (self.next + 1) % self.dp_size;
                rank
            }
            Route::Sticky => {
                let head = &prompt[..prompt.len().min(self.block_size as usize)];
                let bytes: Vec<u8> = head.iter().flat_map(|t| t.to_le_bytes()).collect();
                (xxh3_64(&bytes) % self.dp_size as u64) as u32
            }
        }
    }
}
