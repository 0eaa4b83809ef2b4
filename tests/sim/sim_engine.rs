//! The simulated engine over real sockets on 127.0.0.1: live PUB stream, replay ROUTER,
//! `/kv_recover` snapshots, ground truth, dropped batches and restarts.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::http_client::Connection;
use kv_indexer::wire::{
    decode_batch, decode_snapshot, parse_message, parse_replay_reply, BlockStored, Event,
    EventBatch, ReplayItem,
};
use kv_indexer_sim::encode::Form;
use kv_indexer_sim::server::{SimConfig, SimEngine};
use xxhash_rust::xxh3::xxh3_64;

const BLOCK: u32 = 4;
const DEADLINE: Duration = Duration::from_secs(10);

fn config(dp_size: u32) -> SimConfig {
    SimConfig {
        dp_size,
        block_size: BLOCK,
        capacity_blocks: 1_000,
        seed: 11,
        ..SimConfig::default()
    }
}

/// `blocks` full blocks distinct per `tag`, plus 2 trailing tokens.
fn prompt(tag: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK + 2).map(|i| tag * 100_000 + i).collect()
}

fn subscribe(context: &zmq::Context, port: u16) -> zmq::Socket {
    let socket = context.socket(zmq::SUB).expect("SUB socket");
    socket.set_linger(0).expect("linger");
    socket.set_subscribe(b"").expect("subscribe");
    socket
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .expect("connect");
    socket
}

fn recv_frames(socket: &zmq::Socket, timeout: Duration) -> Option<Vec<Vec<u8>>> {
    let ready = socket
        .poll(zmq::POLLIN, timeout.as_millis() as i64)
        .expect("poll");
    (ready > 0).then(|| socket.recv_multipart(0).expect("recv"))
}

/// Serves fresh prompts on `rank` until the subscriber receives one (the slow-joiner window),
/// then drains what is in flight; returns the last seq received.
fn warm_up(engine: &SimEngine, rank: u32, sub: &zmq::Socket) -> u64 {
    let started = Instant::now();
    let mut tag = 9_000;
    let mut last = loop {
        assert!(started.elapsed() < DEADLINE, "no message on rank {rank}");
        tag += 1;
        engine.serve(rank, &prompt(tag, 1)).expect("serve");
        if let Some(frames) = recv_frames(sub, Duration::from_millis(100)) {
            break parse_message(&frames).expect("message").seq;
        }
    };
    let published = engine.last_seq(rank).expect("rank").expect("published");
    while last < published {
        let frames = recv_frames(sub, DEADLINE).expect("in-flight warm-up message");
        last = parse_message(&frames).expect("message").seq;
    }
    last
}

/// The next `count` live messages as (seq, batch).
fn receive(sub: &zmq::Socket, count: usize) -> Vec<(u64, EventBatch)> {
    (0..count)
        .map(|_| {
            let frames = recv_frames(sub, DEADLINE).expect("a live message");
            let message = parse_message(&frames).expect("3 frames, 8-byte seq");
            (message.seq, decode_batch(message.payload).expect("payload"))
        })
        .collect()
}

fn single_store(batch: &EventBatch) -> &BlockStored {
    match batch.events.as_slice() {
        [Event::Stored(stored)] => stored,
        other => panic!("expected one store, got {other:?}"),
    }
}

/// Asks the replay socket for everything from `start`; returns (frames after the delimiter, seq)
/// of each batch, having seen the end marker.
fn replay(context: &zmq::Context, port: u16, start: u64) -> Vec<(usize, u64, EventBatch)> {
    let dealer = context.socket(zmq::DEALER).expect("DEALER");
    dealer.set_linger(0).expect("linger");
    dealer
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .expect("connect");
    dealer
        .send_multipart([Vec::new(), start.to_be_bytes().to_vec()], 0)
        .expect("request");
    let mut batches = Vec::new();
    loop {
        let frames = recv_frames(&dealer, DEADLINE).expect("a replay reply");
        match parse_replay_reply(&frames).expect("replay reply") {
            ReplayItem::Batch(message) => batches.push((
                frames.len() - 1,
                message.seq,
                decode_batch(message.payload).expect("payload"),
            )),
            ReplayItem::End => return batches,
        }
    }
}

