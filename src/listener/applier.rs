//! The writer of one rank's blocks: decodes batches and snapshots and applies them to the rank's
//! `WorkerBlocks`, reporting what happened to its `StatusCell`. It never decides what to apply
//! (the sequence rules in `live` do) and never touches a socket.

use std::ops::RangeInclusive;
use std::sync::Arc;

use anyhow::Context as _;
use parking_lot::Mutex;

use super::contents::Contents;
use super::status::StatusCell;
use super::State;
use crate::index::{ApplyOutcome, Index, WorkerBlocks, KEY_SCHEME};
use crate::metrics::MalformedReason;
use crate::plan::ListenerSpec;
use crate::state::{RankIdentity, RankState};
use crate::wire::{self, BatchDecoder, DecodedBatch, Event, EventBatch, Snapshot};

/// Applies batches and snapshots to the rank's worker, counting what happened.
pub(super) struct Applier {
    pub(super) spec: ListenerSpec,
    pub(super) index: Arc<Index>,
    pub(super) blocks: WorkerBlocks,
    pub(super) status: Arc<StatusCell>,
    pub(super) warned_dp_rank: bool,
    pub(super) warned_block_size: bool,
    /// Whether the status cell shows KV-cache groups: then it is kept current after every
    /// batch (a plain rank's stores name none, and it is never told).
    pub(super) shows_groups: bool,
    /// The rank's block contents for peers' snapshots, when retained: changed with the index.
    pub(super) contents: Option<Arc<Mutex<Contents>>>,
    /// Keeps the buffers of applied batches for the next ones.
    pub(super) decoder: BatchDecoder,
    /// The last batch applied and its payload's digest (`wire::payload_digest`), while the
    /// rank's state is that batch's: what a saved state is confirmed by after a restart.
    /// `None` after a snapshot or a clear, until the next batch.
    pub(super) last_applied: Option<(u64, u64)>,
}

impl Applier {
    pub(super) fn who(&self) -> String {
        self.spec.describe()
    }

    /// Decodes a payload into the buffers of batches already dropped; an undecodable one is
    /// counted, and is a lost batch for the caller.
    pub(super) fn decode(&self, payload: &[u8]) -> Option<DecodedBatch> {
        match self.decoder.decode(payload) {
            Ok(batch) => Some(batch),
            Err(error) => {
                rank_event!(
                    warn,
                    &self.spec,
                    "{}: undecodable batch: {error}",
                    self.who()
                );
                self.status.malformed(MalformedReason::Payload);
                None
            }
        }
    }

    /// Applies the batch `seq`, whose payload digests to `digest`.
    pub(super) fn apply_batch(&mut self, seq: u64, digest: u64, batch: &EventBatch) {
        self.last_applied = Some((seq, digest));
        if let Some(payload_rank) = batch.dp_rank.filter(|&rank| rank != self.spec.key.dp_rank) {
            if !self.warned_dp_rank {
                self.warned_dp_rank = true;
                rank_event!(
                    warn,
                    &self.spec,
                    "{}: batches carry dp_rank {payload_rank}: another rank publishes on this \
                     port; check zmq_port and dp_size (applied to rank {} anyway)",
                    self.who(),
                    self.spec.key.dp_rank
                );
            }
            self.status.dp_rank_mismatch();
        }
        let mut outcome = ApplyOutcome::default();
        if let Some(contents) = &self.contents {
            let mut contents = contents.lock();
            for event in &batch.events {
                if self.within_cap(event) {
                    contents.apply(&mut self.blocks, event, &mut outcome);
                }
            }
            contents.applied_through(seq);
        } else {
            for event in &batch.events {
                if self.within_cap(event) {
                    self.blocks.apply(event, &mut outcome);
                }
            }
        }
        self.note_block_size(&outcome);
        self.status
            .applied(seq, &outcome, batch.skipped, self.blocks.tier_blocks());
        self.note_groups(&outcome);
    }

    /// Decodes a snapshot body and, when it is usable and covers `need`, makes it the rank's
    /// whole state. Returns the seq it covers.
    pub(super) fn apply_snapshot(&mut self, body: &[u8], need: u64) -> anyhow::Result<u64> {
        let snapshot = self.usable_snapshot(body, need..=u64::MAX)?;
        Ok(self.install_snapshot(snapshot))
    }

    /// Decodes a snapshot body and checks it: the index's block size, a seq in `seqs` (the
    /// hole's end up to, for a peer's, the newest seq this listener has seen live: see
    /// docs/design.md "Recovery from a peer"). The snapshot's seq is then `Some`.
    pub(super) fn usable_snapshot(
        &self,
        body: &[u8],
        seqs: RangeInclusive<u64>,
    ) -> anyhow::Result<Snapshot> {
        let snapshot = wire::decode_snapshot(body).context("decoding the snapshot")?;
        let block_size = self.index.block_size();
        anyhow::ensure!(
            snapshot.block_size == block_size,
            "snapshot block_size {} differs from the index's {block_size}",
            snapshot.block_size
        );
        let (need, newest) = (*seqs.start(), *seqs.end());
        match snapshot.seq {
            Some(seq) if seq > newest => anyhow::bail!(
                "snapshot at seq {seq} is past seq {newest}, the newest this listener has seen: \
                 it may be of a publisher process that has restarted since"
            ),
            Some(seq) if seq >= need => {}
            seq => anyhow::bail!(
                "snapshot at seq {seq:?} is older than seq {need}: it does not cover the hole"
            ),
        }
        if let Some(rank) = snapshot
            .dp_rank
            .filter(|&rank| rank != self.spec.key.dp_rank)
        {
            rank_event!(
                warn,
                &self.spec,
                "{}: snapshot says dp_rank {rank}",
                self.who()
            );
            self.status.dp_rank_mismatch();
        }
        Ok(snapshot)
    }

