//! Hybrid attention against real vLLM 0.33 prefix caches (`tests/data/hybrid-window.json`, a
//! copy of the shared vectors): two ranks with a full-attention group and a sliding-window group
//! of 32 and 64 tokens publish batch by batch; each batch's real payload goes through the real
//! decoder into its rank's writer, and at each probe every rank's `matched_blocks` must be the
//! hit vLLM's own `HybridKVCacheCoordinator` computed (`truth`), not what group 0 alone says.

use std::collections::HashMap;

use kv_indexer::index::{ApplyOutcome, Index, WorkerBlocks};
use kv_indexer::wire::decode_batch;
use serde_json::Value;

fn vectors() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/hybrid-window.json"
    ))
    .expect("tests/data/hybrid-window.json is readable");
    serde_json::from_str(&text).expect("hybrid-window.json is JSON")
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).expect("hex digit pair"))
        .collect()
}

fn tokens(probe: &Value) -> Vec<u32> {
    probe["probe"]
        .as_array()
        .expect("probe tokens")
        .iter()
        .map(|t| t.as_u64().expect("a token") as u32)
        .collect()
}

/// Every probe of the vectors, with each rank's truth beside what the index answers.
struct Replay {
    probes: usize,
    /// (probe, rank, truth, answer) where the answer differs.
    wrong: Vec<(usize, String, u32, u32)>,
    /// Probes where vLLM's hit is shorter than group 0's: the ones the window rule decides.
    window_decided: usize,
    outcomes: HashMap<String, ApplyOutcome>,
}

fn replay(vectors: &Value) -> Replay {
    let block_size = vectors["block_size"].as_u64().expect("block_size") as u32;
    let index = Index::new(block_size, 4);
    let names: Vec<String> = vectors["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|rank| rank["name"].as_str().expect("rank name").to_owned())
        .collect();
    let mut ranks: HashMap<String, WorkerBlocks> = names
        .iter()
        .map(|name| (name.clone(), index.add_worker()))
        .collect();
    let mut outcomes: HashMap<String, ApplyOutcome> = HashMap::new();
    let mut next_seq: HashMap<String, u64> = HashMap::new();
    let mut result = Replay {
        probes: 0,
        wrong: Vec::new(),
        window_decided: 0,
        outcomes: HashMap::new(),
    };
    for step in vectors["steps"].as_array().expect("steps") {
        if let Some(payload) = step["payload_hex"].as_str() {
            let name = step["rank"].as_str().expect("step rank");
            let seq = step["seq"].as_u64().expect("seq");
            let expected = next_seq.entry(name.to_owned()).or_default();
            assert_eq!(
                seq, *expected,
                "rank {name}: batches in order, none missing"
            );
            *expected += 1;
            let batch = decode_batch(&hex(payload)).expect("a real payload decodes");
            assert_eq!(batch.skipped, 0, "rank {name} seq {seq}");
            let worker = ranks.get_mut(name).expect("a known rank");
            let outcome = outcomes.entry(name.to_owned()).or_default();
            for event in &batch.events {
                worker.apply(event, outcome);
            }
            continue;
        }
        let prompt = tokens(step);
        for name in &names {
            let truth = step["truth"][name.as_str()].as_u64().expect("truth") as u32;
            let group_0 = step["full_attention_only"][name.as_str()]
                .as_u64()
                .expect("full_attention_only") as u32;
            let id = ranks[name].id();
            let answer = index
                .query(&prompt, None, &|w| w == id)
                .first()
                .map_or(0, |score| score.matched_blocks);
            if truth != answer {
                result
                    .wrong
                    .push((result.probes, name.clone(), truth, answer));
            }
            if truth != group_0 {
                result.window_decided += 1;
            }
        }
        result.probes += 1;
    }
    result.outcomes = outcomes;
    result
}

#[test]
fn every_probe_gets_the_hit_vllm_computes() {
    let vectors = vectors();
    let replay = replay(&vectors);
    assert_eq!(replay.probes, 602);
    assert_eq!(replay.window_decided, 44, "the vectors' own count");
    assert!(
        replay.wrong.is_empty(),
        "{} of {} rank answers differ from vLLM's, first ones (probe, rank, truth, answer): {:?}",
        replay.wrong.len(),
        replay.probes * 2,
        &replay.wrong[..replay.wrong.len().min(10)]
    );
    for (name, outcome) in &replay.outcomes {
        assert_eq!(
            (
                outcome.parent_missing,
                outcome.unknown_block,
                outcome.invalid_event,
                outcome.ignored_group
            ),
            (0, 0, 0, 0),
            "rank {name}: every event of every group applies"
        );
    }
}
