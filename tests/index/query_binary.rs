//! `POST /query` with the binary body (docs.md "HTTP API": little-endian u32 token ids as
//! `application/octet-stream`, the options in the query string) over real HTTP on 127.0.0.1,
//! served in-process by `Service` over the real registry, listeners and index: the same answer,
//! byte for byte, as the JSON body for the same prompt, and every rejection named.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::fake_engine::{prompt, FakeRank};
use crate::support::http_client::{errors_with_status, wait_for, Connection, Reply};
use crate::support::{settle, start_service, trace_prompts, warm_up};
use kv_indexer::wire::{BlockExtras, BlockStored, Event};
use kv_indexer_sim::fleet::{Fleet, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{OverHttp, QueryForm};
use kv_indexer_sim::workload::Route;
use serde_json::{json, Value};

const OCTET_STREAM: &str = "application/octet-stream";
/// A model name that needs percent-encoding in a query string (`/`, `+` and a space).
const MODEL_A: &str = "org/m+1 x";
const MODEL_A_ENCODED: &str = "org%2Fm%2B1+x";

fn le_bytes(tokens: &[u32]) -> Vec<u8> {
    QueryForm::Binary.body(tokens)
}

/// `POST path` with this Content-Type (none when `None`) on a kept-alive connection.
fn post_as(
    connection: &mut Connection,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Reply {
    let content_type = content_type.map_or_else(String::new, |t| format!("Content-Type: {t}\r\n"));
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\n{content_type}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    connection.write_raw(&request);
    connection.read_reply()
}

fn post_binary(addr: SocketAddr, query_string: &str, tokens: &[u32]) -> Reply {
    let path = format!("/query{query_string}");
    post_as(
        &mut Connection::open(addr),
        &path,
        Some(OCTET_STREAM),
        &le_bytes(tokens),
    )
}

fn post_json(addr: SocketAddr, body: &Value) -> Reply {
    let body = body.to_string();
    post_as(
        &mut Connection::open(addr),
        "/query",
        Some("application/json"),
        body.as_bytes(),
    )
}

/// Both forms' answers to one prompt and options: the same status, type and bytes.
fn assert_same_answer(addr: SocketAddr, tokens: &[u32], options: &[(&str, &str, &str)]) -> Value {
    let mut body = json!({ "token_ids": tokens });
    let mut query_string = String::new();
    for (name, value, encoded) in options {
        body[*name] = json!(value);
        query_string.push(if query_string.is_empty() { '?' } else { '&' });
        query_string.push_str(&format!("{name}={encoded}"));
    }
    let (json_reply, binary_reply) = (
        post_json(addr, &body),
        post_binary(addr, &query_string, tokens),
    );
    assert_eq!(json_reply.status, 200, "{}", json_reply.text());
    assert_eq!(
        (binary_reply.status, binary_reply.header("Content-Type")),
        (200, json_reply.header("Content-Type")),
        "{}",
        binary_reply.text()
    );
    assert_eq!(
        binary_reply.text(),
        json_reply.text(),
        "/query{query_string} answers otherwise than {body}"
    );
    json_reply.json()
}

/// Engines whose blocks only one set of options matches: `a` (model `MODEL_A`) holds 4 plain
/// blocks of the prompt, `b` (model m2) 2 plain ones and 3 under LoRA `adapter`, `c` (no model)
/// 2 under cache salt `alice`.
struct Engines {
    running: kv_indexer_sim::running::RunningService,
    _ranks: Vec<FakeRank>,
    prompt: Vec<u32>,
}

fn engines() -> Engines {
    let zmq = zmq::Context::new();
    let mut ranks: Vec<FakeRank> = (0..3).map(|_| FakeRank::bind(&zmq, 0)).collect();
    let engine = |name: &str, port, model: Option<&str>| EngineToml {
        model: model.map(str::to_owned),
        ..EngineToml::new(name, port)
    };
    let running = start_service(&indexer_toml(
        Some("127.0.0.1:1"),
        16,
        &[
            engine("a", ranks[0].port, Some(MODEL_A)),
            engine("b", ranks[1].port, Some("m2")),
            engine("c", ranks[2].port, None),
        ],
    ));
    let tokens = prompt(100, 4);
    let blocks = |count: usize| tokens[..count * BLOCK_SIZE as usize].to_vec();
    let hashes = |first: u64, count: u64| (first..first + count).collect::<Vec<u64>>();
    for rank in &ranks {
        rank.wait_subscribed();
    }
    ranks[0].store(&hashes(1, 4), None, &blocks(4));
    ranks[1].store(&hashes(1, 2), None, &blocks(2));
    let adapted = BlockStored {
        lora_name: Some("adapter".into()),
        ..BlockStored::new(hashes(11, 3), None, blocks(3), BLOCK_SIZE)
    };
    ranks[1].publish(vec![Event::Stored(adapted)]);
    let mut salted = BlockStored::new(hashes(21, 2), None, blocks(2), BLOCK_SIZE);
    // vLLM puts the salt on a chain's first block only.
    salted.extras = vec![
        BlockExtras {
            cache_salt: Some("alice".into()),
            ..BlockExtras::default()
        },
        BlockExtras::default(),
    ];
    ranks[2].publish(vec![Event::Stored(salted)]);
    let addr = running.http_addr();
    wait_for(10, "every engine's blocks to be indexed", || {
        let ready = [
            json!({ "token_ids": tokens }),
            json!({ "token_ids": tokens, "lora_name": "adapter" }),
            json!({ "token_ids": tokens, "cache_salt": "alice" }),
        ]
        .iter()
        .map(|body| {
            post_json(addr, body).json()["scores"]
                .as_array()
                .map_or(0, Vec::len)
        })
        .eq([2, 1, 1]);
        ready.then_some(())
    });
    Engines {
        running,
        _ranks: ranks,
        prompt: tokens,
    }
}

#[test]
fn the_binary_body_answers_byte_for_byte_as_json_with_every_option() {
    let setup = engines();
    let addr = setup.running.http_addr();
    let mut with_tail = setup.prompt.clone();
    with_tail.extend([7, 7, 7, 7, 7]);
    let cases: &[&[(&str, &str, &str)]] = &[
        &[],
        &[("model", MODEL_A, MODEL_A_ENCODED)],
        &[("model", "m2", "m2")],
        &[("model", "other", "other")],
        &[("lora_name", "adapter", "adapter")],
        &[("lora_name", "adapter", "adapter"), ("model", "m2", "m2")],
        &[("cache_salt", "alice", "alice")],
        &[
            ("cache_salt", "alice", "%61lice"),
            ("model", MODEL_A, MODEL_A_ENCODED),
        ],
        &[("model", "", "")],
    ];
    let mut matched = Vec::new();
    for options in cases {
        for tokens in [&setup.prompt, &with_tail, &setup.prompt[..40]] {
            let answer = assert_same_answer(addr, tokens, options);
            matched.push(answer["scores"].as_array().map_or(0, Vec::len));
        }
    }
    // Every option changed the answer somewhere: the comparison covered each of them.
    assert_eq!(
        matched,
        [2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        "scores listed per case"
    );
}

#[test]
fn an_empty_binary_body_answers_as_no_tokens_in_json() {
    let setup = engines();
    let addr = setup.running.http_addr();
    let empty = assert_same_answer(addr, &[], &[("model", "m2", "m2")]);
    assert_eq!(
        empty,
        json!({"block_size": 16, "query_tokens": 0, "query_blocks": 0, "scores": []})
    );
}

/// One connection, its buffers kept between queries or (past 256 KiB: the 80,000-token body)
/// let go: every answer is the one a fresh connection gets.
#[test]
fn keep_alive_queries_of_either_form_and_length_reuse_nothing_stale() {
    let setup = engines();
    let addr = setup.running.http_addr();
    let long: Vec<u32> = setup.prompt.iter().copied().chain(5_000..85_000).collect();
    let expected = |tokens: &[u32]| post_json(addr, &json!({ "token_ids": tokens })).text();
    let (long_answer, short_answer) = (expected(&long), expected(&setup.prompt[..32]));
    let mut connection = Connection::open(addr);
    for _ in 0..2 {
        let reply = post_as(
            &mut connection,
            "/query",
            Some(OCTET_STREAM),
            &le_bytes(&long),
        );
        assert_eq!(reply.text(), long_answer);
        let short = json!({ "token_ids": &setup.prompt[..32] }).to_string();
        let reply = post_as(&mut connection, "/query", None, short.as_bytes());
        assert_eq!(reply.text(), short_answer);
        let reply = post_as(
            &mut connection,
            "/query",
            Some(OCTET_STREAM),
            &le_bytes(&setup.prompt[..32]),
        );
        assert_eq!(reply.text(), short_answer);
    }
    assert!(
        long_answer.contains("\"matched_blocks\":4"),
        "{long_answer}"
    );
}

/// The rows of docs.md's table of what the binary body refuses: (query string, body bytes, the
/// error's beginning).
fn documented_rejections() -> Vec<(String, usize, String)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs.md");
    let docs = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let section = docs
        .lines()
        .skip_while(|line| !line.starts_with("**The binary body of `/query`.**"))
        .take_while(|line| !line.starts_with("**`GET /workers`**"));
    let unquote = |cell: &str| cell.trim().trim_matches('`').to_owned();
    let rows: Vec<(String, usize, String)> = section
        .filter(|line| line.starts_with("| ") && line.contains(" bytes | "))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
            let [query_string, body, reason] = cells[..] else {
                panic!("docs.md: malformed rejection row: {line}");
            };
            let query_string = Some(unquote(query_string)).filter(|q| q != "none");
            let bytes = body.trim().trim_end_matches(" bytes").parse();
            let bytes = bytes.unwrap_or_else(|_| panic!("docs.md: body of {line}"));
            (query_string.unwrap_or_default(), bytes, unquote(reason))
        })
        .collect();
    assert!(
        rows.len() >= 5,
        "docs.md: the rejection table has {} rows",
        rows.len()
    );
    rows
}

