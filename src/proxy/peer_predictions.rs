//! Predictions shared between route front ends (docs.md "Two routers on one fleet"): each
//! prediction a reservation makes here (the rank, the prompt's block keys, its time-to-live)
//! and the prefill it puts on its rank are sent to the `peers`, then the end of that prefill;
//! a peer counts the prediction as one of its own and the prefill as a reservation until told
//! it ended, so that two replicas choose as one router would: neither prefills a hot prefix
//! again beside its first prefill, nor on another rank once one holds it.
//!
//! Owns: the outbox, bounded in records and bytes (`share` and `prefilled` only queue: a full
//! one drops, and counts the predictions it drops); its batches (every `FLUSH_EVERY`, or `MAX_BATCH_RECORDS` / `MAX_BATCH_BYTES`); one
//! `POST /peer_predictions` per peer and batch, with the shared secret as its bearer (a peer
//! still busy with the last batch, failing or slower than `PEER_TIMEOUT` has the batch dropped
//! and counted); the batch's wire form; and the receiving side's checks: the peer's keys agree
//! with ours (the same block size and the same key of a probe block) and the rank runs here.
//! Never: makes a request wait on a peer, records a peer's prediction as cached blocks (it is
//! a prediction here too, and expires as one), or keeps it, or a peer's prefill, beyond our
//! own `predicted_ttl_s`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::engine_http::Connections;
use super::upstream::{post_json, Server};
use crate::discover::BaseUrl;
use crate::index::block_keys;
use crate::listener::Replication;
use crate::metrics::{Metrics, PeerPrediction};
use crate::plan::WorkerKey;
use crate::registry::RankBoard;
use crate::select::{PeerReservation, Predicted, Selector};

/// The route, on every indexer's HTTP API (`listen`, where `peers` point), behind the shared
/// secret.
pub const PATH: &str = "/peer_predictions";

/// How long a batch gathers records after its first: short, because two replicas that choose
/// a rank within it do not yet see each other's choice (on the ladder's burst, 15 ms left
/// two cold prefills colliding on one rank; 2 ms, one pair in 200 requests).
const FLUSH_EVERY: Duration = Duration::from_millis(2);
/// A batch is sent at this many records, or at this many bytes, whichever comes first.
const MAX_BATCH_RECORDS: usize = 64;
const MAX_BATCH_BYTES: usize = 1 << 20;
/// The outbox's bounds: beyond either, a prediction is dropped (counted), never waited for.
const MAX_QUEUED_RECORDS: usize = 1024;
const MAX_QUEUED_BYTES: usize = 8 << 20;
/// The longest a peer may take to take a batch; it gets no other until it has.
const PEER_TIMEOUT: Duration = Duration::from_millis(500);
/// The largest body the receiving side reads: a full batch and its last record (at most
/// `select::MAX_PREDICTED_BLOCKS` keys).
pub const MAX_BODY_BYTES: usize = 2 << 20;
/// The most a peer's answer may hold (a small JSON).
const ANSWER_CAP: usize = 4096;

/// The bytes of JSON a key takes at most (20 digits and a comma).
const KEY_BYTES: usize = 21;

/// What makes two indexers' keys the same: the block size and the key of a probe block (the
/// tokens `0..block_size`), which differs when the key function does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct KeyCheck {
    block_size: u32,
    probe_key: u64,
}

