//! The simulated engine's OpenAI-compatible server over real HTTP on 127.0.0.1: completions and
//! chats answered with the cached tokens their rank really held (prompts tokenized as the
//! indexer tokenizes them), the rank chosen by `X-data-parallel-rank` or round-robin, answers
//! streamed one event at a time, a client leaving mid-stream stopping its generation, and each
//! injected fault; a rank contending: prefills sharing its throughput, requests past
//! `max_running` waiting their turn, decode steps slowing with the batch.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::http_client::{get, series_value, wait_for};
use crate::support::sse_client::{post, send_timed, Answer};
use kv_indexer::tokenize::{Prompt, Tokenizers};
use kv_indexer_sim::openai::{Fault, OpenAiConfig, OpenAiServer};
use kv_indexer_sim::server::{SimConfig, SimEngine};
use kv_indexer_sim::tokenizer_dir;
use serde_json::{json, Value};

const MODEL: &str = "sim-chatml";
const BLOCK_SIZE: u32 = 16;

fn engine(dp_size: u32, openai: OpenAiConfig) -> SimEngine {
    SimEngine::start(SimConfig {
        dp_size,
        block_size: BLOCK_SIZE,
        replay_port: None,
        recover_port: None,
        openai_port: Some(0),
        openai: OpenAiConfig {
            model: MODEL.to_string(),
            ..openai
        },
        ..SimConfig::default()
    })
    .expect("start the engine")
}

fn server(engine: &SimEngine) -> (OpenAiServer, SocketAddr) {
    let server = engine.openai().expect("the OpenAI server runs");
    let addr = SocketAddr::from(([127, 0, 0, 1], server.port()));
    assert_eq!(engine.openai_url(), Some(format!("http://{addr}")));
    (server, addr)
}

/// A one-rank engine a token every 20 ms, and the body of a streamed completion of the prompt
/// from token `first` that would run twenty seconds if nobody left.
fn long_stream(first: u32) -> (SimEngine, OpenAiServer, SocketAddr, Vec<u8>) {
    let engine = engine(
        1,
        OpenAiConfig {
            inter_token: Duration::from_millis(20),
            ..OpenAiConfig::default()
        },
    );
    let (server, addr) = server(&engine);
    let body = completion(
        json!(token_prompt(first, 20)),
        json!({"max_tokens": 1000, "stream": true}),
    );
    (engine, server, addr, body)
}

/// `count` token ids unlike any other test's.
fn token_prompt(first: u32, count: u32) -> Vec<u32> {
    (first..first + count).collect()
}

fn completion(prompt: Value, extra: Value) -> Vec<u8> {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 3});
    merge(&mut body, extra);
    body.to_string().into_bytes()
}

fn chat(content: &str, extra: Value) -> Vec<u8> {
    let mut body = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 3,
    });
    merge(&mut body, extra);
    body.to_string().into_bytes()
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
}