/// docs.md's table, and a few more: each is answered 400 with its reason, and counted.
#[test]
fn every_rejection_names_its_reason_and_is_counted() {
    let setup = engines();
    let addr = setup.running.http_addr();
    let mut cases = documented_rejections();
    for (query_string, reason) in [
        (
            "?model=%C3",
            "query parameter \"model=%C3\" is not percent-encoded UTF-8",
        ),
        (
            "?model=m2&mm_features=x",
            "query parameter mm_features: multimodal",
        ),
        ("?token_ids=1", "query parameter \"token_ids\" is not known"),
    ] {
        cases.push((query_string.to_owned(), 8, reason.to_owned()));
    }
    let before = errors_with_status(addr, 400);
    for (query_string, length, reason) in &cases {
        let path = format!("/query{query_string}");
        let reply = post_as(
            &mut Connection::open(addr),
            &path,
            Some(OCTET_STREAM),
            &vec![1; *length],
        );
        assert_eq!(reply.status, 400, "{path}: {}", reply.text());
        let error = reply.json()["error"].as_str().map(str::to_owned);
        assert!(
            error
                .as_deref()
                .is_some_and(|error| error.starts_with(reason)),
            "{path}: {error:?}"
        );
    }
    assert_eq!(errors_with_status(addr, 400) - before, cases.len() as u64);
}