impl KeyCheck {
    fn of(block_size: u32) -> KeyCheck {
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
struct Batch<R> {
    #[serde(flatten)]
    check: KeyCheck,
    #[serde(default)]
    sender: u64,
    records: Vec<R>,
    #[serde(default)]
    prefilled: Vec<u64>,
}

#[derive(Serialize)]
struct RecordOut<'a> {
    engine: &'a str,
    dp_rank: u32,
    ttl_ms: u64,
    keys: &'a [u64],
    reservation: u64,
    prefill_blocks: f64,
}

#[derive(Deserialize)]
struct RecordIn {
    engine: String,
    dp_rank: u32,
    ttl_ms: u64,
    keys: Vec<u64>,
    #[serde(default)]
    reservation: u64,
    #[serde(default)]
    prefill_blocks: f64,
}

/// What waits in the outbox: a prediction, with the reservation that made it, or the end of
/// that reservation's prefill.
enum Queued {
    Predicted {
        key: WorkerKey,
        predicted: Predicted,
        reservation: u64,
    },
    Prefilled(u64),
}

impl Queued {
    /// Its bytes in a batch, at most.
    fn bytes(&self) -> usize {
        match self {
            Queued::Predicted { key, predicted, .. } => {
                128 + key.engine.len() + KEY_BYTES * predicted.keys.len()
            }
            Queued::Prefilled(_) => KEY_BYTES,
        }
    }
}

/// The sending side: the outbox and what its batches go through.
pub(super) struct PeerPredictions {
    outbox: mpsc::Sender<Queued>,
    inbox: Mutex<Option<mpsc::Receiver<Queued>>>,
    queued_bytes: AtomicUsize,
    replication: Arc<Replication>,
    connections: Arc<Connections>,
    metrics: Arc<Metrics>,
    check: KeyCheck,
    sender: u64,
}

impl PeerPredictions {
    pub(super) fn new(
        replication: Arc<Replication>,
        metrics: Arc<Metrics>,
        block_size: u32,
    ) -> PeerPredictions {
        let (outbox, inbox) = mpsc::channel(MAX_QUEUED_RECORDS);
        PeerPredictions {
            outbox,
            inbox: Mutex::new(Some(inbox)),
            queued_bytes: AtomicUsize::new(0),
            replication,
            connections: Arc::default(),
            metrics,
            check: KeyCheck::of(block_size),
            sender: rand::random(),
        }
    }

    /// Queues `predicted` on `key`, made by `reservation`, for the peers, if there are any;
    /// drops it (counted once per peer) when the outbox is full.
    pub(super) fn share(&self, key: &WorkerKey, predicted: &Predicted, reservation: u64) {
        self.queue(Queued::Predicted {
            key: key.clone(),
            predicted: predicted.clone(),
            reservation,
        });
    }

    /// Queues the end of `reservation`'s prefill (or of the reservation) for the peers.
    pub(super) fn prefilled(&self, reservation: u64) {
        self.queue(Queued::Prefilled(reservation));
    }

    fn queue(&self, queued: Queued) {
        let peers = self.replication.peers().len() as u64;
        if peers == 0 {
            return;
        }
        let bytes = queued.bytes();
        let counted = matches!(queued, Queued::Predicted { .. });
        let before = self.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > MAX_QUEUED_BYTES || self.outbox.try_send(queued).is_err() {
            self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
            if counted {
                self.metrics
                    .peer_predictions(PeerPrediction::dropped, peers);
            }
        }
    }

    /// Sends the outbox's batches to the peers until stopped (its task is).
    pub(super) async fn run(&self) {
        let Some(mut inbox) = self.inbox.lock().take() else {
            return;
        };
        let mut posting: HashMap<String, JoinHandle<()>> = HashMap::new();
        while let Some(first) = inbox.recv().await {
            let until = Instant::now() + FLUSH_EVERY;
            let mut bytes = first.bytes();
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH_RECORDS && bytes < MAX_BATCH_BYTES {
                match tokio::time::timeout_at(until, inbox.recv()).await {
                    Ok(Some(queued)) => {
                        bytes += queued.bytes();
                        batch.push(queued);
                    }
                    _ => break,
                }
            }
            self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
            self.send(&batch, &mut posting);
        }
    }

