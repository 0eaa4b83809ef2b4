//! Storage tiers through the real decoder and index: stores and removals per medium, cumulative
//! `tiers` scores (with gaps), vLLM's offloading placeholders resolved through the GPU tier (and
//! unknown ones counted), clears per medium, and the wire form of a clear with a medium.

use kv_indexer::index::{ApplyOutcome, Index, PerTier, Score, WorkerBlocks, WorkerId};
use kv_indexer::wire::{decode_batch, BlockRemoved, BlockStored, Event, EventBatch};
use kv_indexer_sim::encode::{encode_batch, Form};

const BLOCK: u32 = 4;

/// Tokens of blocks `from..to` of the one prompt every test asks about.
fn tokens(from: u32, to: u32) -> Vec<u32> {
    (from * BLOCK..to * BLOCK).map(|t| 1000 + t).collect()
}

fn store(medium: &str, hashes: &[u64], parent: Option<u64>, first_block: u32) -> Event {
    let to = first_block + hashes.len() as u32;
    Event::Stored(BlockStored {
        medium: Some(medium.into()),
        ..BlockStored::new(hashes.to_vec(), parent, tokens(first_block, to), BLOCK)
    })
}

/// vLLM's offloading connector's announcement of blocks copied to `medium`: hashes only.
fn placeholder(medium: &str, hashes: &[u64]) -> Event {
    Event::Stored(BlockStored {
        medium: Some(medium.into()),
        ..BlockStored::new(hashes.to_vec(), None, Vec::new(), 0)
    })
}

fn remove(medium: Option<&str>, hashes: &[u64]) -> Event {
    Event::Removed(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: medium.map(str::to_owned),
        group_idx: None,
    })
}

fn clear(medium: Option<&str>) -> Event {
    Event::Cleared {
        medium: medium.map(str::to_owned),
    }
}

/// Encodes `events` as the engine would (both msgpack forms in turn), decodes them with the
/// real decoder and applies them to `worker`.
fn feed(worker: &mut WorkerBlocks, events: Vec<Event>) -> ApplyOutcome {
    let batch = EventBatch {
        ts: 1_752_000_000.5,
        dp_rank: Some(0),
        events,
        skipped: 0,
    };
    let mut outcome = ApplyOutcome::default();
    for (i, event) in batch.events.iter().enumerate() {
        let form = if i % 2 == 0 { Form::Map } else { Form::Array };
        let one = EventBatch {
            events: vec![event.clone()],
            ..batch.clone()
        };
        let decoded = decode_batch(&encode_batch(&one, form)).expect("the encoder's bytes decode");
        assert_eq!(decoded.events, one.events, "{form:?} round trip");
        worker.apply(&decoded.events[0], &mut outcome);
    }
    outcome
}

/// `(worker, matched_blocks, [gpu, cpu, disk])` of every listed rank, by worker.
fn scores(index: &Index, blocks: u32) -> Vec<(WorkerId, u32, [u32; 3])> {
    let mut scores: Vec<Score> = index.query(&tokens(0, blocks), None, &|_| true);
    scores.sort_by_key(|s| s.worker);
    scores
        .into_iter()
        .map(|s| {
            assert!(s.tiers.gpu <= s.tiers.cpu && s.tiers.cpu <= s.tiers.disk);
            assert_eq!(s.tiers.gpu, s.matched_blocks);
            (
                s.worker,
                s.matched_blocks,
                [s.tiers.gpu, s.tiers.cpu, s.tiers.disk],
            )
        })
        .collect()
}

