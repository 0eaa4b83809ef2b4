//! Predictions shared between route front ends (docs.md "Two routers on one fleet"): each
//! prediction a reservation makes here (the rank, the prompt's block keys, its time-to-live)
//! and the prefill it puts on its rank are sent to the `peers`, then the end of that prefill;
//! a peer (`api::peer_predictions`) counts the prediction as one of its own and the prefill as
//! a reservation until told it ended, so that two replicas choose as one router would: neither
//! prefills a hot prefix again beside its first prefill, nor on another rank once one holds it.
//!
//! Owns: the outbox, bounded in records and bytes (`share` and `prefilled` only queue: a full
//! one drops, and counts the predictions it drops); its batches (sent at once, or when the
//! peers have taken the last one, with what came meanwhile, up to `MAX_BATCH_RECORDS` /
//! `MAX_BATCH_BYTES`); one `POST /peer_predictions` per peer and batch, with the shared secret
//! as its bearer (a peer still busy with the last batch after `BUSY_WAIT`, failing or slower
//! than `PEER_TIMEOUT` has the batch dropped and counted). Never: makes a request wait on a
//! peer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::upstream::{post_json, Server};
use crate::api::peer_predictions::{Batch, KeyCheck, RecordOut, PATH};
use crate::discover::BaseUrl;
use crate::engine_http::Connections;
use crate::listener::Replication;
use crate::metrics::{Metrics, PeerPrediction};
use crate::plan::WorkerKey;
use crate::select::Predicted;

/// The longest a batch waits for a peer still taking the last one, gathering the records that
/// come meanwhile; past it, that peer is not sent the batch. A batch leaves at once otherwise:
/// two replicas that choose a rank before hearing of each other's choice collide (on the
/// ladder's burst, gathering for 15 ms left two cold prefills on one rank; for 2 ms, a tail's
/// prefill ahead of a cold prompt in 2 runs of 3).
const BUSY_WAIT: Duration = Duration::from_millis(50);
/// A batch is sent at this many records, or at this many bytes, whichever comes first.
const MAX_BATCH_RECORDS: usize = 64;
const MAX_BATCH_BYTES: usize = 1 << 20;
/// The outbox's bounds: beyond either, a prediction is dropped (counted), never waited for.
const MAX_QUEUED_RECORDS: usize = 1024;
const MAX_QUEUED_BYTES: usize = 8 << 20;
/// The longest a peer may take to take a batch; it gets no other until it has.
const PEER_TIMEOUT: Duration = Duration::from_millis(500);
/// The most a peer's answer may hold (a small JSON).
const ANSWER_CAP: usize = 4096;

/// The bytes of JSON a key takes at most (20 digits and a comma).
const KEY_BYTES: usize = 21;

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
            // The records queued while the last batch was being taken join this one.
            let until = Instant::now() + BUSY_WAIT;
            for post in posting.values_mut().filter(|post| !post.is_finished()) {
                let _ = tokio::time::timeout_at(until, post).await;
            }
            let mut bytes = first.bytes();
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH_RECORDS && bytes < MAX_BATCH_BYTES {
                match inbox.try_recv() {
                    Ok(queued) => {
                        bytes += queued.bytes();
                        batch.push(queued);
                    }
                    Err(_) => break,
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
                tracing::warn!("peer predictions: a batch could not be encoded: {err}");
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
                    tracing::debug!("peer predictions: {peer}: {err}");
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
                        tracing::debug!("peer predictions: {peer_name}{PATH}: {err}");
                        PeerPrediction::dropped
                    }
                };
                metrics.peer_predictions(outcome, records);
            });
            posting.insert(peer.clone(), post);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::peer_predictions::RecordIn;

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