fn on_rank(rank: u32) -> [(&'static str, String); 1] {
    [("X-data-parallel-rank", rank.to_string())]
}

fn post_to(addr: SocketAddr, path: &str, headers: &[(&str, String)], body: &[u8]) -> Answer {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    post(addr, path, &headers, body)
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {answer}"))
}

/// Leading full blocks of `tokens` as tokens, capped as vLLM caps a prompt held whole.
fn expected_cached(hit_blocks: u32, tokens: usize) -> u64 {
    u64::from(hit_blocks.min((tokens as u32 - 1) / BLOCK_SIZE) * BLOCK_SIZE)
}

#[test]
fn completions_and_chats_report_the_cached_tokens_their_rank_held() {
    let dirs = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(dirs.path()).expect("tokenizer directories");
    let chatml = dirs.path().join("chatml");
    let engine = engine(
        2,
        OpenAiConfig {
            tokenizer: Some(chatml.clone()),
            ..OpenAiConfig::default()
        },
    );
    let (server, addr) = server(&engine);
    let tokenizers = Tokenizers::load([(MODEL, Path::new(&chatml))], &Tokenizers::default())
        .expect("the same tokenizer");

    // Token ids: nothing cached, then the two full blocks the first request stored.
    let ids = token_prompt(1_000, 40);
    for expected in [0, 32] {
        let mut answer = post_to(
            addr,
            "/v1/completions",
            &on_rank(1),
            &completion(json!(ids), json!({})),
        );
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("Content-Type"), Some("application/json"));
        let answer = answer.json();
        assert_eq!(answer["object"], "text_completion");
        assert_eq!(answer["model"], MODEL);
        assert_eq!(answer["choices"][0]["finish_reason"], "length");
        assert!(answer["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()));
        assert_eq!(
            answer["usage"],
            json!({
                "prompt_tokens": 40,
                "completion_tokens": 3,
                "total_tokens": 43,
                "prompt_tokens_details": {"cached_tokens": expected},
            })
        );
    }
    assert_eq!(engine.true_prefix_hit(1, &ids).expect("rank 1"), 2);
    assert_eq!(engine.true_prefix_hit(0, &ids).expect("rank 0"), 0);
    assert_eq!(server.served_per_rank(), vec![0, 2]);

    // A text prompt and a chat, tokenized as the indexer tokenizes them.
    let text = "the prefix cache holds the blocks of every prompt the engine served, so the \
                router sends the next turn of a conversation to the rank that holds its prefix";
    let chat_text = "which rank holds the prefix of this question about the cache?";
    let mut text_ids = Vec::new();
    tokenizers
        .encode(Some(MODEL), &Prompt::Text(text), &mut text_ids)
        .expect("encode the text");
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": chat_text},
    ]);
    let mut chat_ids = Vec::new();
    tokenizers
        .encode(
            Some(MODEL),
            &Prompt::Chat {
                messages: &messages,
                tools: None,
            },
            &mut chat_ids,
        )
        .expect("encode the chat");
    assert!(text_ids.len() > 2 * BLOCK_SIZE as usize && chat_ids.len() > BLOCK_SIZE as usize);

    for round in 0..2 {
        let truth = engine.true_prefix_hit(0, &text_ids).expect("rank 0");
        let answer = post_to(
            addr,
            "/v1/completions",
            &on_rank(0),
            &completion(json!(text), json!({})),
        )
        .json();
        assert_eq!(answer["usage"]["prompt_tokens"], text_ids.len());
        assert_eq!(
            cached_tokens(&answer),
            expected_cached(truth, text_ids.len())
        );
        assert_eq!(round == 1, cached_tokens(&answer) > 0, "round {round}");

        let truth = engine.true_prefix_hit(0, &chat_ids).expect("rank 0");
        let answer = post_to(
            addr,
            "/v1/chat/completions",
            &on_rank(0),
            &chat(chat_text, json!({})),
        )
        .json();
        assert_eq!(answer["object"], "chat.completion");
        assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
        assert_eq!(answer["choices"][0]["finish_reason"], "length");
        assert_eq!(answer["usage"]["prompt_tokens"], chat_ids.len());
        assert_eq!(answer["usage"]["completion_tokens"], 3);
        assert_eq!(
            cached_tokens(&answer),
            expected_cached(truth, chat_ids.len())
        );
        assert_eq!(round == 1, cached_tokens(&answer) > 0, "round {round}");
    }
    assert_eq!(
        engine.true_prefix_hit(0, &chat_ids).expect("rank 0"),
        chat_ids.len() as u32 / 16
    );
    assert_eq!(server.served_per_rank(), vec![4, 2]);
}

