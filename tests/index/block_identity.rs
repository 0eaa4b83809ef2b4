//! Block identity against real vLLM 0.33 prefix caches (`tests/data/block-identity.json`, a copy
//! of the shared vectors): each case's payloads go through the real decoder into the index, and
//! each probe's `/query` body, parsed as the HTTP route parses it, must match exactly the blocks
//! the rank truly holds. Then a mixed fleet, and the key function's known answers.

use std::time::{Duration, Instant};

use kv_indexer::api::parse_query;
use kv_indexer::index::{prompt_keys, ApplyOutcome, Index, MmFeature, Prompt, WorkerBlocks};
use kv_indexer::wire::decode_batch;
use kv_indexer_sim::cache::Request;
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::{SimConfig, SimEngine};
use serde_json::Value;

fn vectors() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/block-identity.json"
    ))
    .expect("tests/data/block-identity.json is readable");
    serde_json::from_str(&text).expect("block-identity.json is JSON")
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).expect("hex digit pair"))
        .collect()
}

/// Applies every run of `case` (its real payloads) to `worker`.
fn apply_runs(case: &Value, worker: &mut WorkerBlocks) -> ApplyOutcome {
    apply_runs_from(case, 0, worker)
}

/// Applies the runs of `case` from the `first` on: a rank that joined the engine after the
/// runs before it (`partial`), their events never seen.
fn apply_runs_from(case: &Value, first: usize, worker: &mut WorkerBlocks) -> ApplyOutcome {
    let mut outcome = ApplyOutcome::default();
    for run in case["runs"].as_array().expect("runs").iter().skip(first) {
        let payload = hex(run["payload_hex"].as_str().expect("payload_hex"));
        let batch = decode_batch(&payload).expect("a real payload decodes");
        assert_eq!(batch.skipped, 0, "case {}", case["name"]);
        for event in &batch.events {
            worker.apply(event, &mut outcome);
        }
    }
    outcome
}

/// The blocks of the probe's prompt that `worker` holds, as `/query` scores them.
fn matched(index: &Index, worker: u32, query: &Value) -> u32 {
    let body = query.to_string();
    let request = parse_query(body.as_bytes()).expect("the probe's body parses");
    index
        .query_prompt(&request.prompt(), &|w| w == worker)
        .first()
        .map_or(0, |score| score.matched_blocks)
}

