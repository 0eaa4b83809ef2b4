//! One simulated engine rank for the integration tests: an XPUB socket (a PUB that also sees
//! subscriptions, so a test knows the indexer is listening before it publishes) speaking the
//! real protocol through `sim::encode`.

#![allow(dead_code)] // Each test binary uses its own subset.

use kv_indexer::sim::encode::{encode_batch, message_frames, Form};
use kv_indexer::wire::{BlockStored, Event, EventBatch};

pub const BLOCK_SIZE: u32 = 16;

pub struct FakeRank {
    socket: zmq::Socket,
    pub port: u16,
    dp_rank: u32,
    next_seq: u64,
}

impl FakeRank {
    /// Binds on a port the OS picks.
    pub fn bind(zmq: &zmq::Context, dp_rank: u32) -> FakeRank {
        let socket = zmq.socket(zmq::XPUB).expect("XPUB socket");
        socket.set_rcvtimeo(10_000).expect("rcvtimeo");
        // Never drop a batch for a slow subscriber: tests count on every block arriving.
        socket.set_sndhwm(0).expect("sndhwm");
        socket.bind("tcp://127.0.0.1:*").expect("bind XPUB");
        let endpoint = socket
            .get_last_endpoint()
            .expect("last endpoint")
            .expect("utf-8 endpoint");
        let port = endpoint
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port in endpoint");
        FakeRank {
            socket,
            port,
            dp_rank,
            next_seq: 0,
        }
    }

    /// Binds on `port`, or `None` when it is taken.
    pub fn bind_at(zmq: &zmq::Context, port: u16, dp_rank: u32) -> Option<FakeRank> {
        let socket = zmq.socket(zmq::XPUB).expect("XPUB socket");
        socket.set_rcvtimeo(10_000).expect("rcvtimeo");
        // Never drop a batch for a slow subscriber: tests count on every block arriving.
        socket.set_sndhwm(0).expect("sndhwm");
        socket.bind(&format!("tcp://127.0.0.1:{port}")).ok()?;
        Some(FakeRank {
            socket,
            port,
            dp_rank,
            next_seq: 0,
        })
    }

    /// Blocks (at most 10 s) until a subscriber has subscribed.
    pub fn wait_subscribed(&self) {
        let message = self
            .socket
            .recv_bytes(0)
            .expect("a subscription within 10 s");
        assert_eq!(message.first(), Some(&1), "subscribe message");
    }

    /// Publishes one batch storing `tokens.len() / 16` blocks with the given engine hashes.
    pub fn store(&mut self, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) {
        let batch = EventBatch {
            ts: 0.0,
            dp_rank: Some(self.dp_rank),
            events: vec![Event::Stored(BlockStored {
                block_hashes: hashes.to_vec(),
                parent,
                token_ids: tokens.to_vec(),
                block_size: BLOCK_SIZE,
                lora_name: None,
                medium: None,
                group_idx: None,
                extras: Vec::new(),
            })],
            skipped: 0,
        };
        let payload = encode_batch(&batch, Form::Map);
        let frames = message_frames(b"", self.next_seq, &payload);
        self.socket.send_multipart(frames, 0).expect("publish");
        self.next_seq += 1;
    }
}

/// `blocks` consecutive blocks of a prompt whose tokens start at `first_token`.
pub fn prompt(first_token: u32, blocks: u32) -> Vec<u32> {
    (first_token..first_token + blocks * BLOCK_SIZE).collect()
}
