//! One scripted engine rank for the tests that need exact control over what a rank publishes:
//! an XPUB socket (a PUB that also sees subscriptions, so a test knows the listener is
//! subscribed before it publishes, and nothing is lost to the slow joiner) speaking the real
//! protocol through `sim::encode`, with the rank's history for a `sim::replay::ReplayServer`.
//! Everything the simulated engine (`sim::server`) decides by itself (seqs, losses, restarts)
//! a test decides here batch by batch.

use std::sync::Arc;
use std::time::Duration;

use kv_indexer::wire::{BlockStored, Event, EventBatch};
use kv_indexer_sim::encode::{encode_batch, message_frames, Form};
use kv_indexer_sim::ports::free_port_range;
use kv_indexer_sim::replay::History;

/// Tokens per block of the batches `store` publishes.
pub const BLOCK_SIZE: u32 = 16;

/// How long `wait_subscribed` waits for a subscription.
const SUBSCRIBE_DEADLINE: Duration = Duration::from_secs(15);

pub struct FakeRank {
    socket: zmq::Socket,
    /// `tcp://127.0.0.1:PORT`.
    pub endpoint: String,
    pub port: u16,
    /// The rank its batches name (a test may make it lie).
    pub dp_rank: u32,
    /// The seq of the next batch (a test may skip or repeat seqs).
    pub next_seq: u64,
    /// Every batch given a seq since the last restart, sent or lost.
    pub history: History,
}

impl FakeRank {
    /// Binds on a port the OS picks.
    pub fn bind(zmq: &zmq::Context, dp_rank: u32) -> FakeRank {
        FakeRank::bind_on(zmq, "*", dp_rank).expect("bind XPUB on an OS-picked port")
    }

    /// Two ranks on consecutive ports, as an engine with dp_size 2 has them.
    pub fn bind_pair(zmq: &zmq::Context) -> (FakeRank, FakeRank) {
        for _ in 0..50 {
            let Some(base) = free_port_range(2) else {
                continue;
            };
            let first = FakeRank::bind_on(zmq, &base.to_string(), 0);
            let second = FakeRank::bind_on(zmq, &(base + 1).to_string(), 1);
            if let (Ok(first), Ok(second)) = (first, second) {
                return (first, second);
            }
        }
        panic!("no two consecutive free ports in 50 tries");
    }

    /// Binds on `tcp://127.0.0.1:{port}` (`*`: the OS picks).
    fn bind_on(zmq: &zmq::Context, port: &str, dp_rank: u32) -> zmq::Result<FakeRank> {
        let socket = zmq.socket(zmq::XPUB)?;
        socket.set_linger(0)?;
        // Never drop a batch for a slow subscriber: tests count on every block arriving.
        socket.set_sndhwm(0)?;
        socket.bind(&format!("tcp://127.0.0.1:{port}"))?;
        let endpoint = socket.get_last_endpoint()?.expect("UTF-8 endpoint");
        let port = endpoint
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .expect("tcp endpoint with a port");
        Ok(FakeRank {
            socket,
            endpoint,
            port,
            dp_rank,
            next_seq: 0,
            history: History::default(),
        })
    }

    /// Every subscription reaches `wait_subscribed`, a repeated one too (the one a listener
    /// sends again when it reconnects, which the publisher may still count as held).
    pub fn report_every_subscription(&self) {
        self.socket.set_xpub_verbose(true).expect("XPUB_VERBOSE");
    }

    /// Waits (at most 15 s) for a listener's subscription to reach the publisher.
    pub fn wait_subscribed(&self) {
        let ready = self
            .socket
            .poll(zmq::POLLIN, SUBSCRIBE_DEADLINE.as_millis() as i64)
            .expect("poll XPUB");
        assert!(ready > 0, "no subscription reached {}", self.endpoint);
        let subscription = self.socket.recv_bytes(0).expect("subscription");
        assert_eq!(subscription.first(), Some(&1), "a subscribe message");
    }

    /// Publishes a batch and records it in the history; returns its seq.
    pub fn publish(&mut self, events: Vec<Event>) -> u64 {
        let (seq, payload) = self.record(events);
        self.send(message_frames(b"", seq, &payload));
        seq
    }

    /// A batch the listener never receives (lost by PUB/SUB) but that replay still knows.
    pub fn lose(&mut self, events: Vec<Event>) -> u64 {
        self.record(events).0
    }

    /// Publishes one batch storing `tokens.len() / 16` blocks with the given engine hashes.
    pub fn store(&mut self, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) {
        let stored = BlockStored::new(hashes.to_vec(), parent, tokens.to_vec(), BLOCK_SIZE);
        self.publish(vec![Event::Stored(stored)]);
    }

    /// Sends raw frames, outside the seq and the history.
    pub fn send(&self, frames: Vec<Vec<u8>>) {
        self.socket.send_multipart(frames, 0).expect("publish");
    }

    /// A new engine process: seq starts again from 0, history empty.
    pub fn restart(&mut self) {
        self.next_seq = 0;
        self.history.lock().clear();
    }

    /// The publisher's socket closed and bound again on the same port: its subscribers lose
    /// their connection and make a new one (wait for it with `wait_subscribed`). Its seq and
    /// history go on, as a link that broke; `restart` too for a new process.
    pub fn rebind(&mut self, zmq: &zmq::Context) {
        let started = std::time::Instant::now();
        let socket = loop {
            let socket = zmq.socket(zmq::XPUB).expect("XPUB");
            socket.set_linger(0).expect("LINGER");
            socket.set_sndhwm(0).expect("SNDHWM");
            // Closed first, so that the port is free to bind again.
            let old = std::mem::replace(&mut self.socket, socket);
            drop(old);
            match self.socket.bind(&self.endpoint) {
                Ok(()) => break None,
                Err(_) if started.elapsed() < SUBSCRIBE_DEADLINE => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(error) => break Some(error),
            }
        };
        if let Some(error) = socket {
            panic!("binding {} again: {error}", self.endpoint);
        }
    }

    fn record(&mut self, events: Vec<Event>) -> (u64, Arc<[u8]>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload: Arc<[u8]> = payload(self.dp_rank, events).into();
        self.history.lock().push((seq, Arc::clone(&payload)));
        (seq, payload)
    }
}

/// A KVEventBatch payload (map form) of `events` from `dp_rank`.
pub fn payload(dp_rank: u32, events: Vec<Event>) -> Vec<u8> {
    let batch = EventBatch {
        ts: 1.0,
        dp_rank: Some(dp_rank),
        events,
        skipped: 0,
    };
    encode_batch(&batch, Form::Map)
}

/// `blocks` consecutive blocks of a prompt whose tokens start at `first_token`.
pub fn prompt(first_token: u32, blocks: u32) -> Vec<u32> {
    (first_token..first_token + blocks * BLOCK_SIZE).collect()
}