#[test]
fn a_binary_body_over_the_limit_is_refused_413_unread_and_other_types_stay_json() {
    let setup = engines();
    let addr = setup.running.http_addr();
    let mut connection = Connection::open(addr);
    connection.write_raw(
        format!(
            "POST /query HTTP/1.1\r\nHost: t\r\nContent-Type: {OCTET_STREAM}\r\nContent-Length: {}\r\n\r\n",
            (16 << 20) + 4
        )
        .as_bytes(),
    );
    let refused = connection.read_reply();
    assert_eq!(refused.status, 413, "{}", refused.text());
    assert!(
        refused.text().contains("the limit is 16777216"),
        "{}",
        refused.text()
    );

    // Without a Content-Type, or with another one, the body is JSON as it always was.
    let body = json!({ "token_ids": setup.prompt }).to_string();
    let json_answer = post_json(addr, &json!({ "token_ids": setup.prompt })).text();
    for content_type in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ] {
        let reply = post_as(
            &mut Connection::open(addr),
            "/query?model=m2",
            content_type,
            body.as_bytes(),
        );
        assert_eq!(reply.status, 200, "{content_type:?}: {}", reply.text());
        assert_eq!(reply.text(), json_answer, "{content_type:?}");
    }
    // A JSON body sent as octet-stream is read as tokens, never as JSON: 17 bytes, refused.
    let as_binary = post_as(
        &mut Connection::open(addr),
        "/query",
        Some(OCTET_STREAM),
        b"{\"token_ids\": []}",
    );
    assert_eq!(as_binary.status, 400, "{}", as_binary.text());
}

/// A simulated fleet serving the shipped trace head (its real prompts and blocks): both forms
/// agree on every prompt.
#[test]
fn on_a_simulated_fleet_both_forms_agree_on_every_trace_prompt() {
    const DEADLINE: Duration = Duration::from_secs(20);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 120);
    let fleet = Fleet::start_on_consecutive_ports(2, |i| SimConfig {
        dp_size: 2,
        block_size: BLOCK_SIZE,
        capacity_blocks: 50_000,
        seed: 0xB1A + i as u64,
        ..SimConfig::default()
    })
    .expect("fleet");
    let running = start_service(&fleet.indexer_config());
    let addr = running.http_addr();
    let mut indexer = OverHttp::new(addr);
    warm_up(&fleet, &mut indexer, DEADLINE);
    let mut router = fleet.router(Route::Sticky);
    fleet.serve_all(&mut router, &prompts).expect("serve");
    settle(&fleet, &mut indexer, DEADLINE);
    let mut hits = 0;
    for prompt in &prompts {
        let answer = assert_same_answer(addr, prompt, &[]);
        hits += usize::from(answer["scores"].as_array().is_some_and(|s| !s.is_empty()));
    }
    assert!(
        hits > prompts.len() / 2,
        "only {hits} prompts matched any rank"
    );
}