#[test]
fn tiers_add_up_the_way_an_engine_loads_a_prefix() {
    let index = Index::new(BLOCK, 4);
    let mut w = index.add_worker();
    // GPU holds blocks 0-1, CPU blocks 2-4 (chained from the GPU's block 1), disk 5-6 (chained
    // from the CPU's block 4).
    feed(
        &mut w,
        vec![
            store("GPU", &[10, 11], None, 0),
            store("CPU", &[12, 13, 14], Some(11), 2),
            store("DISK", &[15, 16], Some(14), 5),
        ],
    );
    let id = w.id();
    assert_eq!(scores(&index, 8), vec![(id, 2, [2, 5, 7])]);
    assert_eq!(
        w.tier_blocks(),
        PerTier {
            gpu: 2,
            cpu: 3,
            disk: 2
        }
    );
    // A shorter prompt stops every tier at its end.
    assert_eq!(scores(&index, 3), vec![(id, 2, [2, 3, 3])]);
    // A gap in CPU at block 3: the CPU run stops there, and disk (which starts at block 5) adds
    // nothing, as an engine cannot load past a block it lacks.
    let outcome = feed(&mut w, vec![remove(Some("CPU"), &[13])]);
    assert_eq!((outcome.removed, outcome.removed_blocks), (1, 1));
    assert_eq!(scores(&index, 8), vec![(id, 2, [2, 3, 3])]);
    // A removal in one tier leaves the others: block 1 leaves GPU, the CPU run now starts at 1,
    // where CPU lacks it.
    feed(&mut w, vec![remove(Some("GPU"), &[11])]);
    assert_eq!(scores(&index, 8), vec![(id, 1, [1, 1, 1])]);
    // The disk tier holding a run right where GPU stops.
    feed(&mut w, vec![store("STORAGE", &[21, 22], Some(10), 1)]);
    assert_eq!(scores(&index, 8), vec![(id, 1, [1, 1, 3])]);
}

#[test]
fn a_rank_holding_the_first_block_in_a_lower_tier_only_is_listed() {
    let index = Index::new(BLOCK, 4);
    let mut gpu_rank = index.add_worker();
    let mut cpu_rank = index.add_worker();
    feed(&mut gpu_rank, vec![store("GPU", &[1, 2], None, 0)]);
    feed(
        &mut cpu_rank,
        vec![
            store("CPU_PINNED", &[7, 8, 9], None, 0),
            store("EXTERNAL", &[6], Some(9), 3),
        ],
    );
    assert_eq!(
        scores(&index, 8),
        vec![(gpu_rank.id(), 2, [2, 2, 2]), (cpu_rank.id(), 0, [0, 3, 4])]
    );
    // It is listed with the GPU blocks it holds (none).
    let listed = index.query(&tokens(0, 8), None, &|w| w == cpu_rank.id());
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].cached_blocks, 0);
    // The rank filter applies to it like to any rank.
    assert!(index
        .query(&tokens(0, 8), None, &|w| w != cpu_rank.id())
        .iter()
        .all(|s| s.worker == gpu_rank.id()));
}

#[test]
fn every_documented_medium_lands_in_its_tier_and_unknown_ones_are_counted() {
    for (medium, expected) in [
        ("GPU", [1, 1, 1]),
        ("CPU", [0, 1, 1]),
        ("CPU_PINNED", [0, 1, 1]),
        ("STORAGE", [0, 0, 1]),
        ("DISK", [0, 0, 1]),
        ("FS", [0, 0, 1]),
        ("OBJ", [0, 0, 1]),
        ("EXTERNAL", [0, 0, 1]),
    ] {
        let index = Index::new(BLOCK, 2);
        let mut w = index.add_worker();
        let outcome = feed(&mut w, vec![store(medium, &[5], None, 0)]);
        assert_eq!((outcome.stored, outcome.ignored_medium), (1, 0), "{medium}");
        assert_eq!(
            scores(&index, 2),
            vec![(w.id(), expected[0], expected)],
            "{medium}"
        );
        let outcome = feed(&mut w, vec![remove(Some(medium), &[5])]);
        assert_eq!(outcome.removed_blocks, 1, "{medium}");
        assert_eq!(scores(&index, 2), vec![], "{medium}");
        assert_eq!(index.key_count(), 0, "{medium}");
    }
    let index = Index::new(BLOCK, 2);
    let mut w = index.add_worker();
    let outcome = feed(
        &mut w,
        vec![
            store("NVME_OF", &[5], None, 0),
            remove(Some("NVME_OF"), &[5]),
            clear(Some("NVME_OF")),
        ],
    );
    assert_eq!((outcome.ignored_medium, outcome.stored), (3, 0));
    assert_eq!(scores(&index, 2), vec![]);
}