/// One HTTP exchange with a rank's server on 127.0.0.1: (status, body).
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, Vec<u8>) {
    let reply = Connection::open(SocketAddr::from(([127, 0, 0, 1], port))).send(
        method,
        path,
        Some(body.as_bytes()),
    );
    (reply.status, reply.body)
}

fn prefix_hit_over_http(port: u16, tokens: &[u32]) -> u32 {
    let (status, body) = http(
        port,
        "POST",
        "/prefix_hit",
        &serde_json::json!({ "token_ids": tokens }).to_string(),
    );
    assert_eq!(status, 200);
    let value: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    value["matched_blocks"].as_u64().expect("matched_blocks") as u32
}

#[test]
fn every_rank_publishes_consecutive_decodable_batches_on_its_own_port() {
    let engine = SimEngine::start(config(2)).expect("start");
    let context = zmq::Context::new();
    let ports = engine.ports().to_vec();
    assert_eq!(ports.len(), 2);
    let mut hashes_per_rank = Vec::new();
    for rank in 0..2u32 {
        let sub = subscribe(&context, ports[rank as usize].publish);
        let last = warm_up(&engine, rank, &sub);
        let prompts: Vec<Vec<u32>> = (1..=20).map(|tag| prompt(tag, 3)).collect();
        for p in &prompts {
            assert_eq!(engine.serve(rank, p).expect("serve"), 0);
        }
        let received = receive(&sub, prompts.len());
        let seqs: Vec<u64> = received.iter().map(|(seq, _)| *seq).collect();
        assert_eq!(seqs, (last + 1..=last + 20).collect::<Vec<_>>());
        let mut hashes = Vec::new();
        for ((_, batch), p) in received.iter().zip(&prompts) {
            assert_eq!(batch.dp_rank, Some(rank));
            let stored = single_store(batch);
            assert_eq!(stored.parent, None);
            assert_eq!(stored.token_ids, p[..3 * BLOCK as usize].to_vec());
            assert_eq!(stored.block_hashes.len(), 3);
            assert_eq!(stored.block_size, BLOCK);
            hashes.extend(stored.block_hashes.iter().copied());
        }
        hashes_per_rank.push(hashes);
    }
    // Same prompts, different ranks: different engine hashes (per-process seeds).
    let rank0: HashSet<u64> = hashes_per_rank[0].iter().copied().collect();
    assert!(hashes_per_rank[1].iter().all(|h| !rank0.contains(h)));
    engine.stop();
}