#[test]
fn the_rank_header_picks_the_rank_and_round_robin_serves_without_it() {
    let engine = engine(3, OpenAiConfig::default());
    let (server, addr) = server(&engine);
    let ids = token_prompt(2_000, 20);
    let body = completion(json!(ids), json!({}));

    assert_eq!(
        post_to(addr, "/v1/completions", &on_rank(2), &body).status,
        200
    );
    assert_eq!(server.served_per_rank(), vec![0, 0, 1]);
    let seen = server.last_request().expect("a request seen");
    assert_eq!(seen.path, "/v1/completions");
    assert_eq!(seen.header("x-data-parallel-rank"), Some("2"));
    assert_eq!(seen.header("host"), Some("test"));
    assert_eq!(&seen.body[..], &body[..]);

    for _ in 0..3 {
        assert_eq!(post_to(addr, "/v1/completions", &[], &body).status, 200);
    }
    assert_eq!(server.served_per_rank(), vec![1, 1, 2]);
    // vLLM ignores a header that is not a number.
    let not_a_number = [("X-data-parallel-rank", "two".to_string())];
    assert_eq!(
        post_to(addr, "/v1/completions", &not_a_number, &body).status,
        200
    );
    assert_eq!(server.served_per_rank().iter().sum::<u64>(), 5);

    let mut out_of_range = post_to(addr, "/v1/completions", &on_rank(3), &body);
    assert_eq!(out_of_range.status, 400);
    let error = out_of_range.json();
    assert_eq!(error["error"]["code"], 400);
    assert!(error["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("out of range")));

    let other_model = json!({"model": "gpt-4", "prompt": ids}).to_string();
    let mut unknown = post_to(addr, "/v1/completions", &[], other_model.as_bytes());
    assert_eq!(unknown.status, 404);
    assert_eq!(
        unknown.json(),
        json!({"error": {
            "message": "The model `gpt-4` does not exist.",
            "type": "NotFoundError",
            "param": null,
            "code": 404,
        }})
    );
    // A text prompt needs the tokenizer this server was not given.
    let text = completion(json!("some text"), json!({}));
    assert_eq!(post_to(addr, "/v1/completions", &[], &text).status, 400);
    let options_alone = completion(
        json!(ids),
        json!({"stream_options": {"include_usage": true}}),
    );
    assert_eq!(
        post_to(addr, "/v1/completions", &[], &options_alone).status,
        400
    );
    assert_eq!(server.served_per_rank().iter().sum::<u64>(), 5);
    assert_eq!(server.requests(), 9);

    assert_eq!(get(addr, "/health").status, 200);
    let models = get(addr, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(
        get(addr, "/v1/nothing").json(),
        json!({"detail": "Not Found"})
    );
    // `/health` and `/v1/models` do not replace the last generating request.
    assert_eq!(
        &server.last_request().expect("kept").body[..],
        &options_alone[..]
    );
}

#[test]
fn a_stream_sends_each_event_as_the_engine_makes_it() {
    let inter_token = Duration::from_millis(60);
    let engine = engine(
        1,
        OpenAiConfig {
            inter_token,
            ..OpenAiConfig::default()
        },
    );
    let (server, addr) = server(&engine);
    let ids = token_prompt(3_000, 20);
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 5, "stream": true});
    let mut chat_body = json!({"messages": [{"role": "user", "content": "hi"}]});
    merge(&mut chat_body, json!({"max_tokens": 5, "stream": true}));

    let mut answer = post(addr, "/v1/completions", &[], body.to_string().as_bytes());
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.header("Content-Type"),
        Some("text/event-stream; charset=utf-8")
    );
    let first = answer.next_event().expect("read").expect("a first event");
    let first_at = Instant::now();
    // The answer is still being generated when its first event is read.
    assert_eq!(server.open_streams(), 1);
    let first: Value = serde_json::from_str(&first).expect("JSON");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(first["usage"], Value::Null);
    let rest = answer.events().expect("the rest of the stream");
    assert!(
        first_at.elapsed() >= inter_token * 3,
        "the last token came {:?} after the first",
        first_at.elapsed()
    );
    assert_eq!(rest.len(), 5, "{rest:?}");
    assert_eq!(rest[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(rest[4], "[DONE]");
    wait_for(5, "the stream to close", || {
        (server.open_streams() == 0).then_some(())
    });
    assert_eq!(engine.true_prefix_hit(0, &ids).expect("rank 0"), 1);

    // A chat needs the tokenizer this server was not given.
    let mut refused = post(
        addr,
        "/v1/chat/completions",
        &[],
        chat_body.to_string().as_bytes(),
    );
    assert_eq!(refused.status, 400);
    assert!(refused.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("tokenizer")));
    assert_eq!(server.disconnects(), 0);
}

#[test]
fn include_usage_adds_exactly_one_usage_event_before_done() {
    let dirs = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(dirs.path()).expect("tokenizer directories");
    let engine = engine(
        1,
        OpenAiConfig {
            tokenizer: Some(dirs.path().join("chatml")),
            ..OpenAiConfig::default()
        },
    );
    let (_server, addr) = server(&engine);
    let question = "the cache holds the prefix of this prompt, so the second one is a hit";
    let streamed = json!({"stream": true, "stream_options": {"include_usage": true}});

    let mut cached = Vec::new();
    for _ in 0..2 {
        let events = post(
            addr,
            "/v1/chat/completions",
            &[],
            &chat(question, streamed.clone()),
        )
        .events()
        .expect("the stream");
        // Role, three tokens, usage, [DONE].
        assert_eq!(events.len(), 6, "{events:?}");
        assert_eq!(events[0]["object"], "chat.completion.chunk");
        assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(events[1]["choices"][0]["delta"]["content"].is_string());
        assert_eq!(events[3]["choices"][0]["finish_reason"], "length");
        let usage: Vec<&Value> = events
            .iter()
            .filter(|e| e.get("usage").is_some_and(|u| !u.is_null()))
            .collect();
        assert_eq!(usage.len(), 1);
        assert_eq!(events[4]["choices"], json!([]));
        assert_eq!(events[4]["usage"]["completion_tokens"], 3);
        assert_eq!(events[5], "[DONE]");
        cached.push(cached_tokens(&events[4]));
    }
    assert_eq!(cached[0], 0);
    assert!(cached[1] > 0, "{cached:?}");

    // A completion's chunks carry `"usage": null`; without include_usage there is no usage event.
    let ids = token_prompt(4_000, 40);
    let events = post(
        addr,
        "/v1/completions",
        &[],
        &completion(json!(ids), streamed.clone()),
    )
    .events()
    .expect("the stream");
    assert_eq!(events.len(), 5, "{events:?}");
    assert!(events[..3]
        .iter()
        .all(|e| e["usage"].is_null() && e.get("usage").is_some()));
    assert_eq!(events[3]["usage"]["prompt_tokens"], 40);
    let plain = json!({"stream": true});
    let events = post(addr, "/v1/completions", &[], &completion(json!(ids), plain))
        .events()
        .expect("the stream");
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(events
        .iter()
        .all(|e| e.get("usage").is_none_or(Value::is_null)));
}

#[test]
fn a_client_leaving_mid_stream_stops_its_generation() {
    let (_engine, server, addr, body) = long_stream(5_000);
    let mut answer = post(addr, "/v1/completions", &[], &body);
    for _ in 0..2 {
        answer.next_event().expect("read").expect("an event");
    }
    assert_eq!(server.open_streams(), 1);
    drop(answer);
    wait_for(10, "the generation to stop", || {
        (server.disconnects() == 1 && server.open_streams() == 0).then_some(())
    });
}

#[test]
fn injected_statuses_stalls_and_breaks() {
    let engine = engine(1, OpenAiConfig::default());
    let (server, addr) = server(&engine);
    let ids = token_prompt(6_000, 20);
    let whole = completion(json!(ids), json!({}));
    let streamed = completion(json!(ids), json!({"max_tokens": 6, "stream": true}));

    server.inject(Fault::Status(503), 2);
    for _ in 0..2 {
        let mut answer = post(addr, "/v1/completions", &[], &whole);
        assert_eq!(answer.status, 503);
        let error = answer.json();
        assert_eq!(error["error"]["code"], 503);
        assert_eq!(error["error"]["type"], "InternalServerError");
    }
    assert_eq!(post(addr, "/v1/completions", &[], &whole).status, 200);
    assert_eq!((server.requests(), server.served_per_rank()), (3, vec![1]));

    // A stall: nothing written for its length, then the answer.
    server.inject(Fault::Stall(Duration::from_millis(300)), 1);
    let started = Instant::now();
    let mut stalled = post(addr, "/v1/completions", &[], &streamed);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(stalled.status, 200);
    assert_eq!(stalled.events().expect("the stream").len(), 7);

    // A break after two events: the connection closes without the stream's end.
    server.inject(Fault::BreakAfter(2), 1);
    let mut broken = post(addr, "/v1/completions", &[], &streamed);
    assert_eq!(broken.status, 200);
    for _ in 0..2 {
        broken
            .next_event()
            .expect("read")
            .expect("an event before the break");
    }
    assert!(broken.next_event().is_err(), "the stream ends cleanly");
    // A whole answer breaks halfway through its body.
    server.inject(Fault::BreakAfter(0), 1);
    let mut cut = post(addr, "/v1/completions", &[], &whole);
    assert_eq!(cut.status, 200);
    let error = cut.body().expect_err("a short body");
    assert_eq!(error.kind(), ErrorKind::UnexpectedEof, "{error}");
    wait_for(5, "the answers to close", || {
        (server.open_streams() == 0).then_some(())
    });
    assert_eq!(server.disconnects(), 0);

    // Not even the status line within a client's first-byte timeout.
    server.inject(Fault::Stall(Duration::from_secs(5)), 1);
    let timeout = Duration::from_millis(100);
    let started = Instant::now();
    let early = send_timed(addr, "/v1/completions", &[], &streamed, timeout);
    let error = early.err().expect("no head within the timeout");
    assert!(
        matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{error}"
    );
    assert!(started.elapsed() >= timeout);
}

#[test]
fn a_closed_listener_refuses_connections_and_reopens_on_its_port() {
    let (_engine, server, addr, body) = long_stream(7_000);
    let mut open = post(addr, "/v1/completions", &[], &body);
    open.next_event().expect("read").expect("an event");

    server.stop_listening().expect("close the listener");
    assert!(!server.listening());
    let refused = TcpStream::connect(addr).expect_err("refused");
    assert_eq!(refused.kind(), ErrorKind::ConnectionRefused);
    // The open stream's connection is closed too, as by an engine that died.
    let ended = loop {
        match open.next_event() {
            Ok(Some(_)) => continue,
            ended => break ended,
        }
    };
    assert!(ended.is_err(), "{ended:?}");

    server.resume_listening().expect("listen again");
    assert_eq!(server.port(), addr.port());
    assert_eq!(get(addr, "/health").status, 200);
    wait_for(5, "the stream to close", || {
        (server.open_streams() == 0).then_some(())
    });
    assert_eq!(server.disconnects(), 0);
}

/// Gauge `name` of rank `rank` on `GET /metrics`, as vLLM labels it (`prometheus-parse`
/// reads no name with a `:`).
fn gauge(addr: SocketAddr, name: &str, rank: u32) -> f64 {
    let reply = get(addr, "/metrics");
    assert_eq!(reply.status, 200, "{}", reply.text());
    let series = format!("{name}{{engine=\"{rank}\",model_name=\"{MODEL}\"}}");
    series_value(&reply.text(), &series)
        .unwrap_or_else(|| panic!("no {series} in {}", reply.text()))
}

/// vLLM's load gauges, one series per rank: a stream open on rank 1 is running there until
/// its client leaves, and its prompt's blocks are rank 1's usage while it runs; the blocks a
/// served prompt left cached on rank 0 are free (held by no request), as vLLM counts them;
/// `vllm:cache_config_info` names the cache's size; a failing `/metrics` answers the status
/// set.
#[test]
fn metrics_report_each_ranks_running_requests_and_cache_usage_as_vllm_does() {
    let engine = engine(
        2,
        OpenAiConfig {
            inter_token: Duration::from_millis(20),
            ..OpenAiConfig::default()
        },
    );
    let (server, addr) = server(&engine);
    let running = |rank| gauge(addr, "vllm:num_requests_running", rank);
    assert_eq!((running(0), running(1)), (0.0, 0.0));
    let served = post_to(
        addr,
        "/v1/completions",
        &on_rank(0),
        &completion(json!(token_prompt(1, 64)), json!({})),
    );
    drop(served);
    wait_for(10, "rank 0's answer to end", || {
        (server.open_streams() == 0).then_some(())
    });
    let long = completion(
        json!(token_prompt(9_000, 20)),
        json!({"max_tokens": 1000, "stream": true}),
    );
    let mut answer = post_to(addr, "/v1/completions", &on_rank(1), &long);
    answer.next_event().expect("read").expect("an event");
    assert_eq!((running(0), running(1)), (0.0, 1.0));
    assert_eq!(gauge(addr, "vllm:num_requests_waiting", 1), 0.0);
    let usage = |rank| gauge(addr, "vllm:kv_cache_usage_perc", rank);
    assert!(engine.cached_blocks(0).expect("rank 0") > 0);
    let capacity = SimConfig::default().capacity_blocks;
    // The stream's 20 prompt tokens take 2 blocks of 16.
    assert_eq!((usage(0), usage(1)), (0.0, 2.0 / capacity as f64));
    let info = format!(
        "vllm:cache_config_info{{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"1\",num_gpu_blocks=\"{capacity}\"}}"
    );
    assert_eq!(
        series_value(&get(addr, "/metrics").text(), &info),
        Some(1.0)
    );
    drop(answer);
    wait_for(10, "rank 1's stream to end", || {
        (running(1) == 0.0 && usage(1) == 0.0).then_some(())
    });
    server.fail_metrics(Some(500));
    assert_eq!(get(addr, "/metrics").status, 500);
    server.fail_metrics(None);
    assert_eq!(get(addr, "/metrics").status, 200);
}

/// A one-rank engine whose lone request prefills `ms_per_token` a prompt token and makes a
/// token each `inter_token`; `max_running` and `decode_slowdown` as given.
fn contending(
    ms_per_token: u64,
    inter_token: Duration,
    max_running: u32,
    decode_slowdown: f64,
) -> (SimEngine, OpenAiServer, SocketAddr) {
    let engine = engine(
        1,
        OpenAiConfig {
            first_token_floor: Duration::from_millis(1),
            prefill_per_token: Duration::from_millis(ms_per_token),
            inter_token,
            max_running,
            decode_slowdown,
            ..OpenAiConfig::default()
        },
    );
    let (server, addr) = server(&engine);
    (engine, server, addr)
}

/// Whole completions of `prompts` (their first token ids) sent at once, each on its own
/// connection; returns once all are answered.
fn all_at_once(addr: SocketAddr, prompts: &[u32], tokens: u32, max_tokens: u32) {
    std::thread::scope(|scope| {
        for &first in prompts {
            scope.spawn(move || {
                let body = completion(
                    json!(token_prompt(first, tokens)),
                    json!({ "max_tokens": max_tokens }),
                );
                let mut answer = post(addr, "/v1/completions", &[], &body);
                assert_eq!(answer.status, 200);
                answer.json();
            });
        }
    });
}

/// Two prompts sent at once to one rank prefill first come, first served, as vLLM's scheduler
/// spends its token budget: one in the time it takes alone, the other after it, in about twice
/// that (the rank's own figures; 600 ms of prefill alone); neither waits for a place.
#[test]
fn concurrent_prefills_on_a_rank_run_first_come_first_served() {
    let (_engine, server, addr) = contending(1, Duration::from_millis(1), 256, 0.0);
    all_at_once(addr, &[20_000], 600, 1);
    all_at_once(addr, &[21_000, 22_000], 600, 1);
    let timings = server.timings();
    assert_eq!(timings.len(), 3, "{timings:?}");
    let alone = timings[0].prefill;
    assert!(alone >= Duration::from_millis(600), "{timings:?}");
    let mut ratios: Vec<f64> = timings[1..]
        .iter()
        .map(|pair| pair.prefill.as_secs_f64() / alone.as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    assert!(
        ratios[0] > 0.8 && ratios[0] < 1.4,
        "{ratios:?}: {timings:?}"
    );
    assert!(
        ratios[1] > 1.6 && ratios[1] < 2.6,
        "{ratios:?}: {timings:?}"
    );
    assert!(timings.iter().all(|t| t.queued.is_zero()), "{timings:?}");
}

/// A prompt sent while its rank still prefills the same prefix for another waits for that
/// prefill and hits it, as vLLM looks a request up when it schedules it: its cached tokens
/// are the full blocks the two share, though the rank held none of them when it arrived.
#[test]
fn a_prompt_behind_its_prefix_in_line_hits_it() {
    let (_engine, _server, addr) = contending(1, Duration::from_millis(1), 256, 0.0);
    let first = token_prompt(30_000, 600);
    let mut second = first.clone();
    second.extend(token_prompt(90_000, 40));
    std::thread::scope(|scope| {
        let first = scope.spawn(|| {
            post(
                addr,
                "/v1/completions",
                &[],
                &completion(json!(first), json!({})),
            )
            .json()
        });
        std::thread::sleep(Duration::from_millis(100));
        let mut answer = post(
            addr,
            "/v1/completions",
            &[],
            &completion(json!(second), json!({})),
        );
        assert_eq!(answer.status, 200);
        assert_eq!(
            cached_tokens(&answer.json()),
            592,
            "600 shared: 37 full blocks"
        );
        let first = first.join().expect("the first is answered");
        assert_eq!(cached_tokens(&first), 0);
    });
}

/// With `max_running` 1 a second request waits while the first runs, `/metrics` showing one
/// running and one waiting; the first's client leaving gives the place to the second.
#[test]
fn past_max_running_a_request_waits_until_a_place_frees() {
    let (_engine, server, addr) = contending(0, Duration::from_millis(20), 1, 0.0);
    let long = completion(
        json!(token_prompt(23_000, 20)),
        json!({"max_tokens": 1000, "stream": true}),
    );
    let mut first = post(addr, "/v1/completions", &[], &long);
    first.next_event().expect("read").expect("an event");
    let gauges = || {
        let running = gauge(addr, "vllm:num_requests_running", 0);
        (running, gauge(addr, "vllm:num_requests_waiting", 0))
    };
    std::thread::scope(|scope| {
        let second = scope.spawn(|| all_at_once(addr, &[24_000], 20, 2));
        wait_for(10, "the second request to wait", || {
            (gauges() == (1.0, 1.0)).then_some(())
        });
        let waited_from = Instant::now();
        assert_eq!(server.waiting_per_rank(), [1]);
        first
            .next_event()
            .expect("read")
            .expect("the first still runs");
        let held = waited_from.elapsed();
        drop(first);
        second.join().expect("the second is answered");
        let timings = server.timings();
        assert_eq!(timings.len(), 1, "only the second finished: {timings:?}");
        assert!(timings[0].queued >= held, "{timings:?} after {held:?}");
    });
    assert_eq!(gauges(), (0.0, 0.0));
    wait_for(10, "the first's client to count as gone", || {
        (server.disconnects() == 1).then_some(())
    });
}

/// Decode steps slow with the batch: with a slowdown of 0.5 a token takes twice as long as
/// alone with three requests decoding, 2.5 times with four (the rank's own figures), and a
/// stream among them gets its events that far apart.
#[test]
fn decode_steps_slow_with_the_batch() {
    let inter_token = Duration::from_millis(20);
    let (_engine, server, addr) = contending(0, inter_token, 256, 0.5);
    all_at_once(addr, &[25_000], 20, 11);
    let streamed = std::thread::scope(|scope| {
        scope.spawn(|| all_at_once(addr, &[26_000, 27_000, 28_000], 20, 41));
        wait_for(10, "three requests in the batch", || {
            (server.running_per_rank() == [3]).then_some(())
        });
        let body = completion(
            json!(token_prompt(29_000, 20)),
            json!({"max_tokens": 11, "stream": true}),
        );
        let mut answer = post(addr, "/v1/completions", &[], &body);
        answer.next_event().expect("read").expect("the first token");
        let first = Instant::now();
        let mut tokens = 1;
        while let Some(event) = answer.next_event().expect("read") {
            tokens += u32::from(event != "[DONE]");
        }
        assert_eq!(tokens, 11);
        first.elapsed()
    });
    let timings = server.timings();
    assert_eq!(timings.len(), 5, "{timings:?}");
    let lone = timings[0].inter_token().expect("ten steps");
    assert!(lone >= inter_token, "{timings:?}");
    for timing in &timings[1..] {
        let ratio = timing.inter_token().expect("steps").as_secs_f64() / lone.as_secs_f64();
        assert!(ratio > 1.5 && ratio < 2.6, "{ratio}: {timings:?}");
    }
    // Ten steps of the four at 2.5 times the lone step: the stream waited for each token.
    assert!(streamed > inter_token * 15, "{streamed:?}: {timings:?}");
}

/// With a prefill chunk, a prompt prefilled beside a decoding stream shares each step with it:
/// the prefill goes at the chunk's share of the step (half here: 10 ms of prompt a 10 ms
/// decode step) and the stream's tokens come a step of 20 ms apart meanwhile (the rank's own
/// figures).
#[test]
fn a_prefill_beside_a_decode_shares_its_steps() {
    let engine = engine(
        1,
        OpenAiConfig {
            first_token_floor: Duration::from_millis(1),
            prefill_per_token: Duration::from_millis(1),
            inter_token: Duration::from_millis(10),
            prefill_chunk: Some(10),
            ..OpenAiConfig::default()
        },
    );
    let (server, addr) = server(&engine);
    let decoding = completion(
        json!(token_prompt(30_000, 5)),
        json!({"max_tokens": 101, "stream": true}),
    );
    let mut stream = post(addr, "/v1/completions", &[], &decoding);
    stream.next_event().expect("read").expect("the first token");
    all_at_once(addr, &[31_000], 300, 1);
    while stream.next_event().expect("read").is_some() {}
    let timings = server.timings();
    assert_eq!(timings.len(), 2, "{timings:?}");
    let prefill = timings
        .iter()
        .find(|t| t.tokens == 1)
        .expect("the prefill's timing");
    assert!(prefill.prefill > Duration::from_millis(450), "{timings:?}");
    let decode = timings
        .iter()
        .find(|t| t.tokens == 101)
        .expect("the stream's timing");
    let inter = decode.inter_token().expect("steps");
    assert!(inter > Duration::from_micros(11_500), "{timings:?}");
}

#[test]
fn tokenize_answers_the_ids_the_generating_routes_cache_and_detokenize_reverses_them() {
    let dirs = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(dirs.path()).expect("tokenizer directories");
    let chatml = dirs.path().join("chatml");
    let engine = engine(
        1,
        OpenAiConfig {
            tokenizer: Some(chatml.clone()),
            max_model_len: 4_096,
            ..OpenAiConfig::default()
        },
    );
    let (server, addr) = server(&engine);
    let tokenizers = Tokenizers::load([(MODEL, Path::new(&chatml))], &Tokenizers::default())
        .expect("the same tokenizer");

    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "which rank holds the prefix of this question?"},
    ]);
    let mut chat_ids = Vec::new();
    tokenizers
        .encode(
            Some(MODEL),
            &Prompt::Chat {
                messages: &messages,
                tools: None,
            },
            &mut chat_ids,
        )
        .expect("encode the chat");
    let body = json!({"model": MODEL, "messages": messages, "add_generation_prompt": true});
    let mut answer = post_to(addr, "/tokenize", &[], body.to_string().as_bytes());
    assert_eq!(answer.status, 200);
    let answer = answer.json();
    assert_eq!(
        answer,
        json!({
            "count": chat_ids.len(),
            "max_model_len": 4_096,
            "tokens": chat_ids,
            "token_strs": null,
        })
    );
    assert_eq!(server.tokenize_requests(), 1);
    let seen = server
        .last_tokenize()
        .expect("the tokenize request is kept");
    assert_eq!(
        serde_json::from_slice::<Value>(&seen.body).expect("json"),
        body
    );

    // A completion prompt: with the tokenizer's special tokens, as /v1/completions.
    let text = "the prefix cache holds the blocks of every prompt";
    let mut text_ids = Vec::new();
    tokenizers
        .encode(Some(MODEL), &Prompt::Text(text), &mut text_ids)
        .expect("encode the text");
    let body = json!({"model": MODEL, "prompt": text, "return_token_strs": true});
    let mut answer = post_to(addr, "/tokenize", &[], body.to_string().as_bytes());
    assert_eq!(answer.status, 200);
    let answer = answer.json();
    assert_eq!(answer["tokens"], json!(text_ids));
    assert_eq!(answer["count"], text_ids.len());
    assert_eq!(
        answer["token_strs"].as_array().map(Vec::len),
        Some(text_ids.len())
    );

    let body = json!({"model": MODEL, "tokens": text_ids});
    let mut answer = post_to(addr, "/detokenize", &[], body.to_string().as_bytes());
    assert_eq!(answer.status, 200);
    let prompt = answer.json()["prompt"]
        .as_str()
        .expect("a prompt")
        .to_string();
    assert!(prompt.ends_with(text), "{prompt:?}");

    // vLLM's refusals: another model, a form the simulation does not render.
    let other = json!({"model": "other", "prompt": text});
    let mut answer = post_to(addr, "/tokenize", &[], other.to_string().as_bytes());
    assert_eq!(answer.status, 404);
    assert_eq!(answer.json()["error"]["code"], 404);
    let unrendered = json!({"messages": messages, "add_generation_prompt": false});
    let answer = post_to(addr, "/tokenize", &[], unrendered.to_string().as_bytes());
    assert_eq!(answer.status, 400);

    // Faults: an engine without the route, one that stalls, one that breaks.
    server.inject_tokenize(Fault::Status(404), 1);
    let body = json!({"prompt": text}).to_string();
    assert_eq!(post_to(addr, "/tokenize", &[], body.as_bytes()).status, 404);
    server.inject_tokenize(Fault::Stall(Duration::from_millis(300)), 1);
    let started = Instant::now();
    assert_eq!(post_to(addr, "/tokenize", &[], body.as_bytes()).status, 200);
    assert!(started.elapsed() >= Duration::from_millis(300));
    server.inject_tokenize(Fault::BreakAfter(0), 1);
    let mut broken = post_to(addr, "/tokenize", &[], body.as_bytes());
    assert_eq!(broken.status, 200);
    assert!(broken.body().is_err(), "the body is cut short");
    assert_eq!(server.tokenize_requests(), 7);
    assert_eq!(server.requests(), 0, "tokenizing is not generating");
}