    /// Makes a snapshot `usable_snapshot` approved the rank's whole state; returns its seq.
    pub(super) fn install_snapshot(&mut self, snapshot: Snapshot) -> u64 {
        let seq = snapshot.seq.unwrap_or_default();
        self.clear();
        let mut outcome = ApplyOutcome::default();
        let mut contents = self.contents.as_ref().map(|contents| contents.lock());
        for stored in snapshot.events {
            let event = Event::Stored(stored);
            if !self.within_cap(&event) {
                continue;
            }
            match contents.as_mut() {
                Some(contents) => contents.apply(&mut self.blocks, &event, &mut outcome),
                None => self.blocks.apply(&event, &mut outcome),
            }
        }
        if let Some(contents) = contents.as_mut() {
            contents.applied_through(seq);
        }
        drop(contents);
        self.note_block_size(&outcome);
        self.status
            .snapshot_applied(seq, &outcome, self.blocks.tier_blocks());
        self.note_groups(&outcome);
        seq
    }

    pub(super) fn clear(&mut self) {
        self.last_applied = None;
        if let Some(contents) = &self.contents {
            contents.lock().clear();
        }
        self.blocks.clear();
        self.status.set_blocks(self.blocks.tier_blocks());
        self.status.under_cap();
        self.note_groups(&ApplyOutcome::default());
    }

    /// Who the rank is and what its keys assume, as a state file records it.
    pub(super) fn identity(&self) -> RankIdentity {
        RankIdentity {
            engine: self.spec.key.engine.clone(),
            dp_rank: self.spec.key.dp_rank,
            endpoint: self.spec.endpoint.to_string(),
            model: self.spec.model.clone(),
            block_size: self.index.block_size(),
            key_scheme: KEY_SCHEME,
        }
    }

    /// The rank's state to save, while it is exact (`active`) at a batch whose digest is known:
    /// a rank that is partial, recovering or degraded, or just rebuilt from a snapshot, keeps
    /// the file it has.
    pub(super) fn saved_state(&self) -> Option<RankState> {
        let (last_seq, last_digest) = self.last_applied?;
        if self.status.state() != State::Active {
            return None;
        }
        Some(RankState {
            identity: self.identity(),
            last_seq,
            last_digest,
            saved_at_ms: crate::state::unix_ms(),
            blocks: self.blocks.export(),
        })
    }

    /// Makes a saved state the rank's whole state, once the engine's replay of its last batch
    /// confirmed it is the same publisher run. A state that does not load leaves the rank
    /// empty.
    pub(super) fn restore(&mut self, saved: &RankState) -> anyhow::Result<()> {
        self.clear();
        self.blocks
            .import(&saved.blocks)
            .context("loading the saved blocks into the index")?;
        if let Some(contents) = &self.contents {
            // The saved state carries keys, not the token ids a peer's snapshot is built from.
            contents.lock().unservable_until_clear();
        }
        self.last_applied = Some((saved.last_seq, saved.last_digest));
        self.status
            .state_restored(saved.last_seq, self.blocks.tier_blocks());
        self.note_groups(&ApplyOutcome::default());
        Ok(())
    }

    /// Whether `event` may be applied: a store that would take the rank past
    /// `max_blocks_per_rank` (every tier counted) is not, and is counted instead, so that no
    /// engine, or anything answering on its port, grows the index without bound. A dropped
    /// store is a miss, never a false hit; the rank is `degraded` until its state is whole
    /// again (a publisher restart, a snapshot).
    fn within_cap(&self, event: &Event) -> bool {
        let Event::Stored(stored) = event else {
            return true;
        };
        let cap = self.index.max_blocks_per_rank();
        let held = self.blocks.tier_blocks();
        let adding = stored.block_hashes.len() as u64;
        if (held.gpu + held.cpu + held.disk).saturating_add(adding) <= cap {
            return true;
        }
        if self.status.over_cap(adding, cap) {
            rank_event!(
                warn,
                &self.spec,
                "{}: holds {} blocks, and a store of {adding} more would pass \
                 max_blocks_per_rank ({cap}): stores past it are counted \
                 (blocks_over_cap_total), not indexed; the rank is degraded until it restarts \
                 or is recovered from a snapshot",
                self.who(),
                held.gpu + held.cpu + held.disk
            );
        }
        false
    }

    /// Logs a new publisher layout, and shows the rank's groups once its stores name any.
    fn note_groups(&mut self, outcome: &ApplyOutcome) {
        if outcome.layout_changes > 0 {
            rank_event!(
                warn,
                &self.spec,
                "{}: a KV-cache group changed its kind or window ({} times in the last batch): \
                 a new publisher layout, every group's blocks dropped and learned again",
                self.who(),
                outcome.layout_changes
            );
        }
        let groups = self.blocks.groups();
        if groups.is_empty() && !self.shows_groups {
            return;
        }
        self.shows_groups = !groups.is_empty();
        self.status.set_groups(groups, self.blocks.inexact());
    }

    fn note_block_size(&mut self, outcome: &ApplyOutcome) {
        if outcome.block_size_mismatch == 0 {
            return;
        }
        if !self.warned_block_size {
            self.warned_block_size = true;
            rank_event!(
                error,
                &self.spec,
                "{}: stores with a block size other than the index's {}: nothing they say can \
                 match a prompt; set block_size to the engine's --block-size",
                self.who(),
                self.index.block_size()
            );
        }
        self.status.block_size_mismatch();
    }
}