#[test]
fn every_probe_matches_what_the_rank_truly_holds() {
    let vectors = vectors();
    let block_size = vectors["block_size"].as_u64().expect("block_size") as u32;
    let cases = vectors["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 5);
    let mut probes = 0;
    for case in cases {
        let index = Index::new(block_size, 4);
        let mut worker = index.add_worker();
        let outcome = apply_runs(case, &mut worker);
        assert_eq!(
            (
                outcome.parent_missing,
                outcome.unknown_block,
                outcome.invalid_event
            ),
            (0, 0, 0),
            "case {}",
            case["name"]
        );
        for probe in case["probes"].as_array().expect("probes") {
            let holds = probe["holds"].as_u64().expect("holds") as u32;
            assert_eq!(
                matched(&index, worker.id(), &probe["query"]),
                holds,
                "case {}: probe {}",
                case["name"],
                probe["query"]
            );
            probes += 1;
        }
    }
    assert_eq!(probes, 17);
}

/// A rank that joined after any number of the engine's runs (their events lost: `partial`)
/// scores every probe at most what the engine's own prefix cache holds: misses, never a false
/// hit, whatever the block identity (salt, multimodal, LoRA, lookahead, second copies).
#[test]
fn a_rank_joining_mid_stream_never_scores_more_than_vllm_holds() {
    let vectors = vectors();
    let block_size = vectors["block_size"].as_u64().expect("block_size") as u32;
    let (mut checked, mut missed) = (0, 0);
    for case in vectors["cases"].as_array().expect("cases") {
        let runs = case["runs"].as_array().expect("runs").len();
        for joined_after in 0..=runs {
            let index = Index::new(block_size, 4);
            let mut worker = index.add_worker();
            apply_runs_from(case, joined_after, &mut worker);
            for probe in case["probes"].as_array().expect("probes") {
                let holds = probe["holds"].as_u64().expect("holds") as u32;
                let scored = matched(&index, worker.id(), &probe["query"]);
                assert!(
                    scored <= holds,
                    "case {} joined after {joined_after} runs: probe {} scored {scored}, vLLM \
                     holds {holds}",
                    case["name"],
                    probe["query"]
                );
                checked += 1;
                missed += u32::from(scored < holds);
            }
        }
    }
    assert!(
        checked > 17 && missed > 0,
        "{checked} probes, {missed} missed"
    );
}

/// One rank hashing a lookahead token, one not, the same prompt cached on both: each is scored
/// with the keys its own engine computes.
#[test]
fn a_mixed_fleet_is_scored_per_engine() {
    let vectors = vectors();
    let case = |name: &str| {
        vectors["cases"]
            .as_array()
            .and_then(|cases| cases.iter().find(|c| c["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("no case {name}"))
    };
    let index = Index::new(4, 4);
    let mut speculative = index.add_worker();
    let mut plain = index.add_worker();
    apply_runs(&case("lookahead_1"), &mut speculative);
    apply_runs(&case("cache_salt"), &mut plain);
    let prompt: Vec<u32> = (101..=120).collect();
    let salted = serde_json::json!({ "token_ids": prompt, "cache_salt": "alice" });
    assert_eq!(matched(&index, plain.id(), &salted), 5);
    assert_eq!(matched(&index, speculative.id(), &salted), 0);
    let unsalted = serde_json::json!({ "token_ids": prompt });
    // The speculative rank cannot match the last block: no token follows it.
    assert_eq!(matched(&index, speculative.id(), &unsalted), 4);
    assert_eq!(matched(&index, plain.id(), &unsalted), 0);
    let request = parse_query(unsalted.to_string().as_bytes()).expect("parses");
    assert_eq!(index.query_prompt(&request.prompt(), &|_| true).len(), 1);
    drop(speculative);
    // With no lookahead engine left, one chain of keys scores everyone.
    assert_eq!(matched(&index, plain.id(), &salted), 5);
}

/// Known answers of the key function (`docs.md`, "Block keys"), so that a router can check its
/// own implementation.
#[test]
fn prompt_keys_match_the_known_answers() {
    let tokens: Vec<u32> = (1..=8).collect();
    let plain = Prompt {
        tokens: &tokens,
        ..Prompt::default()
    };
    assert_eq!(
        prompt_keys(&plain, 4, 0),
        vec![14643705804678351452, 4945711292740353085]
    );
    let salted = Prompt {
        cache_salt: Some("alice"),
        ..plain
    };
    let image = [MmFeature {
        identifier: "img-a".into(),
        offset: 2,
        length: 4,
    }];
    let multimodal = Prompt {
        mm_features: &image,
        ..plain
    };
    let keys = |prompt: &Prompt, lookahead| prompt_keys(prompt, 4, lookahead);
    assert_eq!(keys(&salted, 0), vec![SALTED_0, SALTED_1]);
    assert_eq!(keys(&multimodal, 0), vec![IMAGE_0, IMAGE_1]);
    assert_eq!(keys(&plain, 1), vec![LOOKAHEAD_0]);
}

// Computed independently of this crate, from the function as docs.md writes it (Python over
// libxxhash's XXH3_64bits_withSeed).
const SALTED_0: u64 = 7897593270304324242;
const SALTED_1: u64 = 6287257062283299983;
const IMAGE_0: u64 = 8581775248249605281;
const IMAGE_1: u64 = 8869547897198371885;
const LOOKAHEAD_0: u64 = 2798744560057046380;

/// End to end: a simulated vLLM rank (real ZMQ PUB on 127.0.0.1) serves salted and multimodal
/// prompts, the indexer service subscribes to it and answers `POST /query` over real HTTP, and
/// for every probe the predicted prefix must equal what the rank's cache truly holds, including
/// probes whose tokens it holds under another salt or another image.
#[test]
fn salted_and_multimodal_prompts_end_to_end() {
    let engine = SimEngine::start(SimConfig {
        block_size: 4,
        capacity_blocks: 1_000,
        recover_port: None,
        seed: 14,
        ..SimConfig::default()
    })
    .expect("simulated engine");
    let service = RunningService::start(&indexer_toml(
        None,
        4,
        // With its replay: a first batch lost to the slow joiner is replayed, so the rank is
        // whole (`active`, the only state a query trusts) and not degraded from the start.
        &[EngineToml {
            replay_port: engine.ports()[0].replay,
            ..EngineToml::new("sim", engine.ports()[0].publish)
        }],
    ))
    .unwrap_or_else(|error| panic!("{error:#}"));
    let url = format!("http://{}/query", service.http_addr());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    let matched = |body: &Value| -> u32 {
        let text = agent
            .post(&url)
            .send(body.to_string())
            .and_then(|mut reply| reply.body_mut().read_to_string())
            .unwrap_or_else(|err| panic!("POST /query {body}: {err}"));
        let answer: Value = serde_json::from_str(&text).expect("JSON answer");
        answer["scores"][0]["matched_blocks"].as_u64().unwrap_or(0) as u32
    };

    // A PUB socket drops what it sends before the subscription arrives: serve fresh warm-up
    // prompts until one is indexed.
    let deadline = Instant::now() + Duration::from_secs(10);
    for round in 0u32.. {
        let warm: Vec<u32> = (0..8).map(|t| 900_000 + round * 8 + t).collect();
        engine.serve(0, &warm).expect("serve");
        std::thread::sleep(Duration::from_millis(50));
        if matched(&serde_json::json!({ "token_ids": warm })) == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the indexer never saw the rank");
    }

    let text: Vec<u32> = (101..=120).collect();
    let image = |identifier: &str, offset: u32| {
        [MmFeature {
            identifier: identifier.into(),
            offset,
            length: 8,
        }]
    };
    let (img_a, img_b, img_a_moved) = (image("img-a", 4), image("img-b", 4), image("img-a", 8));
    let probe = |cache_salt, mm_features| Request {
        tokens: &text,
        cache_salt,
        mm_features,
    };
    for served in [probe(Some("alice"), &[]), probe(None, &img_a)] {
        engine.serve(0, served).expect("serve");
    }
    let probes = [
        probe(Some("alice"), &[]),
        probe(Some("bob"), &[]),
        probe(None, &[]),
        probe(None, &img_a),
        probe(None, &img_b),
        probe(None, &img_a_moved),
        probe(Some("alice"), &img_a),
    ];
    let truth: Vec<u32> = probes
        .iter()
        .map(|&probe| engine.true_prefix_hit(0, probe).expect("truth"))
        .collect();
    // The rank holds the text under alice's salt and, apart, with img-a: the other probes share
    // tokens with a cached prompt without sharing its blocks (beyond the first, which img-a does
    // not overlap).
    assert_eq!(truth, vec![5, 0, 1, 5, 1, 1, 1]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let predicted: Vec<u32> = probes
            .iter()
            .map(|probe| matched(&query_body(probe)))
            .collect();
        if predicted == truth {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "predicted {predicted:?}, the rank holds {truth:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    engine.stop();
}

/// The `/query` body a router sends for the simulated engine's request.
fn query_body(request: &Request) -> Value {
    let features: Vec<Value> = request
        .mm_features
        .iter()
        .map(|f| {
            serde_json::json!({
                "identifier": f.identifier,
                "offset": f.offset,
                "length": f.length,
            })
        })
        .collect();
    serde_json::json!({
        "token_ids": request.tokens,
        "cache_salt": request.cache_salt,
        "mm_features": features,
    })
}