#[test]
fn array_form_carries_the_same_events_as_map_form() {
    let context = zmq::Context::new();
    let mut decoded = Vec::new();
    for form in [Form::Map, Form::Array] {
        let engine = SimEngine::start(SimConfig {
            form,
            capacity_blocks: 4,
            ..config(1)
        })
        .expect("start");
        let sub = subscribe(&context, engine.ports()[0].publish);
        warm_up(&engine, 0, &sub);
        // How many warm-up batches it took varies: start both engines from an empty cache.
        engine.reset_prefix_cache(0).expect("reset");
        engine.serve(0, &prompt(1, 3)).expect("serve");
        // Evicts a's last block: a removal, then a store.
        engine.serve(0, &prompt(2, 2)).expect("serve");
        decoded.push(
            receive(&sub, 3)
                .into_iter()
                .map(|(_, batch)| batch.events)
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(decoded[0][0], [Event::Cleared { medium: None }]);
    let removals = decoded[0][2]
        .iter()
        .filter(|e| matches!(e, Event::Removed(_)))
        .count();
    assert_eq!(removals, 1);
    assert_eq!(decoded[0], decoded[1]);
}

#[test]
fn replay_returns_contiguous_history_from_the_start_seq_then_the_end_marker() {
    let context = zmq::Context::new();
    for old_layout in [false, true] {
        let engine = SimEngine::start(SimConfig {
            old_replay_layout: old_layout,
            replay_buffer: 8,
            ..config(1)
        })
        .expect("start");
        let replay_port = engine.ports()[0].replay.expect("replay port");
        assert!(replay(&context, replay_port, 0).is_empty(), "nothing yet");
        let prompts: Vec<Vec<u32>> = (1..=12).map(|tag| prompt(tag, 2)).collect();
        for p in &prompts {
            engine.serve(0, p).expect("serve");
        }
        let frames_per_batch = if old_layout { 2 } else { 3 };
        let from_six = replay(&context, replay_port, 6);
        assert_eq!(
            from_six.iter().map(|(_, seq, _)| *seq).collect::<Vec<_>>(),
            (6..12).collect::<Vec<_>>()
        );
        for (frames, seq, batch) in &from_six {
            assert_eq!(*frames, frames_per_batch);
            assert_eq!(
                single_store(batch).token_ids,
                prompts[*seq as usize][..2 * BLOCK as usize].to_vec()
            );
        }
        // The buffer keeps the last 8: an older start gets what is left, from seq 4.
        let from_zero: Vec<u64> = replay(&context, replay_port, 0)
            .iter()
            .map(|(_, seq, _)| *seq)
            .collect();
        assert_eq!(from_zero, (4..12).collect::<Vec<_>>());
        assert!(replay(&context, replay_port, 12).is_empty());
    }
}

/// A content key per block: the block's tokens chained over its parent's key.
fn content_key(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = parent.unwrap_or(u64::MAX).to_le_bytes().to_vec();
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    xxh3_64(&bytes)
}

fn matched_blocks(keys: &HashSet<u64>, tokens: &[u32]) -> u32 {
    let mut parent = None;
    let mut matched = 0;
    for block in tokens.chunks_exact(BLOCK as usize) {
        let key = content_key(parent, block);
        if !keys.contains(&key) {
            break;
        }
        parent = Some(key);
        matched += 1;
    }
    matched
}

#[test]
fn kv_recover_snapshot_holds_exactly_the_cached_blocks() {
    let engine = SimEngine::start(SimConfig {
        capacity_blocks: 30,
        ..config(2)
    })
    .expect("start");
    let recover = engine.ports()[1].recover.expect("recover port");
    let (status, body) = http(recover, "GET", "/kv_recover", "");
    assert_eq!(status, 200);
    let empty = decode_snapshot(&body).expect("snapshot");
    assert_eq!(
        (empty.seq, empty.dp_rank, empty.events.len()),
        (None, Some(1), 0)
    );

    // Shared heads, branches and evictions.
    let mut prompts = Vec::new();
    for turn in 0..40u32 {
        let mut p = prompt(turn % 3, 4);
        p.truncate(4 * BLOCK as usize);
        p.extend(prompt(100 + turn % 7, 1 + turn % 4));
        engine.serve(1, &p).expect("serve");
        prompts.push(p);
    }
    let (status, body) = http(recover, "GET", "/kv_recover", "");
    assert_eq!(status, 200);
    let snapshot = decode_snapshot(&body).expect("snapshot");
    assert_eq!(snapshot.seq, engine.last_seq(1).expect("rank"));
    assert_eq!((snapshot.dp_rank, snapshot.block_size), (Some(1), BLOCK));
    assert_eq!(snapshot.events, engine.snapshot_events(1).expect("rank"));

    // Replay the snapshot into a fresh model: parents first, every cached block once.
    let mut key_of: HashMap<u64, u64> = HashMap::new();
    for event in &snapshot.events {
        let mut parent = event
            .parent
            .map(|p| *key_of.get(&p).expect("parent listed first"));
        for (hash, tokens) in event
            .block_hashes
            .iter()
            .zip(event.token_ids.chunks_exact(BLOCK as usize))
        {
            let key = content_key(parent, tokens);
            assert!(key_of.insert(*hash, key).is_none(), "block listed once");
            parent = Some(key);
        }
    }
    assert_eq!(key_of.len(), engine.cached_blocks(1).expect("rank"));
    let keys: HashSet<u64> = key_of.values().copied().collect();
    let mut some_hit = false;
    for p in &prompts {
        let truth = engine.true_prefix_hit(1, p).expect("rank");
        assert_eq!(matched_blocks(&keys, p), truth);
        assert_eq!(prefix_hit_over_http(recover, p), truth);
        some_hit |= truth > 0;
    }
    assert!(some_hit);
}

#[test]
fn prefix_hit_endpoint_answers_ground_truth_and_rejects_bad_requests() {
    let engine = SimEngine::start(config(1)).expect("start");
    let port = engine.ports()[0].recover.expect("recover port");
    let p = prompt(1, 5);
    assert_eq!(prefix_hit_over_http(port, &p), 0);
    let mut head = p.clone();
    head.truncate(3 * BLOCK as usize + 1);
    engine.serve(0, &head).expect("serve");
    assert_eq!(prefix_hit_over_http(port, &p), 3);
    assert_eq!(prefix_hit_over_http(port, &[]), 0);
    let (status, last) = http(port, "GET", "/last_prompt", "");
    assert_eq!(status, 200);
    let last: serde_json::Value = serde_json::from_slice(&last).expect("JSON");
    assert_eq!(last, serde_json::json!({ "token_ids": head }));
    for (method, path, body, status) in [
        ("POST", "/prefix_hit", "{\"token_ids\": [1, -2]}", 400),
        ("POST", "/prefix_hit", "{\"token_ids\": [4294967296]}", 400),
        ("POST", "/prefix_hit", "not json", 400),
        ("GET", "/prefix_hit", "", 405),
        ("POST", "/kv_recover", "", 405),
        ("POST", "/last_prompt", "", 405),
        ("GET", "/nowhere", "", 404),
    ] {
        let (got, reply) = http(port, method, path, body);
        assert_eq!(got, status, "{method} {path} {body}");
        let error: serde_json::Value = serde_json::from_slice(&reply).expect("JSON error");
        assert!(error["error"].is_string());
    }
    assert!(engine.serve(3, &p).is_err(), "rank out of range");
}

#[test]
fn ground_truth_follows_serves_without_publishing_anything_else() {
    let engine = SimEngine::start(SimConfig {
        replay_port: None,
        recover_port: None,
        ..config(1)
    })
    .expect("start");
    assert_eq!(engine.ports()[0].replay, None);
    let p = prompt(1, 5);
    let mut head = p.clone();
    head.truncate(3 * BLOCK as usize + 1);
    assert_eq!(engine.serve(0, &head).expect("serve"), 0);
    assert_eq!(engine.true_prefix_hit(0, &p).expect("rank"), 3);
    assert_eq!(engine.serve(0, &p).expect("serve"), 3);
    assert_eq!(engine.serve(0, &p).expect("serve"), 5);
    // The third serve changed nothing, so it published nothing.
    assert_eq!(engine.last_seq(0).expect("rank"), Some(1));
}

#[test]
fn dropped_batches_are_gaps_on_the_live_stream_but_in_the_replay_history() {
    let engine = SimEngine::start(SimConfig {
        drop_fraction: 0.3,
        ..config(1)
    })
    .expect("start");
    let context = zmq::Context::new();
    let sub = subscribe(&context, engine.ports()[0].publish);
    let warm_last = warm_up(&engine, 0, &sub);
    let first = engine.last_seq(0).expect("rank").expect("published") + 1;
    let dropped_before = engine.dropped_batches(0).expect("rank");
    for tag in 1..=60 {
        engine.serve(0, &prompt(tag, 2)).expect("serve");
    }
    let dropped = engine.dropped_batches(0).expect("rank") - dropped_before;
    assert!(dropped > 0 && dropped < 60, "{dropped} of 60 dropped");
    let live: Vec<u64> = receive(&sub, 60 - dropped as usize)
        .iter()
        .map(|(seq, _)| *seq)
        .collect();
    assert!(warm_last < first);
    assert!(live.windows(2).all(|w| w[0] < w[1]));
    assert!(live.iter().all(|&seq| seq >= first && seq < first + 60));
    assert!(live.windows(2).any(|w| w[1] > w[0] + 1), "a gap is visible");
    let replayed: Vec<u64> = replay(&context, engine.ports()[0].replay.expect("replay"), first)
        .iter()
        .map(|(_, seq, _)| *seq)
        .collect();
    assert_eq!(replayed, (first..first + 60).collect::<Vec<_>>());
}

#[test]
fn restart_rank_starts_seq_again_at_zero_with_an_empty_cache_and_new_hashes() {
    let engine = SimEngine::start(config(2)).expect("start");
    let context = zmq::Context::new();
    let ports = engine.ports().to_vec();
    let sub = subscribe(&context, ports[1].publish);
    warm_up(&engine, 1, &sub);
    let p = prompt(1, 3);
    engine.serve(1, &p).expect("serve");
    engine.serve(0, &p).expect("serve");
    let (_, before) = receive(&sub, 1).remove(0);
    assert!(engine.last_seq(1).expect("rank") > Some(0));

    engine.restart_rank(1).expect("restart");
    assert_eq!(engine.last_seq(1).expect("rank"), None);
    assert_eq!(engine.true_prefix_hit(1, &p).expect("rank"), 0);
    assert_eq!(
        engine.true_prefix_hit(0, &p).expect("rank"),
        3,
        "rank 0 untouched"
    );
    assert_eq!(engine.serve(1, &p).expect("serve"), 0);
    let (seq, after) = receive(&sub, 1).remove(0);
    assert_eq!(seq, 0);
    assert_eq!(
        single_store(&after).token_ids,
        single_store(&before).token_ids
    );
    assert_ne!(
        single_store(&after).block_hashes,
        single_store(&before).block_hashes,
        "a new process hashes with a new seed"
    );
    let replayed: Vec<u64> = replay(&context, ports[1].replay.expect("replay"), 0)
        .iter()
        .map(|(_, seq, _)| *seq)
        .collect();
    assert_eq!(replayed, [0]);
    let (_, body) = http(ports[1].recover.expect("recover"), "GET", "/kv_recover", "");
    assert_eq!(decode_snapshot(&body).expect("snapshot").seq, Some(0));

    // A prefix-cache reset publishes AllBlocksCleared on the next seq.
    engine.reset_prefix_cache(1).expect("reset");
    let (seq, cleared) = receive(&sub, 1).remove(0);
    assert_eq!(
        (seq, cleared.events),
        (1, vec![Event::Cleared { medium: None }])
    );
    assert_eq!(engine.cached_blocks(1).expect("rank"), 0);
}

#[test]
fn start_rejects_bad_configurations_and_busy_ports() {
    for bad in [
        SimConfig {
            dp_size: 0,
            ..config(1)
        },
        SimConfig {
            block_size: 0,
            ..config(1)
        },
        SimConfig {
            drop_fraction: 1.5,
            ..config(1)
        },
        SimConfig {
            port: 65535,
            ..config(2)
        },
    ] {
        assert!(SimEngine::start(bad).is_err());
    }
    let engine = SimEngine::start(config(1)).expect("start");
    let taken = engine.ports()[0].publish;
    let error = SimEngine::start(SimConfig {
        port: taken,
        ..config(1)
    })
    .err()
    .expect("port in use");
    assert!(format!("{error:#}").contains("rank 0"), "{error:#}");
}

/// Waits until `rank`'s subscriber count is `wanted`, or fails.
fn wait_subscribers(engine: &SimEngine, rank: u32, wanted: usize) {
    let started = Instant::now();
    while engine.subscribers(rank).expect("rank") != wanted {
        assert!(started.elapsed() < DEADLINE, "never {wanted} subscribers");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_rank_counts_its_handshaken_subscribers_and_a_subscribed_one_gets_the_first_batch() {
    let engine = SimEngine::start(config(2)).expect("engine");
    let context = zmq::Context::new();
    assert_eq!(engine.subscribers(0).expect("rank 0"), 0);
    let first = subscribe(&context, engine.ports()[0].publish);
    wait_subscribers(&engine, 0, 1);
    // The condition replaces a sleep: the very first batch, sent now, is not lost.
    engine.serve(0, &prompt(1, 2)).expect("serve");
    let frames = recv_frames(&first, DEADLINE).expect("the first batch");
    assert_eq!(parse_message(&frames).expect("a KV-event message").seq, 0);
    let second = subscribe(&context, engine.ports()[0].publish);
    wait_subscribers(&engine, 0, 2);
    assert_eq!(engine.subscribers(1).expect("rank 1"), 0, "another rank's");
    drop(first);
    drop(second);
    wait_subscribers(&engine, 0, 0);
}
