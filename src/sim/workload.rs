//! Prompts for simulated engines and the routing of prompts to ranks: the Mooncake trace expanded
//! into deterministic tokens, synthetic shared-prefix conversations, round-robin or sticky routing.
//!
//! Pure functions of their inputs and seeds; it never touches a cache or a socket.

use std::collections::VecDeque;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

use crate::sim::rng::{mix, SplitMix64};

/// Tokens per hash id of the Mooncake trace.
pub const TRACE_ID_TOKENS: u32 = 512;

/// Token ids are drawn below this (the size of a typical LLM vocabulary).
const VOCABULARY: u64 = 150_000;

#[derive(Deserialize)]
struct TraceLine {
    input_length: u32,
    hash_ids: Vec<u64>,
}

/// Loads the Mooncake trace (one JSON object per line) as token prompts: each hash id becomes
/// `512 / block_size` blocks of tokens derived from (id, sub-block, offset), the last id only
/// `input_length - 512 * (ids - 1)` tokens. `block_size` must divide 512, so that equal ids give
/// equal blocks.
pub fn load_trace(path: &Path, block_size: u32) -> Result<Vec<Vec<u32>>> {
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
            trace_prompt(line, block_size)
                .with_context(|| format!("trace {} line {}", path.display(), index + 1))
        })
        .collect()
}

fn trace_prompt(line: &str, block_size: u32) -> Result<Vec<u32>> {
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
    Ok(prompt)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn trace_file(lines: &[&str]) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        for line in lines {
            writeln!(file, "{line}").expect("write");
        }
        file
    }

    #[test]
    fn trace_ids_expand_to_shared_token_prefixes() {
        let file = trace_file(&[
            r#"{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [7, 8, 9]}"#,
            r#"{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 5]}"#,
            r#"{"timestamp": 2, "input_length": 30, "output_length": 1, "hash_ids": [8]}"#,
        ]);
        let prompts = load_trace(file.path(), 16).expect("valid trace");
        assert_eq!(
            prompts.iter().map(Vec::len).collect::<Vec<_>>(),
            [1100, 1024, 30]
        );
        assert_eq!(prompts[0][..512], prompts[1][..512]);
        assert_ne!(prompts[0][512..1024], prompts[1][512..1024]);
        // Same id, other position: same tokens (the chained engine hashes still differ).
        assert_eq!(prompts[2][..], prompts[0][512..542]);
        assert!(prompts.iter().flatten().all(|&t| (t as u64) < VOCABULARY));
        // Blocks inside one id differ from each other.
        assert_ne!(prompts[0][..16], prompts[0][16..32]);
    }

    #[test]
    fn bad_trace_lines_are_errors_naming_the_line() {
        for (line, why) in [
            (
                r#"{"input_length": 2000, "hash_ids": [1, 2]}"#,
                "does not fit",
            ),
            (r#"{"input_length": 10, "hash_ids": []}"#, "no hash_ids"),
            (
                r#"{"input_length": -1, "hash_ids": [1]}"#,
                "not a trace request",
            ),
            ("not json", "not a trace request"),
        ] {
            let file = trace_file(&[r#"{"input_length": 3, "hash_ids": [1]}"#, line]);
            let error = format!("{:#}", load_trace(file.path(), 16).expect_err(line));
            assert!(error.contains("line 2") && error.contains(why), "{error}");
        }
        let file = trace_file(&[r#"{"input_length": 3, "hash_ids": [1]}"#]);
        assert!(load_trace(file.path(), 24).is_err());
        assert!(load_trace(Path::new("/nonexistent/trace.jsonl"), 16).is_err());
    }

    #[test]
    fn conversations_grow_turn_by_turn_over_shared_system_prompts() {
        let spec = Conversations {
            system_prompts: 2,
            system_tokens: 64,
            conversations: 10,
            turns: 3,
            user_tokens: 8,
            reply_tokens: 8,
            seed: 4,
        };
        let prompts = spec.prompts();
        assert_eq!(prompts.len(), 30);
        assert_eq!(prompts, spec.prompts(), "deterministic");
        let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
        assert_eq!(lengths.iter().filter(|&&n| n == 72).count(), 10);
        assert_eq!(lengths.iter().filter(|&&n| n == 88).count(), 10);
        assert_eq!(lengths.iter().filter(|&&n| n == 104).count(), 10);
        // Every later turn extends an earlier prompt of its conversation (plus the reply).
        for later in prompts.iter().filter(|p| p.len() > 72) {
            assert!(prompts
                .iter()
                .any(|earlier| earlier.len() + 16 == later.len() && later.starts_with(earlier)));
        }
        let heads: std::collections::HashSet<&[u32]> = prompts.iter().map(|p| &p[..64]).collect();
        assert!(heads.len() <= 2);
    }

    #[test]
    fn routing_round_robin_and_sticky() {
        let mut rr = Router::new(Route::RoundRobin, 3, 4);
        let ranks: Vec<u32> = (0..6).map(|_| rr.rank_for(&[1, 2, 3])).collect();
        assert_eq!(ranks, [0, 1, 2, 0, 1, 2]);

        let mut sticky = Router::new(Route::Sticky, 4, 4);
        let heads: Vec<u32> = (0..64)
            .map(|head| sticky.rank_for(&[head, 0, 0, 0, 9]))
            .collect();
        for head in 0..64u32 {
            assert_eq!(
                sticky.rank_for(&[head, 0, 0, 0, 1, 2]),
                heads[head as usize]
            );
        }
        assert!(heads.iter().all(|&r| r < 4));
        assert!((0..4).all(|r| heads.contains(&r)), "spreads over ranks");
    }

    #[test]
    fn take_cycled_repeats_the_list() {
        let got: Vec<Vec<u32>> = take_cycled(vec![vec![1], vec![2]], 5).collect();
        assert_eq!(got, [vec![1], vec![2], vec![1], vec![2], vec![1]]);
        assert_eq!(take_cycled(Vec::new(), 5).count(), 0);
    }
}
