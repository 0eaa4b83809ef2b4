//! What one rank caches, block by block, with everything a block's key is made of: the content
//! a snapshot for a peer needs (docs/design.md "Recovery from a peer"). The index keeps keys
//! only, so an indexer that serves snapshots keeps this beside it.
//!
//! Owns: per held engine hash its parent hash, token ids, LoRA adapter, extras and copy count,
//! and the seq they are consistent with; the snapshot built from them, parents first. Never:
//! touches the index (the applier changes both in one step, following the index's verdict on
//! each event), or serves blocks it cannot chain to a root.
//!
//! Cost: per block its tokens (4 B × block_size, 64 B at 16) in their own allocation, ~72 B of
//! map entry (hash, parent, tokens pointer, adapter, extras pointer, copies) and the map's
//! slack, several times what the index pays for the block (`examples/bench_peers.rs` prints it
//! per block: docs/performance.md "Replicas: bench_peers"). Hence off unless `peers` or
//! `serve_snapshots` asks for it.

use std::collections::HashMap;
use std::sync::Arc;

use crate::index::{ApplyOutcome, Tier, WorkerBlocks};
use crate::wire::{self, BlockExtras, BlockStored, Event};

/// One held engine hash.
struct Held {
    parent: Option<u64>,
    tokens: Box<[u32]>,
    lora: Option<Arc<str>>,
    extras: Option<Box<BlockExtras>>,
    copies: u32,
}

impl Held {
    /// Whether a re-store of the block keys the same: the index then adds a copy. Its adapter
    /// is part of a root block's key only (later blocks chain from their parent's key).
    fn same_content(&self, other: &Held) -> bool {
        self.parent == other.parent
            && self.tokens == other.tokens
            && self.extras == other.extras
            && (self.parent.is_some() || self.lora == other.lora)
    }
}

/// A rank's blocks as a peer's snapshot would rebuild them.
#[derive(Default)]
pub(super) struct Contents {
    blocks: HashMap<u64, Held>,
    /// The seq of the last batch applied; `None` before any, and after a clear until the next.
    seq: Option<u64>,
    /// The rank stored into a KV-cache group beyond 0 since the last clear: a snapshot of group
    /// 0 alone would make a peer score it as a plain rank (false hits), so none is served.
    hybrid: bool,
    /// The rank's blocks came from a saved state, which holds keys and no token ids: these
    /// contents miss them, so nothing is served until the next clear.
    restored: bool,
}

/// A rank's snapshot, taken under the lock and encoded (`body`) after it: encoding a rank's
/// blocks as JSON is work per block, which the rank's listener need not wait for.
pub(super) struct Built {
    seq: u64,
    events: Vec<BlockStored>,
    pub(super) blocks: usize,
    /// Blocks left out because their parent is no longer held (evicted before its child):
    /// a receiver could not key them.
    pub(super) orphans: usize,
}

impl Built {
    /// The `/kv_recover` body.
    pub(super) fn body(&self, dp_rank: u32, block_size: u32) -> Vec<u8> {
        wire::encode_snapshot(Some(self.seq), dp_rank, block_size, &self.events)
    }
}

impl Contents {
    /// Applies `event` to the index's `blocks` and follows it here, in one step: a store or
    /// removal the index skipped (unknown parent, other medium, bad length) is skipped here too.
    pub(super) fn apply(
        &mut self,
        blocks: &mut WorkerBlocks,
        event: &Event,
        outcome: &mut ApplyOutcome,
    ) {
        let counted = outcome.stored + outcome.removed;
        blocks.apply(event, outcome);
        // A snapshot is the GPU tier's state (what `/kv_recover` carries): the lower tiers'
        // events reach the index but not the contents, or a CPU copy of a GPU block would be
        // served as a second GPU copy.
        let gpu = |medium: &Option<String>| Tier::of_medium(medium.as_deref()) == Some(Tier::Gpu);
        let applied = outcome.stored + outcome.removed != counted;
        let group_0 = |group: Option<u32>| group.unwrap_or(0) == 0;
        match event {
            Event::Stored(stored)
                if applied && gpu(&stored.medium) && !group_0(stored.group_idx) =>
            {
                self.hybrid = true;
            }
            Event::Stored(stored) if applied && gpu(&stored.medium) => {
                self.store(stored, blocks.treats_restores_as_reports())
            }
            Event::Removed(removed)
                if applied && gpu(&removed.medium) && group_0(removed.group_idx) =>
            {
                for hash in &removed.block_hashes {
                    if let Some(held) = self.blocks.get_mut(hash) {
                        held.copies -= 1;
                        if held.copies == 0 {
                            self.blocks.remove(hash);
                        }
                    }
                }
            }
            Event::Cleared { medium } if gpu(medium) => self.blocks.clear(),
            _ => {}
        }
    }

    /// The batch (or snapshot) at `seq` is applied.
    pub(super) fn applied_through(&mut self, seq: u64) {
        self.seq = Some(seq);
    }