    /// Posts `batch` to every peer not still busy with the last one.
    fn send(&self, batch: &[Queued], posting: &mut HashMap<String, JoinHandle<()>>) {
        let mut body = Batch {
            check: self.check,
            sender: self.sender,
            records: Vec::with_capacity(batch.len()),
            prefilled: Vec::new(),
        };
        for queued in batch {
            match queued {
                Queued::Predicted {
                    key,
                    predicted,
                    reservation,
                } => body.records.push(RecordOut {
                    engine: &key.engine,
                    dp_rank: key.dp_rank,
                    ttl_ms: u64::try_from(predicted.ttl.as_millis()).unwrap_or(u64::MAX),
                    keys: &predicted.keys,
                    reservation: *reservation,
                    prefill_blocks: predicted.prefill_blocks,
                }),
                Queued::Prefilled(id) => body.prefilled.push(*id),
            }
        }
        let records = body.records.len() as u64;
        let body = match serde_json::to_vec(&body) {
            Ok(body) => Bytes::from(body),
            Err(err) => {
                log::warn!("peer predictions: a batch could not be encoded: {err}");
                return;
            }
        };
        let peers = self.replication.peers();
        posting.retain(|peer, post| peers.contains(peer) || !post.is_finished());
        let secret = self.replication.secret().get();
        for peer in peers.iter() {
            if posting.get(peer).is_some_and(|post| !post.is_finished()) {
                self.metrics
                    .peer_predictions(PeerPrediction::dropped, records);
                continue;
            }
            let url = match BaseUrl::parse(peer) {
                Ok(url) => url,
                Err(err) => {
                    log::debug!("peer predictions: {peer}: {err}");
                    self.metrics
                        .peer_predictions(PeerPrediction::dropped, records);
                    continue;
                }
            };
            let server = Server::keyed(url, secret.clone());
            let (connections, metrics) = (Arc::clone(&self.connections), Arc::clone(&self.metrics));
            let (body, peer_name) = (body.clone(), peer.clone());
            let post = tokio::spawn(async move {
                let posted =
                    post_json(&connections, &server, PATH, body, PEER_TIMEOUT, ANSWER_CAP).await;
                let outcome = match posted {
                    Ok(_) => PeerPrediction::sent,
                    Err(err) => {
                        log::debug!("peer predictions: {peer_name}{PATH}: {err}");
                        PeerPrediction::dropped
                    }
                };
                metrics.peer_predictions(outcome, records);
            });
            posting.insert(peer.clone(), post);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_check_tells_block_sizes_apart_and_a_batch_reads_back() {
        assert_eq!(KeyCheck::of(16), KeyCheck::of(16));
        assert_ne!(KeyCheck::of(16).probe_key, KeyCheck::of(32).probe_key);
        let keys = [1_u64, u64::MAX];
        let queued = Queued::Predicted {
            key: WorkerKey {
                engine: "a".into(),
                dp_rank: 1,
            },
            predicted: Predicted {
                keys: Arc::from(keys),
                ttl: Duration::from_secs(2),
                prefill_blocks: 1.5e300,
            },
            reservation: u64::MAX,
        };
        let batch = |records: Vec<RecordOut<'_>>| {
            let batch = Batch {
                check: KeyCheck::of(16),
                sender: u64::MAX,
                records,
                prefilled: Vec::new(),
            };
            serde_json::to_vec(&batch).expect("encodes")
        };
        let text = batch(vec![RecordOut {
            engine: "a",
            dp_rank: 1,
            ttl_ms: 2000,
            keys: &keys,
            reservation: u64::MAX,
            prefill_blocks: 1.5e300,
        }]);
        let back: Batch<RecordIn> = serde_json::from_slice(&text).expect("reads back");
        assert_eq!((back.check, back.sender), (KeyCheck::of(16), u64::MAX));
        assert_eq!(back.records[0].keys, keys);
        assert_eq!(back.records[0].engine, "a");
        assert_eq!(back.records[0].reservation, u64::MAX);
        let envelope = batch(Vec::new()).len();
        assert!(
            text.len() <= envelope + queued.bytes(),
            "the estimate bounds a record's bytes"
        );
    }
}
