//! The index's read side: what a router can ask (a prompt's matched prefix on every worker, a
//! worker's block count, the key count) and the candidates a search starts from.
//!
//! Owns the answer's shape and its (lack of) order: scores come in no particular order, and the
//! one caller that presents them (`/query` in `api::indexer`) sorts them once. It never writes
//! the index and never holds a shard lock across probes.

use std::sync::atomic::Ordering;

use super::groups::RankLayout;
use super::keys::{KeyChain, LazyKeys, Prompt};
use super::search::Search;
use super::{Index, PerTier, Tier, WorkerId};

/// One rank's answer to a query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Score {
    pub worker: WorkerId,
    /// Consecutive blocks of the prompt, from the start, that the rank holds in GPU.
    pub matched_blocks: u32,
    /// How many blocks (engine hashes) the rank holds in GPU in all.
    pub cached_blocks: u64,
    /// The prefix as an engine loads it, cumulative: `gpu` is `matched_blocks`, `cpu` adds the
    /// blocks from there on held in CPU up to the first it lacks, `disk` the blocks from there on
    /// held in disk likewise.
    pub tiers: PerTier<u32>,
}

impl Index {
    /// Every worker that holds the prompt's first block and passes `include`, with its matched
    /// prefix, in no particular order. Trailing tokens that do not fill a block are ignored.
    pub fn query(
        &self,
        tokens: &[u32],
        lora_name: Option<&str>,
        include: &dyn Fn(WorkerId) -> bool,
    ) -> Vec<Score> {
        let prompt = Prompt {
            tokens,
            lora_name,
            ..Prompt::default()
        };
        self.query_prompt(&prompt, include)
    }

    /// `query` for a prompt with a cache salt or multimodal items. Each worker is scored with
    /// the keys its engine computes: workers whose engines hash `L` lookahead tokens with the
    /// prompt's own following tokens (so a last full block without `L` tokens after it is not
    /// matched, as the engine cannot match it either), the others without.
    pub fn query_prompt(
        &self,
        prompt: &Prompt<'_>,
        include: &dyn Fn(WorkerId) -> bool,
    ) -> Vec<Score> {
        let block_size = self.block_size as usize;
        if self.lookahead_workers.load(Ordering::Relaxed) == 0 {
            let keys = LazyKeys::new(KeyChain::for_scoring(prompt, block_size, 0));
            return self.search(keys, include, 0);
        }
        let mut lookaheads: Vec<u32> = {
            let registry = self.workers.read();
            let live = registry.live.iter().flatten();
            live.filter(|stats| stats.tier == Tier::Gpu)
                .map(|stats| stats.lookahead.load(Ordering::Relaxed))
                .collect()
        };
        lookaheads.sort_unstable();
        lookaheads.dedup();
        let mut scores = Vec::new();
        for lookahead in lookaheads {
            let chain = KeyChain::for_scoring(prompt, block_size, lookahead as usize);
            scores.extend(self.search(LazyKeys::new(chain), include, lookahead));
        }
        scores
    }

    /// `query` for a plain prompt whose keys (`block_keys`) are already known, among workers
    /// whose engines hash no lookahead tokens.
    pub fn query_keys(&self, keys: &[u64], include: &dyn Fn(WorkerId) -> bool) -> Vec<Score> {
        self.search(LazyKeys::precomputed(keys), include, 0)
    }

    /// Blocks (engine hashes) a live worker holds.
    pub fn worker_blocks(&self, worker: WorkerId) -> Option<u64> {
        let registry = self.workers.read();
        let stats = registry.live.get(worker as usize)?.as_ref()?;
        Some(stats.blocks.load(Ordering::Relaxed))
    }

    /// The candidates are the included live ranks holding the first key in any tier, whose
    /// engines hash `lookahead` following tokens; those holding it in GPU match at least that
    /// block there. The search settles how far each one goes in each tier.
    fn search(
        &self,
        mut keys: LazyKeys<'_>,
        include: &dyn Fn(WorkerId) -> bool,
        lookahead: u32,
    ) -> Vec<Score> {
        if keys.len() == 0 {
            return Vec::new();
        }
        let mut holders = Vec::new();
        self.holders(keys.get(0), &mut holders);
        let tiered = self.tier_workers.load(Ordering::Relaxed) > 0;
        let hybrid = self.hybrid_ranks.load(Ordering::Relaxed) > 0;
        // By score, for the ranks with a published layout: scored by their groups.
        let mut layouts: Vec<(usize, RankLayout)> = Vec::new();
        let mut scores = Vec::with_capacity(holders.len());
        let mut closed = Vec::new();
        let mut with_orphans = Vec::new();
        // By score, when the index has lower tiers: the rank's CPU and disk workers.
        let mut lower = Vec::new();
        {
            let registry = self.workers.read();
            let mut lower_only = Vec::new();
            for &worker in &holders {
                let Some(Some(stats)) = registry.live.get(worker as usize) else {
                    continue;
                };
                // A lower tier's or a group's worker: its rank is scored below.
                if stats.tier != Tier::Gpu || stats.group != 0 {
                    lower_only.push(stats.rank);
                    continue;
                }
                if !include(worker) || stats.lookahead.load(Ordering::Relaxed) != lookahead {
                    continue;
                }
                if stats.orphans.load(Ordering::Relaxed) == 0 {
                    closed.push(scores.len());
                } else {
                    with_orphans.push(scores.len());
                }
                scores.push(Score {
                    worker,
                    matched_blocks: 1,
                    cached_blocks: stats.blocks.load(Ordering::Relaxed),
                    tiers: PerTier::all(1),
                });
                if tiered {
                    lower.push([stats.tier_worker(Tier::Cpu), stats.tier_worker(Tier::Disk)]);
                }
                if hybrid {
                    layouts.extend(RankLayout::of(stats).map(|layout| (scores.len() - 1, layout)));
                }
            }
            // Ranks holding the first block in a lower tier or a group beyond 0 only: matched
            // 0 blocks in GPU (group 0), their groups settle the rest.
            lower_only.sort_unstable();
            lower_only.dedup();
            for rank in lower_only {
                if holders.contains(&rank) || !include(rank) {
                    continue;
                }
                let Some(Some(stats)) = registry.live.get(rank as usize) else {
                    continue;
                };
                if stats.lookahead.load(Ordering::Relaxed) != lookahead {
                    continue;
                }
                scores.push(Score {
                    worker: rank,
                    matched_blocks: 0,
                    cached_blocks: stats.blocks.load(Ordering::Relaxed),
                    tiers: PerTier::all(0),
                });
                lower.push([stats.tier_worker(Tier::Cpu), stats.tier_worker(Tier::Disk)]);
                if hybrid {
                    layouts.extend(RankLayout::of(stats).map(|layout| (scores.len() - 1, layout)));
                }
            }
        }
        let mut search = Search::new(self, keys, holders, scores);
        search.run(closed, with_orphans);
        search.settle_groups(&layouts);
        if tiered {
            search.score_lower_tiers(&lower);
        }
        let mut scores = search.into_scores(tiered);
        // A hybrid rank's lower tiers would need every group offloaded alike, which their
        // events do not show: its prefix is its GPU hit.
        for &(c, _) in &layouts {
            scores[c].tiers = PerTier::all(scores[c].matched_blocks);
        }
        scores
    }
}
