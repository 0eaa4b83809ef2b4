//! The writer of one rank's blocks: decodes batches and snapshots and applies them to the rank's
//! `WorkerBlocks`, reporting what happened to its `StatusCell`. It never decides what to apply
//! (the sequence rules in `run` do) and never touches a socket.

use std::sync::Arc;

use anyhow::Context as _;

use super::status::StatusCell;
use crate::index::{ApplyOutcome, Index, WorkerBlocks};
use crate::metrics::MalformedReason;
use crate::plan::ListenerSpec;
use crate::wire::{self, Event, EventBatch};

/// Applies batches and snapshots to the rank's worker, counting what happened.
pub(super) struct Applier {
    pub(super) spec: ListenerSpec,
    pub(super) index: Arc<Index>,
    pub(super) blocks: WorkerBlocks,
    pub(super) status: Arc<StatusCell>,
    pub(super) warned_dp_rank: bool,
    pub(super) warned_block_size: bool,
}

impl Applier {
    pub(super) fn who(&self) -> String {
        self.spec.describe()
    }

    /// Decodes a payload; an undecodable one is counted, and is a lost batch for the caller.
    pub(super) fn decode(&self, payload: &[u8]) -> Option<EventBatch> {
        match wire::decode_batch(payload) {
            Ok(batch) => Some(batch),
            Err(error) => {
                log::warn!("{}: undecodable batch: {error}", self.who());
                self.status.malformed(MalformedReason::Payload);
                None
            }
        }
    }

    pub(super) fn apply_batch(&mut self, seq: u64, batch: &EventBatch) {
        if let Some(payload_rank) = batch.dp_rank.filter(|&rank| rank != self.spec.key.dp_rank) {
            if !self.warned_dp_rank {
                self.warned_dp_rank = true;
                log::warn!(
                    "{}: batches carry dp_rank {payload_rank}: another rank publishes on this \
                     port; check zmq_port and dp_size (applied to rank {} anyway)",
                    self.who(),
                    self.spec.key.dp_rank
                );
            }
            self.status.dp_rank_mismatch();
        }
        let mut outcome = ApplyOutcome::default();
        for event in &batch.events {
            self.blocks.apply(event, &mut outcome);
        }
        self.note_block_size(&outcome);
        self.status
            .applied(seq, &outcome, batch.skipped, self.blocks.tier_blocks());
    }

    /// Decodes a snapshot body and, when it is usable and covers `need`, makes it the rank's
    /// whole state. Returns the seq it covers.
    pub(super) fn apply_snapshot(&mut self, body: &[u8], need: u64) -> anyhow::Result<u64> {
        let snapshot = wire::decode_snapshot(body).context("decoding the snapshot")?;
        let block_size = self.index.block_size();
        anyhow::ensure!(
            snapshot.block_size == block_size,
            "snapshot block_size {} differs from the index's {block_size}",
            snapshot.block_size
        );
        let seq = snapshot.seq.filter(|&seq| seq >= need).with_context(|| {
            format!(
                "snapshot at seq {:?} is older than seq {need}: it does not cover the hole",
                snapshot.seq
            )
        })?;
        if let Some(rank) = snapshot
            .dp_rank
            .filter(|&rank| rank != self.spec.key.dp_rank)
        {
            log::warn!("{}: snapshot says dp_rank {rank}", self.who());
            self.status.dp_rank_mismatch();
        }
        self.blocks.clear();
        let mut outcome = ApplyOutcome::default();
        for stored in snapshot.events {
            self.blocks.apply(&Event::Stored(stored), &mut outcome);
        }
        self.note_block_size(&outcome);
        self.status
            .snapshot_applied(seq, &outcome, self.blocks.tier_blocks());
        Ok(seq)
    }

    pub(super) fn clear(&mut self) {
        self.blocks.clear();
        self.status.set_blocks(self.blocks.tier_blocks());
    }

    fn note_block_size(&mut self, outcome: &ApplyOutcome) {
        if outcome.block_size_mismatch == 0 {
            return;
        }
        if !self.warned_block_size {
            self.warned_block_size = true;
            log::error!(
                "{}: stores with a block size other than the index's {}: nothing they say can \
                 match a prompt; set block_size to the engine's --block-size",
                self.who(),
                self.index.block_size()
            );
        }
        self.status.block_size_mismatch();
    }
}
