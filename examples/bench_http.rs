//! `/query` latency over HTTP on loopback: an 8,192-token prompt (512 blocks) against an index
//! of 1 M (worker, block) pairs fed through real listeners by 8 simulated engines, with 1 and 4
//! keep-alive clients, with the JSON body and with the binary one (little-endian u32 tokens).
//! Target: p99 <= 300 µs with one client. Also what a percent-decode of a query-string value
//! costs, with the `percent-encoding` crate (what the server uses) and with the hand-written
//! decoder it replaced, and what a 12,000-token chat prompt sent as `messages` costs against
//! the same prompt as `token_ids` (docs.md "Prompts as text or chat messages"; the engines'
//! tokenizer is `sim::tokenizer_dir`'s ChatML one).
//!
//! `cargo run --release --example bench_http`

use kv_indexer_sim::watch::keep_alive_client;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kv_indexer::config::Config;
use kv_indexer::http::percent_decode;
use kv_indexer::service::Service;
use kv_indexer::tokenize::{Prompt, Tokenizers};
use kv_indexer_sim::fleet::{Fleet, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::rng::SplitMix64;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::tokenizer_dir;
use kv_indexer_sim::watch::{settle, total, warm_up, OverHttp, QueryForm};
use serde_json::{json, Value};

const ENGINES: usize = 8;
const PAIRS: u64 = 1_000_000;
const PROMPT_BLOCKS: u32 = 512;
const CHAIN: u32 = 32;
const DEADLINE: Duration = Duration::from_secs(120);
const CHAT_MODEL: &str = "chatml";
/// The chat prompt's length, as the issue asks.
const CHAT_TOKENS: usize = 12_000;

fn main() {
    let per_engine = PAIRS / ENGINES as u64;
    // Room for every block an engine is given (and the warm-up's): nothing is evicted.
    let fleet = Fleet::start(ENGINES, |i| SimConfig {
        capacity_blocks: per_engine as usize + 1_024,
        block_size: BLOCK_SIZE,
        seed: 0xB077 + i as u64,
        ..SimConfig::default()
    })
    .expect("simulated engines");
    let dir = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(dir.path()).expect("tokenizer directories");
    let chatml = dir.path().join("chatml");
    // Every engine serves the model `chatml` with that tokenizer; the token-id bodies name no
    // model, so they score every engine as before.
    let engines: Vec<EngineToml> = fleet
        .engine_tomls()
        .into_iter()
        .map(|engine| EngineToml {
            model: Some(CHAT_MODEL.to_owned()),
            tokenizer: Some(chatml.display().to_string()),
            ..engine
        })
        .collect();
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, indexer_toml(None, BLOCK_SIZE, 64, &engines)).expect("write config");
    let config = Config::load(&path).expect("valid config");
    let service = Service::start(&path, config, Some("127.0.0.1:0".into())).expect("service");
    let addr = service.http_addr();
    let mut indexer = OverHttp::new(addr);
    warm_up(&fleet, &mut indexer, DEADLINE).expect("every listener subscribed");

    // Engine i holds the first 64 × (i + 1) blocks of the prompt, then filler chains up to
    // PAIRS / ENGINES blocks.
    let prompt: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK_SIZE).collect();
    let mut next_token = 1 << 24;
    let feeding = Instant::now();
    for (i, at) in fleet.ranks().into_iter().enumerate() {
        let engine = fleet.engine(at);
        let held = 64 * (i as u32 + 1);
        engine
            .serve(at.rank, &prompt[..(held * BLOCK_SIZE) as usize])
            .expect("serve the shared prompt");
        let mut stored = u64::from(held);
        while stored < per_engine {
            let blocks = CHAIN.min((per_engine - stored) as u32);
            let tokens: Vec<u32> = (next_token..next_token + blocks * BLOCK_SIZE).collect();
            next_token += blocks * BLOCK_SIZE;
            engine
                .serve(at.rank, &tokens)
                .expect("serve a filler prompt");
            stored += u64::from(blocks);
        }
    }
    let views = settle(&fleet, &mut indexer, DEADLINE).expect("every listener caught up");
    let indexed = total(&views, |view| view.blocks);
    assert!(
        indexed >= PAIRS,
        "{indexed} pairs indexed, expected {PAIRS}"
    );
    println!(
        "indexed {indexed} pairs from {ENGINES} engines over ZMQ in {:?}",
        feeding.elapsed()
    );

    let body = QueryForm::Json.body(&prompt);
    let agent = keep_alive_client();
    let answer = query(&agent, addr, QueryForm::Json, &body);
    let parsed: serde_json::Value = serde_json::from_slice(&answer).expect("a JSON answer");
    assert_eq!(parsed["scores"].as_array().map(Vec::len), Some(ENGINES));
    assert_eq!(parsed["scores"][0]["matched_blocks"], PROMPT_BLOCKS);
    let binary = QueryForm::Binary.body(&prompt);
    assert_eq!(
        query(&agent, addr, QueryForm::Binary, &binary),
        answer,
        "the binary body answers otherwise than JSON"
    );
    println!(
        "body {} bytes of JSON or {} binary, {} tokens",
        body.len(),
        binary.len(),
        prompt.len()
    );
    print_parse_cost(&body);
    print_percent_decode_cost();

    for (form, body, clients) in [
        (QueryForm::Json, &body, 1),
        (QueryForm::Json, &body, 4),
        (QueryForm::Binary, &binary, 1),
        (QueryForm::Binary, &binary, 4),
    ] {
        let per_client = 4_000 / clients;
        let started = Instant::now();
        let mut latencies: Vec<Duration> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..clients)
                .map(|_| {
                    scope.spawn(move || {
                        let agent = keep_alive_client();
                        for _ in 0..200 {
                            query(&agent, addr, form, body);
                        }
                        (0..per_client)
                            .map(|_| {
                                let t = Instant::now();
                                query(&agent, addr, form, body);
                                t.elapsed()
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().expect("client thread"))
                .collect()
        });
        let wall = started.elapsed();
        latencies.sort();
        let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
        println!(
            "{form:?}, {clients} client(s): {} queries, p50 {:?}, p99 {:?}, p99.9 {:?}, max {:?}, {:.0} queries/s",
            latencies.len(),
            at(0.50),
            at(0.99),
            at(0.999),
            at(1.0),
            latencies.len() as f64 / wall.as_secs_f64()
        );
    }
    print_chat_cost(&fleet, &mut indexer, addr, &chatml);
    service.shutdown();
}

/// A 12,000-token chat (a system prompt and turns of generated prose) served on the first
/// rank, then `/query` with it as `token_ids`, as the same `messages` again and again (every
/// piece from the tokenizer's cache), and as a conversation whose last user turn is new each
/// time (what a chat's next request is). Interleaved, one keep-alive client.
fn print_chat_cost(fleet: &Fleet, indexer: &mut OverHttp, addr: SocketAddr, dir: &std::path::Path) {
    let tokenizers = Tokenizers::load([(CHAT_MODEL, dir)], &Tokenizers::default())
        .expect("the ChatML tokenizer");
    let mut words = SplitMix64::new(12_000);
    let mut messages = vec![json!({"role": "system", "content": prose(&mut words, 400)})];
    let ids = loop {
        let mut ids = Vec::new();
        let chat = Value::Array(messages.clone());
        let prompt = Prompt::Chat {
            messages: &chat,
            tools: None,
        };
        tokenizers
            .encode(Some(CHAT_MODEL), &prompt, &mut ids)
            .expect("tokenized");
        if ids.len() >= CHAT_TOKENS {
            break ids;
        }
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        messages.push(json!({"role": role, "content": prose(&mut words, 300)}));
    };
    let at = fleet.ranks()[0];
    fleet
        .engine(at)
        .serve(at.rank, &ids)
        .expect("serve the chat");
    settle(fleet, indexer, DEADLINE).expect("the chat indexed");

    let by_ids = json!({"token_ids": ids, "model": CHAT_MODEL})
        .to_string()
        .into_bytes();
    let chat = json!({"messages": messages, "model": CHAT_MODEL})
        .to_string()
        .into_bytes();
    let agent = keep_alive_client();
    let expected: Value = serde_json::from_slice(&query(&agent, addr, QueryForm::Json, &by_ids))
        .expect("a JSON answer");
    let answer: Value = serde_json::from_slice(&query(&agent, addr, QueryForm::Json, &chat))
        .expect("a JSON answer");
    assert_eq!(
        answer, expected,
        "the chat as messages scores otherwise than its ids"
    );
    assert_eq!(answer["query_tokens"], ids.len());
    println!(
        "chat prompt: {} messages, {} tokens, {} bytes as messages, {} as token_ids",
        messages.len(),
        ids.len(),
        chat.len(),
        by_ids.len()
    );

    let (mut as_ids, mut repeated, mut new_turn) = (Vec::new(), Vec::new(), Vec::new());
    let timed = |samples: &mut Vec<Duration>, body: &[u8]| {
        let t = Instant::now();
        query(&agent, addr, QueryForm::Json, body);
        samples.push(t.elapsed());
    };
    for round in 0..1_200 {
        let mut next = messages.clone();
        if let Some(last) = next.last_mut() {
            last["content"] = json!(format!("{} (take {round})", prose(&mut words, 300)));
        }
        let next = json!({"messages": next, "model": CHAT_MODEL})
            .to_string()
            .into_bytes();
        if round < 200 {
            query(&agent, addr, QueryForm::Json, &by_ids);
            query(&agent, addr, QueryForm::Json, &chat);
            continue;
        }
        timed(&mut as_ids, &by_ids);
        timed(&mut repeated, &chat);
        timed(&mut new_turn, &next);
    }
    for (what, samples) in [
        ("as token_ids", &mut as_ids),
        ("as messages, repeated", &mut repeated),
        ("as messages, last turn new", &mut new_turn),
    ] {
        samples.sort();
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        println!(
            "{CHAT_TOKENS}-token chat {what}: {} queries, p50 {:?}, p99 {:?}",
            samples.len(),
            at(0.50),
            at(0.99)
        );
    }
}

/// `words` words of generated prose: common words, some capitalised, with punctuation.
fn prose(rng: &mut SplitMix64, words: usize) -> String {
    const WORDS: [&str; 24] = [
        "the",
        "cache",
        "of",
        "a",
        "rank",
        "holds",
        "blocks",
        "that",
        "prompt",
        "shares",
        "with",
        "its",
        "neighbours",
        "and",
        "router",
        "sends",
        "each",
        "request",
        "where",
        "prefix",
        "is",
        "already",
        "warm",
        "today",
    ];
    let mut text = String::new();
    for n in 0..words {
        let word = WORDS[rng.below(WORDS.len() as u64) as usize];
        if n > 0 {
            text.push(' ');
        }
        if n % 11 == 0 {
            let mut chars = word.chars();
            text.extend(chars.next().map(|c| c.to_ascii_uppercase()));
            text.push_str(chars.as_str());
        } else {
            text.push_str(word);
        }
        if n % 11 == 10 {
            text.push_str(if rng.below(4) == 0 { "?" } else { "." });
        }
    }
    text
}

/// What parsing the body costs, apart from HTTP: the server's one-pass scanner (every body of
/// the common shape), its fallback (derived structs, taken by bodies the scanner declines:
/// unknown keys, escapes, errors; here the body with one unknown key), a refused body (its last
/// token -1: read by the fallback, then again with `serde_path_to_error` tracking the path to
/// name `token_ids[8191]`), and a plain typed serde_json parse for scale.
fn print_parse_cost(body: &[u8]) {
    #[derive(serde::Deserialize)]
    struct Query {
        token_ids: Vec<u32>,
    }
    let fallback_body = [br#"{"unknown": 1, "#.as_slice(), &body[1..]].concat();
    let last_token = body.iter().rposition(|&b| b == b',').expect("a token list") + 1;
    let close = body.iter().rposition(|&b| b == b']').expect("a token list");
    let refused_body = [&body[..last_token], b"-1", &body[close..]].concat();
    let scanner = time_parse(|| kv_indexer::http::parse_query(body).map(|q| q.token_ids.len()));
    let fallback =
        time_parse(|| kv_indexer::http::parse_query(&fallback_body).map(|q| q.token_ids.len()));
    let refused = time_parse(|| match kv_indexer::http::parse_query(&refused_body) {
        Err(reason) if reason.starts_with("token_ids[") => Ok(reason.len()),
        other => Err(format!("not refused by its last token: {other:?}")),
    });
    let serde = time_parse(|| {
        serde_json::from_slice::<Query>(body)
            .map(|q| q.token_ids.len())
            .map_err(|err| err.to_string())
    });
    for (what, (p50, p99)) in [
        ("the scanner", scanner),
        ("our fallback path", fallback),
        ("our fallback path, refusing it", refused),
        ("a plain serde_json struct", serde),
    ] {
        println!("parse of the body by {what}: p50 {p50:?}, p99 {p99:?}");
    }
}

/// The p50 and p99 of 2,000 runs of `parse`, which must succeed.
fn time_parse(parse: impl Fn() -> Result<usize, String>) -> (Duration, Duration) {
    let mut took: Vec<Duration> = (0..2_000)
        .map(|_| {
            let t = Instant::now();
            let tokens = parse().expect("the bench body parses");
            std::hint::black_box(tokens);
            t.elapsed()
        })
        .collect();
    took.sort();
    (took[took.len() / 2], took[took.len() * 99 / 100])
}

/// Per decode of the values a binary `/query`'s query string and a `/snapshot/` path carry:
/// the server's `percent_decode` (the `percent-encoding` crate behind a check that every `%`
/// starts an escape) against the hand-written decoder it replaced (`hand_written_decode`).
fn print_percent_decode_cost() {
    const ROUNDS: usize = 200_000;
    let values = [
        ("a model name", "Qwen%2FQwen3-8B"),
        ("a plain 32-byte salt", "c0ffee00c0ffee00c0ffee00c0ffee00"),
        (
            "a 30-byte name, 10 escapes",
            "%E4%BD%A0%E5%A5%BD-lora%2Fv2%20a",
        ),
    ];
    for (what, value) in values {
        assert_eq!(percent_decode(value), hand_written_decode(value));
        let time = |decode: &dyn Fn(&str) -> Option<String>| {
            let started = Instant::now();
            for _ in 0..ROUNDS {
                std::hint::black_box(decode(std::hint::black_box(value)));
            }
            started.elapsed().as_nanos() as f64 / ROUNDS as f64
        };
        // Each timed twice, interleaved, the better kept: the machine is shared.
        let (mut ours, mut crate_) = (f64::MAX, f64::MAX);
        for _ in 0..2 {
            crate_ = crate_.min(time(&percent_decode));
            ours = ours.min(time(&hand_written_decode));
        }
        println!(
            "percent-decode of {what}: percent-encoding {crate_:.0} ns, hand-written {ours:.0} ns"
        );
    }
}

/// The decoder the server had before `percent-encoding`, for the comparison only.
fn hand_written_decode(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        if byte == b'%' {
            let digit = |at: usize| char::from(*tail.get(at)?).to_digit(16);
            bytes.push((digit(0)? * 16 + digit(1)?) as u8);
            rest = &tail[2..];
        } else {
            bytes.push(byte);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

/// `POST /query` with `body` in `form`; the answer's bytes, read whole (status 200 or the bench
/// fails).
fn query(agent: &ureq::Agent, addr: SocketAddr, form: QueryForm, body: &[u8]) -> Vec<u8> {
    let mut reply = agent
        .post(&format!("http://{addr}/query"))
        .header("Content-Type", form.content_type())
        .send(body)
        .expect("POST /query");
    let answer = reply.body_mut().read_to_vec().expect("the /query body");
    assert_eq!(reply.status(), 200, "{}", String::from_utf8_lossy(&answer));
    answer
}
