//! The receiving side of the predictions route front ends share (docs.md "Two routers on one
//! fleet"), and the batch's wire form both sides write and read (`proxy::peer_predictions`
//! sends it): `POST /peer_predictions` on the indexer API, behind the shared secret.
//!
//! Owns: the batch's form, and the checks a batch meets here: at most `MAX_BODY_BYTES`, the
//! peer's keys agree with ours (the same block size and the same key of a probe block), and
//! each record's rank runs here. Never: records a peer's prediction as cached blocks (it is a
//! prediction here too, recorded in `select`, and expires as one).

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::index::block_keys;
use crate::metrics::{Metrics, PeerPrediction};
use crate::plan::WorkerKey;
use crate::registry::RankBoard;
use crate::select::{PeerReservation, Selector};

/// The route, on every indexer's HTTP API (`listen`, where `peers` point), behind the shared
/// secret.
pub const PATH: &str = "/peer_predictions";

/// The largest body the receiving side reads: a full batch and its last record (at most
/// `select::MAX_PREDICTED_BLOCKS` keys).
pub const MAX_BODY_BYTES: usize = 2 << 20;
/// What makes two indexers' keys the same: the block size and the key of a probe block (the
/// tokens `0..block_size`), which differs when the key function does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct KeyCheck {
    block_size: u32,
    pub(crate) probe_key: u64,
}

impl KeyCheck {
    pub(crate) fn of(block_size: u32) -> KeyCheck {
        let tokens: Vec<u32> = (0..block_size).collect();
        let probe_key = block_keys(&tokens, block_size, None)
            .first()
            .copied()
            .unwrap_or(0);
        KeyCheck {
            block_size,
            probe_key,
        }
    }
}

/// A batch as sent and read: the sender's key check, who it is (a number drawn at its start),
/// its predictions, and the ids of its reservations prefilled since.
#[derive(Serialize, Deserialize)]
pub(crate) struct Batch<R> {
    #[serde(flatten)]
    pub(crate) check: KeyCheck,
    #[serde(default)]
    pub(crate) sender: u64,
    pub(crate) records: Vec<R>,
    #[serde(default)]
    pub(crate) prefilled: Vec<u64>,
}

/// A prediction as a sender writes it (`RecordIn` as it is read).
#[derive(Serialize)]
pub(crate) struct RecordOut<'a> {
    pub(crate) engine: &'a str,
    pub(crate) dp_rank: u32,
    pub(crate) ttl_ms: u64,
    pub(crate) keys: &'a [u64],
    pub(crate) reservation: u64,
    pub(crate) prefill_blocks: f64,
}

#[derive(Deserialize)]
pub(crate) struct RecordIn {
    pub(crate) engine: String,
    dp_rank: u32,
    ttl_ms: u64,
    pub(crate) keys: Vec<u64>,
    #[serde(default)]
    pub(crate) reservation: u64,
    #[serde(default)]
    prefill_blocks: f64,
}

/// What a peer's batch became here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Received {
    pub recorded: u64,
    pub refused: u64,
}

/// Why a peer's batch was refused whole.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("the body is {0} bytes; a batch of peer predictions is at most {MAX_BODY_BYTES}")]
    TooLarge(usize),
    #[error("not a batch of peer predictions: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error(
        "the peer's block keys are not ours (its block_size {theirs}, probe key {theirs_probe}; \
         ours {ours}, {ours_probe}): give every replica the same block_size and version"
    )]
    KeysDisagree {
        theirs: u32,
        theirs_probe: u64,
        ours: u32,
        ours_probe: u64,
    },
}

impl Refused {
    /// The HTTP status the refusal answers.
    pub fn status(&self) -> u16 {
        match self {
            Refused::TooLarge(_) => 413,
            Refused::Malformed(_) => 400,
            Refused::KeysDisagree { .. } => 409,
        }
    }
}

/// A peer's batch (`body`), read and recorded in `selector` for the ranks running on `board`,
/// if its keys agree with an index of `block_size`.
pub fn receive(
    selector: &Selector,
    board: &RankBoard,
    block_size: u32,
    metrics: &Metrics,
    body: &[u8],
) -> Result<Received, Refused> {
    if body.len() > MAX_BODY_BYTES {
        return Err(Refused::TooLarge(body.len()));
    }
    let batch: Batch<RecordIn> = serde_json::from_slice(body)?;
    let ours = KeyCheck::of(block_size);
    let records = batch.records.len() as u64;
    if batch.check != ours {
        metrics.peer_predictions(PeerPrediction::refused, records);
        return Err(Refused::KeysDisagree {
            theirs: batch.check.block_size,
            theirs_probe: batch.check.probe_key,
            ours: ours.block_size,
            ours_probe: ours.probe_key,
        });
    }
    let running: HashSet<&WorkerKey> = board.running().map(|rank| &rank.spec.key).collect();
    let sender = batch.sender;
    let mut received = Received {
        recorded: 0,
        refused: 0,
    };
    for record in batch.records {
        let key = WorkerKey {
            engine: record.engine,
            dp_rank: record.dp_rank,
        };
        if !running.contains(&key) || record.keys.is_empty() {
            received.refused += 1;
            continue;
        }
        let ttl = Duration::from_millis(record.ttl_ms);
        let reserved = PeerReservation {
            sender,
            id: record.reservation,
            prefill_blocks: record.prefill_blocks,
        };
        let reserved = record.prefill_blocks.is_finite().then_some(reserved);
        selector.record_peer_prediction(&key, record.keys, ttl, reserved);
        received.recorded += 1;
    }
    for id in batch.prefilled {
        selector.peer_prefilled(sender, id);
    }
    metrics.peer_predictions(PeerPrediction::received, received.recorded);
    metrics.peer_predictions(PeerPrediction::refused, received.refused);
    Ok(received)
}