#[test]
fn offloading_placeholders_resolve_through_the_gpu_tier_and_unknown_hashes_are_counted() {
    let index = Index::new(BLOCK, 4);
    let mut w = index.add_worker();
    feed(&mut w, vec![store("GPU", &[1, 2, 3, 4], None, 0)]);
    // vLLM copies blocks 1-3 to CPU; hash 99 was never announced in GPU.
    let outcome = feed(&mut w, vec![placeholder("CPU", &[2, 3, 99, 4])]);
    assert_eq!(outcome.placeholder_unknown, 1);
    assert_eq!((outcome.stored, outcome.stored_blocks), (1, 3));
    assert_eq!(w.tier_blocks().cpu, 3);
    // GPU evicts blocks 2-3: the engine loads them back from CPU.
    feed(&mut w, vec![remove(None, &[4, 3, 2])]);
    assert_eq!(scores(&index, 4), vec![(w.id(), 1, [1, 4, 4])]);
    // CPU evicts block 3 although GPU no longer knows its hash: the CPU tier does.
    let outcome = feed(&mut w, vec![remove(Some("CPU"), &[4])]);
    assert_eq!((outcome.removed_blocks, outcome.unknown_block), (1, 0));
    assert_eq!(scores(&index, 4), vec![(w.id(), 1, [1, 3, 3])]);
    // A placeholder of a hash GPU has dropped cannot be resolved.
    let outcome = feed(&mut w, vec![placeholder("DISK", &[3])]);
    assert_eq!(outcome.placeholder_unknown, 1);
    assert_eq!(scores(&index, 4), vec![(w.id(), 1, [1, 3, 3])]);
    // A placeholder in disk of a hash GPU still has.
    feed(&mut w, vec![placeholder("STORAGE", &[1])]);
    assert_eq!(scores(&index, 4), vec![(w.id(), 1, [1, 3, 3])]);
    drop(w);
    assert_eq!(index.key_count(), 0);
}

#[test]
fn a_clear_with_a_medium_clears_that_tier_and_one_without_clears_gpu() {
    let index = Index::new(BLOCK, 4);
    let mut w = index.add_worker();
    let fill = vec![
        store("GPU", &[1, 2], None, 0),
        store("CPU", &[3], Some(2), 2),
        store("DISK", &[4], Some(3), 3),
    ];
    feed(&mut w, fill.clone());
    assert_eq!(scores(&index, 4), vec![(w.id(), 2, [2, 3, 4])]);
    let outcome = feed(&mut w, vec![clear(Some("CPU"))]);
    assert_eq!(outcome.cleared, 1);
    assert_eq!(scores(&index, 4), vec![(w.id(), 2, [2, 2, 2])]);
    assert_eq!(
        w.tier_blocks(),
        PerTier {
            gpu: 2,
            cpu: 0,
            disk: 1
        }
    );
    feed(&mut w, vec![store("CPU", &[3], Some(2), 2)]);
    // vLLM's clear after /reset_prefix_cache: GPU only.
    feed(&mut w, vec![clear(None)]);
    assert_eq!(
        w.tier_blocks(),
        PerTier {
            gpu: 0,
            cpu: 1,
            disk: 1
        }
    );
    assert_eq!(scores(&index, 4), vec![]);
    feed(&mut w, vec![clear(Some("STORAGE"))]);
    assert_eq!(
        w.tier_blocks(),
        PerTier {
            gpu: 0,
            cpu: 1,
            disk: 0
        }
    );
    // A publisher restart (or a snapshot) empties every tier.
    feed(&mut w, fill);
    w.clear();
    assert_eq!(w.tier_blocks(), PerTier::default());
    assert_eq!(index.key_count(), 0);
}

