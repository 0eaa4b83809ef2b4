//! Prompts for simulated engines and the routing of prompts to ranks: the Mooncake trace expanded
//! into deterministic tokens, synthetic shared-prefix conversations, round-robin or sticky routing.
//!
//! Pure functions of their inputs and seeds; it never touches a cache or a socket.

use std::collections::VecDeque;
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

/// Loads the Mooncake trace (one JSON object per line) as token prompts: each hash id becomes
/// `512 / block_size` blocks of tokens derived from (id, sub-block, offset), the last id only
/// `input_length - 512 * (ids - 1)` tokens. `block_size` must divide 512, so that equal ids give
/// equal blocks.
pub fn load_trace(path: &Path, block_size: u32) -> Result<Vec<Vec<u32>>> {
    let requests = load_trace_requests(path, block_size)?;
    Ok(requests.into_iter().map(|request| request.prompt).collect())
}

/// `load_trace` with each request's arrival time and output length.
pub fn load_trace_requests(path: &Path, block_size: u32) -> Result<Vec<TraceRequest>> {
    ensure!(
        block_size > 0 && TRACE_ID_TOKENS % block_size == 0,
        "block size {block_size} does not divide the trace's {TRACE_ID_TOKENS}-token ids"
    );
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading trace {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            trace_request(line, block_size)
                .with_context(|| format!("trace {} line {}", path.display(), index + 1))
        })
        .collect()
}

fn trace_request(line: &str, block_size: u32) -> Result<TraceRequest> {
    let request: TraceLine = serde_json::from_str(line).context("not a trace request")?;
    let Some(last_index) = request.hash_ids.len().checked_sub(1) else {
        bail!("no hash_ids");
    };
    let covered_before_last = TRACE_ID_TOKENS as u64 * last_index as u64;
    let last_tokens = (request.input_length as u64)
        .checked_sub(covered_before_last)
        .filter(|&n| n > 0 && n <= TRACE_ID_TOKENS as u64)
        .with_context(|| {
            format!(
                "input_length {} does not fit {} hash ids of {TRACE_ID_TOKENS} tokens",
                request.input_length,
                request.hash_ids.len()
            )
        })?;
    let mut prompt = Vec::with_capacity(request.input_length as usize);
    for (index, &id) in request.hash_ids.iter().enumerate() {
        let tokens = if index == last_index {
            last_tokens as u32
        } else {
            TRACE_ID_TOKENS
        };
        prompt.extend((0..tokens).map(|offset| {
            let sub_block = offset / block_size;
            let key = mix(
                id,
                ((sub_block as u64) << 32) | (offset % block_size) as u64,
            );
            (key % VOCABULARY) as u32
        }));
    }
    Ok(TraceRequest {
        timestamp_ms: request.timestamp,
        output_length: request.output_length,
        prompt,
    })
}

/// Shape of a synthetic chat workload: a few long system prompts shared by many conversations
/// that grow turn by turn, so prompts share both the system prefix and their own history.
#[derive(Clone, Debug)]
pub struct Conversations {
    pub system_prompts: usize,
    pub system_tokens: usize,
    pub conversations: usize,
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
            turns: 5,
            user_tokens: 200,
            reply_tokens: 300,
            seed: 0,
        }
    }
}

impl Conversations {
    /// Every turn of every conversation (`conversations × turns` prompts), conversations
    /// interleaved at random: each prompt is its system prompt, its history and the new message.
    pub fn prompts(&self) -> Vec<Vec<u32>> {
        if self.turns == 0 {
            return Vec::new();
        }
        let mut rng = SplitMix64::new(self.seed);
        let systems: Vec<Vec<u32>> = (0..self.system_prompts.max(1))
            .map(|_| random_tokens(self.system_tokens, &mut rng))
            .collect();
        let mut active: Vec<(Vec<u32>, usize)> = (0..self.conversations)
            .map(|_| {
                let system = &systems[rng.below(systems.len() as u64) as usize];
                (system.clone(), 0)
            })
            .collect();
        let mut prompts = Vec::with_capacity(self.conversations * self.turns);
        while !active.is_empty() {
            let pick = rng.below(active.len() as u64) as usize;
            let (history, turns_done) = &mut active[pick];
            history.extend(random_tokens(self.user_tokens, &mut rng));
            prompts.push(history.clone());
            history.extend(random_tokens(self.reply_tokens, &mut rng));
            *turns_done += 1;
            if *turns_done == self.turns {
                active.swap_remove(pick);
            }
        }
        prompts
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

/// Cycles through `prompts` until `count` were produced (an empty list produces nothing).
pub fn take_cycled(prompts: Vec<Vec<u32>>, count: usize) -> impl Iterator<Item = Vec<u32>> {
    let mut queue: VecDeque<Vec<u32>> = prompts.into();
    let total = if queue.is_empty() { 0 } else { count };
    (0..total).filter_map(move |_| {
        let prompt = queue.pop_front()?;
        queue.push_back(prompt.clone());
        Some(prompt)
    })
}