    /// Every block gone (publisher restart, snapshot about to be applied): nothing to serve
    /// until the next batch or snapshot is applied.
    pub(super) fn clear(&mut self) {
        self.blocks.clear();
        self.seq = None;
        self.hybrid = false;
        self.restored = false;
    }

    /// The rank was loaded from a saved state: serve nothing until its next clear.
    pub(super) fn unservable_until_clear(&mut self) {
        self.restored = true;
    }

    /// Follows a store the index applied; `rereports`: a held block stored again is announced
    /// again, not copied (`WorkerBlocks::reports_reused`).
    fn store(&mut self, stored: &BlockStored, rereports: bool) {
        let block_size = stored.block_size as usize;
        let lora: Option<Arc<str>> = stored.lora_name.as_deref().map(Arc::from);
        let mut parent = stored.parent;
        for (i, (&hash, tokens)) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(block_size))
            .enumerate()
        {
            let extras = stored
                .extras
                .get(i)
                .filter(|extras| !extras.is_plain())
                .map(|extras| Box::new(extras.clone()));
            let new = Held {
                parent,
                tokens: tokens.into(),
                lora: lora.clone(),
                extras,
                copies: 1,
            };
            match self.blocks.get_mut(&hash) {
                Some(held) if held.same_content(&new) => {
                    if !rereports {
                        held.copies += 1;
                    }
                }
                Some(held) => *held = new,
                None => {
                    self.blocks.insert(hash, new);
                }
            }
            parent = Some(hash);
        }
    }

    /// The rank's snapshot events (docs/design.md "Snapshot endpoint"): one event per
    /// unbranched run, parents first, each further copy of a block as one more store of it;
    /// `None` when nothing was applied since the last clear, or the rank is hybrid or restored.
    pub(super) fn build(&self, block_size: u32) -> Option<Built> {
        if self.hybrid || self.restored {
            return None;
        }
        let seq = self.seq?;
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut pending: Vec<u64> = Vec::new();
        for (&hash, held) in &self.blocks {
            match held.parent {
                Some(parent) => children.entry(parent).or_default().push(hash),
                None => pending.push(hash),
            }
        }
        // Sorted so that the same state always gives the same body.
        pending.sort_unstable();
        children.values_mut().for_each(|list| list.sort_unstable());
        let mut events = Vec::new();
        let mut served = 0;
        while let Some(first) = pending.pop() {
            let Some(held) = self.blocks.get(&first) else {
                continue;
            };
            let mut event = BlockStored::new(Vec::new(), held.parent, Vec::new(), block_size);
            event.lora_name = held.lora.as_deref().map(str::to_owned);
            let mut extras = Vec::new();
            let mut copies = Vec::new();
            let mut current = first;
            while let Some(held) = self.blocks.get(&current) {
                event.block_hashes.push(current);
                event.token_ids.extend_from_slice(&held.tokens);
                extras.push(held.extras.as_deref().cloned().unwrap_or_default());
                if held.copies > 1 {
                    copies.push(current);
                }
                served += 1;
                match children.get(&current).map(Vec::as_slice) {
                    Some([only]) if self.blocks.get(only).is_some_and(|c| c.lora == held.lora) => {
                        current = *only;
                    }
                    Some(forks) => {
                        pending.extend_from_slice(forks);
                        break;
                    }
                    None => break,
                }
            }
            if extras.iter().any(|extras| !extras.is_plain()) {
                event.extras = extras;
            }
            events.push(event);
            for hash in copies {
                self.copy_events(hash, block_size, &mut events);
            }
        }
        Some(Built {
            seq,
            events,
            blocks: served,
            orphans: self.blocks.len() - served,
        })
    }

    /// One more store of `hash` per copy beyond the first: the index adds a copy for each.
    fn copy_events(&self, hash: u64, block_size: u32, events: &mut Vec<BlockStored>) {
        let Some(held) = self.blocks.get(&hash) else {
            return;
        };
        for _ in 1..held.copies {
            let mut event =
                BlockStored::new(vec![hash], held.parent, held.tokens.to_vec(), block_size);
            event.lora_name = held.lora.as_deref().map(str::to_owned);
            if let Some(extras) = &held.extras {
                event.extras = vec![(**extras).clone()];
            }
            events.push(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Index;
    use crate::wire::{BlockRemoved, MmPlacement};

    fn apply(blocks: &mut WorkerBlocks, contents: &mut Contents, event: Event) {
        contents.apply(blocks, &event, &mut ApplyOutcome::default());
    }

    fn stored(hashes: &[u64], parent: Option<u64>, first_token: u32) -> Event {
        let tokens = (0..hashes.len() as u32 * 4)
            .map(|t| first_token + t)
            .collect();
        Event::Stored(BlockStored::new(hashes.to_vec(), parent, tokens, 4))
    }

    /// A rank rebuilt from the snapshot answers every prompt as the original does: extras,
    /// lookahead and copies included; an orphan (its parent evicted) is left out and counted.
    #[test]
    fn a_snapshot_rebuilds_the_same_keys_and_copies() {
        let index = Index::new(4, 4);
        let mut original = index.add_worker();
        let mut contents = Contents::default();
        apply(&mut original, &mut contents, stored(&[1, 2, 3], None, 0));
        apply(&mut original, &mut contents, stored(&[4], Some(2), 100));
        // A second copy of block 3, and a block with multimodal extras and lookahead.
        apply(&mut original, &mut contents, stored(&[3], Some(2), 8));
        let mut special = BlockStored::new(vec![9], None, vec![7, 7, 7, 7], 4);
        special.lora_name = Some("adapter".into());
        let special_extras = BlockExtras {
            mm_items: vec![MmPlacement {
                identifier: "img".into(),
                offset: -2,
            }],
            cache_salt: Some("salt".into()),
            lookahead: vec![5, 6],
            opaque: Vec::new(),
        };
        special.extras = vec![special_extras.clone()];
        apply(&mut original, &mut contents, Event::Stored(special));
        // Block 10 then 11 under it; evicting 10 leaves 11 an orphan.
        apply(&mut original, &mut contents, stored(&[10, 11], None, 50));
        let removed = |hashes: Vec<u64>| {
            Event::Removed(BlockRemoved {
                block_hashes: hashes,
                medium: None,
                group_idx: None,
            })
        };
        apply(&mut original, &mut contents, removed(vec![10]));
        contents.applied_through(41);

        let built = contents.build(4).expect("a seq was applied");
        assert_eq!((built.blocks, built.orphans), (5, 1));
        let snapshot = wire::decode_snapshot(&built.body(0, 4)).expect("decodes");
        assert_eq!(snapshot.seq, Some(41));
        let read_back = snapshot
            .events
            .iter()
            .find(|event| event.block_hashes == [9])
            .expect("block 9 is served");
        assert_eq!(read_back.lora_name.as_deref(), Some("adapter"));
        assert_eq!(read_back.extras, [special_extras]);
        let mut rebuilt = index.add_worker();
        let mut outcome = ApplyOutcome::default();
        for event in snapshot.events {
            rebuilt.apply(&Event::Stored(event), &mut outcome);
        }
        assert_eq!(outcome.parent_missing, 0);
        // Everything but the orphan, block 3 twice.
        assert_eq!(rebuilt.blocks(), original.blocks() - 1);
        for prompt in [
            (0..12).collect::<Vec<u32>>(),
            (0..8).chain(100..104).collect(),
        ] {
            let scores = index.query(&prompt, None, &|_| true);
            let of = |worker| {
                scores
                    .iter()
                    .find(|s| s.worker == worker)
                    .map(|s| s.matched_blocks)
            };
            assert_eq!(of(original.id()), of(rebuilt.id()), "{prompt:?}");
            assert!(of(original.id()).is_some_and(|m| m > 0));
        }
        // After removing one copy of block 3 from both, both still hold it.
        let mut after = ApplyOutcome::default();
        original.apply(&removed(vec![3]), &mut after);
        rebuilt.apply(&removed(vec![3]), &mut after);
        let scores = index.query(&(0..12).collect::<Vec<u32>>(), None, &|_| true);
        assert!(scores.iter().all(|s| s.matched_blocks == 3), "{scores:?}");
    }

    #[test]
    fn nothing_is_served_before_a_batch_or_after_a_clear() {
        let mut contents = Contents::default();
        assert!(contents.build(4).is_none());
        contents.applied_through(3);
        assert!(contents.build(4).is_some());
        contents.clear();
        assert!(contents.build(4).is_none());
    }

    /// Offloading announces a GPU block's engine hash again in the CPU tier (and may clear that
    /// tier alone): the snapshot still serves the GPU copy once, and a CPU clear keeps it.
    #[test]
    fn lower_tier_events_leave_the_contents_alone() {
        let index = Index::new(4, 4);
        let mut blocks = index.add_worker();
        let mut contents = Contents::default();
        apply(&mut blocks, &mut contents, stored(&[1, 2], None, 0));
        let Event::Stored(mut offloaded) = stored(&[2], Some(1), 4) else {
            unreachable!("stored() builds a store");
        };
        offloaded.medium = Some("CPU".into());
        apply(&mut blocks, &mut contents, Event::Stored(offloaded));
        apply(
            &mut blocks,
            &mut contents,
            Event::Cleared {
                medium: Some("CPU".into()),
            },
        );
        contents.applied_through(3);
        let built = contents.build(4).expect("a seq was applied");
        let snapshot = wire::decode_snapshot(&built.body(0, 4)).expect("decodes");
        let served: Vec<u64> = snapshot
            .events
            .iter()
            .flat_map(|event| event.block_hashes.iter().copied())
            .collect();
        assert_eq!(served, [1, 2], "one GPU copy of each block");
    }
}