/// `["AllBlocksCleared", medium]` and `{"type": "AllBlocksCleared", "medium": ...}` as an
/// engine's msgpack writer lays them out, byte by byte.
#[test]
fn the_decoder_keeps_a_clears_medium() {
    let batch = |event: &[u8]| -> Vec<u8> {
        let mut bytes = vec![0x93, 0xcb];
        bytes.extend(1_752_000_000.5f64.to_be_bytes());
        bytes.push(0x91);
        bytes.extend(event);
        bytes.push(0x00);
        bytes
    };
    let text = |s: &str| -> Vec<u8> {
        let mut bytes = vec![0xa0 | s.len() as u8];
        bytes.extend(s.as_bytes());
        bytes
    };
    let array = [vec![0x92], text("AllBlocksCleared"), text("CPU")].concat();
    let map = [
        vec![0x82],
        text("type"),
        text("AllBlocksCleared"),
        text("medium"),
        text("DISK"),
    ]
    .concat();
    let nil_medium = [vec![0x92], text("AllBlocksCleared"), vec![0xc0]].concat();
    let bare = [vec![0x91], text("AllBlocksCleared")].concat();
    for (event, medium) in [
        (array, Some("CPU")),
        (map, Some("DISK")),
        (nil_medium, None),
        (bare, None),
    ] {
        let decoded = decode_batch(&batch(&event)).expect("decodes");
        assert_eq!(decoded.skipped, 0);
        assert_eq!(decoded.events, vec![clear(medium)]);
    }
    // A medium that is not a string is not a clear of anything: skipped, counted.
    let odd = [vec![0x92], text("AllBlocksCleared"), vec![0x07]].concat();
    let decoded = decode_batch(&batch(&odd)).expect("decodes");
    assert_eq!((decoded.events.len(), decoded.skipped), (0, 1));
}

mod end_to_end {
    use std::collections::HashMap;
    use std::time::Duration;

    use kv_indexer_sim::fleet::{Fleet, BLOCK_SIZE};
    use kv_indexer_sim::server::SimConfig;
    use kv_indexer_sim::watch::OverHttp;
    use kv_indexer_sim::workload::Route;
    use serde_json::Value;

    use crate::support::{free_port, settle, start_indexer, trace_prompts, warm_up};

    const REQUESTS: usize = 200;
    const DEADLINE: Duration = Duration::from_secs(20);

    fn json(mut reply: ureq::http::Response<ureq::Body>) -> Value {
        let text = reply.body_mut().read_to_string().expect("a body");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    }

    /// `(instance, dp_rank) → [gpu, cpu, disk]` of every listed rank of a `/query` reply.
    fn tiers_of(reply: &Value) -> HashMap<(String, u32), [u32; 3]> {
        let scores = reply["scores"].as_array().expect("scores");
        scores
            .iter()
            .map(|score| {
                let tier = |name: &str| score["tiers"][name].as_u64().expect("a tier") as u32;
                let key = (
                    score["instance"].as_str().expect("instance").to_owned(),
                    score["dp_rank"].as_u64().expect("dp_rank") as u32,
                );
                assert_eq!(
                    score["matched_blocks"].as_u64(),
                    Some(u64::from(tier("gpu")))
                );
                (key, [tier("gpu"), tier("cpu"), tier("disk")])
            })
            .collect()
    }

    /// Simulated vLLM ranks with small GPU caches that offload every evicted block to a CPU tier
    /// (itself evicting), announced as vLLM's offloading connector does, through ZMQ to the real
    /// binary; every prompt's `tiers` on `/query` equal each rank's ground truth per tier, the
    /// Dynamo API's `gpu`/`cpu`/`disk`/`dp` are the same in tokens, and `/workers` shows each
    /// tier's blocks.
    #[test]
    fn the_binary_scores_every_tier_as_the_offloading_engine_holds_it() {
        crate::support::logs::install_logger();
        let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS);
        let fleet = Fleet::start_on_consecutive_ports(1, |_| SimConfig {
            dp_size: 2,
            block_size: BLOCK_SIZE,
            capacity_blocks: 1_500,
            cpu_capacity_blocks: 3_000,
            seed: 0x71E5,
            ..SimConfig::default()
        })
        .expect("fleet");
        let dynamo = format!("127.0.0.1:{}", free_port());
        let toml = format!("dynamo_listen = \"{dynamo}\"\n{}", fleet.indexer_config());
        let process = start_indexer(&toml);
        let mut indexer = OverHttp::new(process.address);
        warm_up(&fleet, &mut indexer, DEADLINE);
        let mut router = fleet.router(Route::RoundRobin);
        fleet.serve_all(&mut router, &prompts).expect("serve");
        let views = settle(&fleet, &mut indexer, DEADLINE);
        assert!(views.iter().all(|v| v.state == "active"), "{views:#?}");

        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(DEADLINE))
            .build()
            .into();
        let base = format!("http://{}", process.address);
        let workers = json(
            agent
                .get(&format!("{base}/workers"))
                .call()
                .expect("/workers answers"),
        );
        let instance_id = workers[0]["instance_id"].to_string();
        let block = u64::from(BLOCK_SIZE);
        let (mut pairs, mut from_cpu) = (0, 0);
        for prompt in &prompts {
            let body = serde_json::json!({ "token_ids": prompt }).to_string();
            let reply = json(
                agent
                    .post(&format!("{base}/query"))
                    .send(&body)
                    .expect("/query answers"),
            );
            let listed = tiers_of(&reply);
            let body = serde_json::json!({ "token_ids": prompt, "model_name": "any" }).to_string();
            let dynamo = json(
                agent
                    .post(&format!("http://{dynamo}/query"))
                    .send(&body)
                    .expect("the Dynamo /query answers"),
            );
            let instance = &dynamo["instances"][&instance_id];
            let mut most = [0u64; 3];
            for at in fleet.ranks() {
                let truth = fleet
                    .engine(at)
                    .true_tiers(at.rank, prompt.as_slice())
                    .expect("rank");
                let key = (Fleet::name(at.engine), at.rank);
                let shown = listed.get(&key).copied().unwrap_or([0; 3]);
                assert_eq!(shown, truth, "rank {key:?}");
                for (most, tier) in most.iter_mut().zip(truth) {
                    *most = (*most).max(u64::from(tier) * block);
                }
                let loadable = instance["dp"][at.rank.to_string()].as_u64();
                let gpu_score = dynamo["scores"][&instance_id][at.rank.to_string()].as_u64();
                if truth[2] > 0 {
                    assert_eq!(loadable, Some(u64::from(truth[2]) * block), "{dynamo}");
                } else {
                    assert_eq!(loadable, None, "{dynamo}");
                }
                let expected_score = (truth[0] > 0).then(|| u64::from(truth[0]) * block);
                assert_eq!(gpu_score, expected_score, "{dynamo}");
                pairs += 1;
                from_cpu += u32::from(truth[1] > truth[0]);
            }
            if most[2] > 0 {
                let field = |name: &str| instance[name].as_u64().expect("a tier");
                let shown = [field("gpu"), field("cpu"), field("disk")];
                assert_eq!(shown, most, "{dynamo}");
                assert_eq!(field("longest_matched"), most[2]);
            } else {
                assert!(instance.is_null(), "{dynamo}");
            }
        }
        assert_eq!(pairs, REQUESTS * 2);
        assert!(
            from_cpu > 0,
            "no prompt found blocks in CPU: the test tests nothing"
        );

        let workers = json(
            agent
                .get(&format!("{base}/workers"))
                .call()
                .expect("/workers answers"),
        );
        for at in fleet.ranks() {
            let engine = fleet.engine(at);
            let listener = &workers[0]["listeners"][at.rank as usize];
            let cpu = engine.cpu_blocks(at.rank).expect("rank");
            assert!(cpu > 1_500, "rank {at:?} offloaded little: {cpu} blocks");
            assert_eq!(
                listener["tier_blocks"]["cpu"].as_u64(),
                Some(cpu as u64),
                "{listener}"
            );
            assert_eq!(
                listener["tier_blocks"]["gpu"].as_u64(),
                Some(engine.cached_blocks(at.rank).expect("rank") as u64)
            );
            assert_eq!(listener["tier_blocks"]["disk"].as_u64(), Some(0));
        }
    }
}
