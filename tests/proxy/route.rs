//! The route front end over real HTTP on 127.0.0.1: an in-process indexer with `[route]`, and
//! simulated engines whose OpenAI servers answer from their real prefix caches and publish the
//! KV events the indexer reads (`sim::openai`). Each test sends requests as a client would and
//! reads what the engines received, what the client got, `/loads` and `/metrics`.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::http_client::{get, metric_value, wait_for, Connection, Reply};
use crate::support::routed::{
    addr_of, fleet_toml, one_answered_and_released, rank_name, raw_engine, routed, routed_with,
    routing_to, warm_at, Routed, MODEL,
};
use crate::support::sse_client::{self, Answer};
use crate::support::start_service_with_select_clock;
use kv_indexer::select::Clock;
use kv_indexer_sim::fleet::{Fleet, RankRef};
use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::openai::{Fault, OpenAiConfig, TokensDetails};
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::tokenizer_dir;
use serde_json::{json, Value};

/// A chat of a few turns long enough to fill several 16-token blocks.
fn chat(topic: &str, stream: bool) -> Value {
    let long = format!("{topic}: ").repeat(120);
    json!({
        "model": MODEL,
        "messages": [
            { "role": "system", "content": format!("You answer questions about {topic}. {long}") },
            { "role": "user", "content": format!("Tell me about {topic}.") },
        ],
        "max_tokens": 4,
        "stream": stream,
    })
}

fn completion(topic: &str) -> Value {
    json!({
        "model": MODEL,
        "prompt": format!("Once upon a time, {topic}. ").repeat(80),
        "max_tokens": 3,
    })
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {answer}"))
}

/// The message of an OpenAI-shaped error (`{"error": {"message", "type", "code"}}`), whoever
/// answered it: the front end, the body reader, the head guard.
fn error_message(reply: &Reply) -> String {
    let body = reply.json();
    let error = &body["error"];
    assert!(
        error["type"].is_string() && error["code"] == json!(reply.status),
        "not an OpenAI error: {body}"
    );
    error["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message in {body}"))
        .to_owned()
}

#[test]
fn a_chat_and_a_completion_go_to_the_rank_holding_their_prefix_and_its_cache_is_reported() {
    let routed = routed(2, 2, OpenAiConfig::default(), &[]);
    let body = chat("lighthouses", false);
    routed.warm(1, 1, "/v1/chat/completions", &body);
    let before = routed.server(1).served_per_rank();
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 1).as_str())
    );
    let predicted: u64 = reply
        .header("x-kv-indexer-predicted-cached-tokens")
        .and_then(|n| n.parse().ok())
        .expect("the prediction header");
    let answer = reply.json();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    let cached = cached_tokens(&answer);
    assert!(
        cached > 0 && predicted > 0,
        "cached {cached}, predicted {predicted}"
    );
    assert_eq!(
        predicted, cached,
        "the index predicts what the engine finds"
    );
    let after = routed.server(1).served_per_rank();
    assert_eq!(after[1], before[1] + 1, "{before:?} → {after:?}");
    let seen = routed.server(1).last_request().expect("a request");
    assert_eq!(seen.header("x-data-parallel-rank"), Some("1"));

    let body = completion("a dragon slept");
    routed.warm(0, 1, "/v1/completions", &body);
    let reply = routed.send("/v1/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(0, 1).as_str())
    );
    assert!(cached_tokens(&reply.json()) > 0);
    routed.all_released("two answers");

    // The engines' reports are the ladder: predicted against reported, per rank.
    let reported = routed
        .metric("kv_indexer_route_reported_cached_tokens_total{instance=\"sim-1\",dp_rank=\"1\"}");
    let predicted_total = routed
        .metric("kv_indexer_route_predicted_cached_tokens_total{instance=\"sim-1\",dp_rank=\"1\"}");
    assert_eq!(reported, cached as f64);
    assert_eq!(predicted_total, predicted as f64);
    let ratio = routed.metric("kv_indexer_route_cache_hit_ratio{instance=\"sim-1\",dp_rank=\"1\"}");
    assert!(ratio > 0.0 && ratio <= 1.0, "{ratio}");
}

#[test]
fn a_prompt_without_a_tokenizer_is_routed_by_load_and_says_so() {
    let routed = routed(1, 2, OpenAiConfig::default(), &[]);
    let body = json!({ "model": MODEL, "prompt": ["one", "two"], "max_tokens": 1 });
    let reply = routed.send("/v1/completions", &body);
    // The engine refuses a batch or answers it; either way the front end says how it chose.
    let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
    assert!(routing.starts_with("load only: "), "{:?}", reply.headers);
    routed.all_released("a load-only request");
}

/// A streamed request through the front end, its answer's head read.
fn stream(addr: SocketAddr, path: &str, body: &Value) -> Answer {
    sse_client::post(
        addr,
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// Every event left of `answer`, `[DONE]` included; an error if the stream was cut.
fn rest(answer: &mut Answer) -> std::io::Result<Vec<String>> {
    let mut events = Vec::new();
    while let Some(event) = answer.next_event()? {
        events.push(event);
    }
    Ok(events)
}

#[test]
fn a_stream_is_passed_on_chunk_by_chunk_and_the_usage_chunk_only_when_asked() {
    let slow = OpenAiConfig {
        inter_token: Duration::from_millis(150),
        ..OpenAiConfig::default()
    };
    let routed = routed(1, 2, slow, &[]);
    let mut body = chat("tides", true);
    body["max_tokens"] = json!(6);
    let mut answer = stream(routed.route, "/v1/chat/completions", &body);
    assert_eq!(answer.status, 200);
    let first = answer
        .next_event()
        .expect("a stream")
        .expect("a first event");
    assert!(first.contains("chat.completion.chunk"), "{first:?}");
    // The client has the first chunk while the engine is still producing the rest.
    assert_eq!(
        routed.server(0).open_streams(),
        1,
        "the engine is still streaming"
    );
    let events = rest(&mut answer).expect("a whole stream");
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(events.len() >= 6, "one event a token: {events:?}");
    let all = events.concat();
    assert!(
        !all.contains("\"choices\":[]"),
        "the injected usage chunk is stripped: {all}"
    );
    let sent = routed.server(0).last_request().expect("a request");
    let sent: Value = serde_json::from_slice(&sent.body).expect("JSON");
    assert_eq!(
        sent["stream_options"]["include_usage"], true,
        "asked of the engine"
    );
    routed.all_released("a stream");
    let reported = routed
        .metric("kv_indexer_route_prompt_tokens_total{instance=\"sim-0\",dp_rank=\"0\"}")
        + routed.metric("kv_indexer_route_prompt_tokens_total{instance=\"sim-0\",dp_rank=\"1\"}");
    assert!(reported > 0.0, "the usage chunk was read");

    // A client that asks for usage gets the chunk.
    body["stream_options"] = json!({ "include_usage": true });
    let mut answer = stream(routed.route, "/v1/chat/completions", &body);
    let all = rest(&mut answer).expect("a whole stream").concat();
    assert!(
        all.contains("\"choices\":[]") && all.contains("cached_tokens"),
        "{all}"
    );
    routed.all_released("a stream with usage");
}

#[test]
fn every_ending_releases_the_reservation() {
    let slow = OpenAiConfig {
        inter_token: Duration::from_millis(100),
        ..OpenAiConfig::default()
    };
    let routed = routed(1, 1, slow, &[("first_byte_timeout_s", "1")]);
    let server = routed.server(0);

    // The client goes away mid-stream: the engine's request is cancelled too.
    let mut body = chat("the client leaves", true);
    body["max_tokens"] = json!(50);
    let mut answer = stream(routed.route, "/v1/chat/completions", &body);
    answer
        .next_event()
        .expect("a stream")
        .expect("a first event");
    let gone_before = server.disconnects();
    drop(answer);
    wait_for(10, "the engine to see its client go", || {
        (server.disconnects() > gone_before).then_some(())
    });
    routed.all_released("a client gone");

    // The engine breaks the stream after a few chunks: the client's stream ends as broken.
    server.inject(Fault::BreakAfter(2), 1);
    let mut answer = stream(routed.route, "/v1/chat/completions", &body);
    assert_eq!(answer.status, 200);
    assert!(rest(&mut answer).is_err(), "the client sees the stream cut");
    routed.all_released("an upstream error mid-stream");
    assert!(routed.metric("kv_indexer_route_requests_total{outcome=\"cut\"}") >= 1.0);

    // No first byte within first_byte_timeout_s: 504, naming the rank.
    server.inject(Fault::Stall(Duration::from_secs(3)), 1);
    let reply = routed.send("/v1/completions", &completion("a stall"));
    assert_eq!(reply.status, 504, "{}", reply.text());
    assert!(
        error_message(&reply).contains("first_byte_timeout_s"),
        "{}",
        reply.text()
    );
    routed.all_released("a timeout");
    server.clear_faults();
    // The rank that timed out is left out for its back-off (1 s): past it, it is chosen again.
    routed.clock.advance(Duration::from_secs(1));

    // Done, whole and streamed.
    assert_eq!(
        routed.send("/v1/completions", &completion("done")).status,
        200
    );
    let mut answer = stream(routed.route, "/v1/chat/completions", &chat("done", true));
    rest(&mut answer).expect("a whole stream");
    routed.all_released("answers that ended");
}

/// The `kv_indexer_route_rank_excluded` gauge of `engine`'s rank `rank`.
fn excluded(routed: &Routed, engine: usize, rank: u32) -> f64 {
    routed.metric(&format!(
        "kv_indexer_route_rank_excluded{{instance=\"{}\",dp_rank=\"{rank}\"}}",
        Fleet::name(engine)
    ))
}

#[test]
fn a_server_that_cannot_be_reached_takes_out_every_rank_behind_it_until_it_passes_a_check() {
    let routed = routed(2, 2, OpenAiConfig::default(), &[("health_interval_s", "1")]);
    let body = chat("harbours", false);
    routed.warm(0, 0, "/v1/chat/completions", &body);
    // sim-0 holds the prefix, and its server is gone: the retry goes to the other server,
    // not to sim-0's other rank.
    routed.server(0).stop_listening().expect("stop listening");
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    let chosen = reply.header("x-kv-indexer-rank").unwrap_or_default();
    assert!(chosen.starts_with("sim-1/"), "{chosen}");
    assert_eq!(routed.metric("kv_indexer_route_retries_total"), 1.0);
    assert_eq!(
        (excluded(&routed, 0, 0), excluded(&routed, 0, 1)),
        (1.0, 1.0)
    );
    assert_eq!(
        (excluded(&routed, 1, 0), excluded(&routed, 1, 1)),
        (0.0, 0.0)
    );
    let workers = get(routed.api, "/workers").json();
    let e0 = workers
        .as_array()
        .and_then(|engines| engines.iter().find(|e| e["instance"] == "sim-0"))
        .expect("sim-0 on /workers");
    for rank in 0..2 {
        let left = e0["listeners"][rank]["route_backoff_ms"]
            .as_u64()
            .expect("a back-off");
        assert!(left > 0 && left <= 1_000, "{left}");
    }
    // Left out, so no request tries it again.
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(routed.metric("kv_indexer_route_retries_total"), 1.0);
    // Its health checks fail meanwhile, and its first passing one readmits every rank behind
    // it (the selection's clock stands still: only the check can).
    routed.server(0).resume_listening().expect("listen again");
    wait_for(
        10,
        "sim-0's ranks to be readmitted by a health check",
        || (excluded(&routed, 0, 0) == 0.0 && excluded(&routed, 0, 1) == 0.0).then_some(()),
    );
    let served_before = routed.server(0).requests();
    for topic in ["north", "south", "east", "west"] {
        let reply = routed.send("/v1/completions", &completion(topic));
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert!(
        routed.server(0).requests() > served_before,
        "sim-0 is routed again"
    );
    routed.all_released("retries");
}

#[test]
fn a_502_or_503_backs_off_its_server_and_goes_to_another_and_a_500_is_passed_on() {
    let routed = routed(2, 1, OpenAiConfig::default(), &[("health_interval_s", "0")]);
    let body = chat("harbours", false);
    routed.warm(0, 0, "/v1/chat/completions", &body);
    let served = |engine| routed.server(engine).requests();
    let retries = || routed.metric("kv_indexer_route_retries_total");
    let before = (served(0), served(1));
    // The server took no work: the request goes to the other one, and sim-0 is backed off.
    routed.server(0).inject(Fault::Status(503), 1);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 0).as_str())
    );
    assert_eq!(retries(), 1.0);
    assert_eq!((served(0), served(1)), (before.0 + 1, before.1 + 1));
    assert_eq!(excluded(&routed, 0, 0), 1.0, "a 503 backs its server off");
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 0).as_str()),
        "left out though it holds the prefix"
    );
    // Readmitted once its back-off is over. A 500 may have done the work: passed on, never
    // sent again, and nobody is backed off.
    routed.clock.advance(Duration::from_secs(1));
    routed.server(0).inject(Fault::Status(500), 1);
    routed.server(1).inject(Fault::Status(500), 1);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 500, "{}", reply.text());
    assert_eq!(retries(), 1.0);
    let chosen = reply.header("x-kv-indexer-rank").unwrap_or_default();
    let engine = usize::from(chosen == rank_name(1, 0));
    assert_eq!(excluded(&routed, engine, 0), 0.0);
    routed.server(0).clear_faults();
    routed.server(1).clear_faults();
    // Both servers answer 503: the second's answer reaches the client.
    routed.server(0).inject(Fault::Status(503), 1);
    routed.server(1).inject(Fault::Status(503), 1);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(reply.header("x-kv-indexer-rank").is_some());
    assert_eq!(retries(), 2.0);
    routed.server(0).clear_faults();
    routed.server(1).clear_faults();
    // Both servers refuse: the request goes to each once (never delivered), then 502; with
    // both out, 503.
    routed.server(0).stop_listening().expect("stop listening");
    routed.server(1).stop_listening().expect("stop listening");
    routed.clock.advance(Duration::from_secs(60));
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 502, "{}", reply.text());
    assert!(
        error_message(&reply).contains("cannot be reached"),
        "{}",
        reply.text()
    );
    assert_eq!(retries(), 3.0);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(
        error_message(&reply).contains("no engine server can take"),
        "{}",
        reply.text()
    );
    routed.all_released("failures");
}

#[test]
fn a_rank_whose_event_link_is_down_is_routed_by_load_alone_and_says_so() {
    // sim-1's events are looked for where nothing publishes; its OpenAI server answers.
    let dead_port = crate::support::free_port();
    let routed = routed_with(
        2,
        1,
        OpenAiConfig::default(),
        &[],
        &|i, engine| match i {
            1 => EngineToml {
                zmq_port: dead_port,
                ..engine
            },
            _ => engine,
        },
        "/health",
    );
    wait_for(30, "sim-0 to be active", || {
        let workers = get(routed.api, "/workers").json();
        let e0 = workers
            .as_array()?
            .iter()
            .find(|e| e["instance"] == "sim-0")?
            .clone();
        (e0["listeners"][0]["state"] == "active").then_some(())
    });
    assert_eq!(
        get(routed.api, "/ready").status,
        503,
        "sim-1 is not indexed"
    );
    let mut reasons = Vec::new();
    for topic in ["one", "two", "three", "four"] {
        let reply = routed.send("/v1/completions", &completion(topic));
        assert_eq!(reply.status, 200, "{}", reply.text());
        if reply.header("x-kv-indexer-rank") == Some(rank_name(1, 0).as_str()) {
            reasons.push(
                reply
                    .header("x-kv-indexer-routing")
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
    }
    assert!(!reasons.is_empty(), "cold prompts spread over both ranks");
    for reason in &reasons {
        assert_eq!(reason, "load only: rank sim-1/0: its event link is down");
    }
    assert_eq!(
        routed.metric("kv_indexer_route_load_only_total{reason=\"event_link_down\"}"),
        reasons.len() as f64
    );
    routed.all_released("answers");
}

#[test]
fn refusals_are_json_errors_naming_their_cause() {
    let token = tempfile::NamedTempFile::new().expect("token file");
    std::fs::write(token.path(), "s3cret\n").expect("write the token");
    let path = format!("'{}'", token.path().display());
    let slow = OpenAiConfig {
        inter_token: Duration::from_millis(200),
        ..OpenAiConfig::default()
    };
    let routed = routed(
        1,
        1,
        slow,
        &[("auth_token_file", &path), ("max_concurrent_requests", "1")],
    );
    let authorized = [
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer s3cret"),
    ];
    let send = |path: &str, headers: &[(&str, &str)], body: &[u8]| {
        Connection::open(routed.route).send_with("POST", path, headers, Some(body))
    };
    let body = completion("refusals").to_string();
    let reply = send("/v1/completions", &[], body.as_bytes());
    assert_eq!(reply.status, 401, "{}", reply.text());
    assert!(error_message(&reply).contains("Authorization: Bearer"));
    let reply = send("/v1/completions", &authorized, b"{\"prompt\": 3}");
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert!(
        error_message(&reply).contains("`prompt`"),
        "{}",
        reply.text()
    );
    let reply = send("/v1/chat/completions", &authorized, b"not json");
    assert_eq!(reply.status, 400);
    let huge = vec![b' '; (16 << 20) + 1];
    let reply = send("/v1/completions", &authorized, &huge);
    assert_eq!(reply.status, 413, "{}", reply.text());
    assert!(error_message(&reply).contains("limit"), "{}", reply.text());
    let reply = send("/sleep", &authorized, body.as_bytes());
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert!(error_message(&reply).contains("/sleep"));
    let reply =
        Connection::open(routed.route).send_with("GET", "/v1/completions", &authorized, None);
    assert_eq!(reply.status, 405, "{}", reply.text());
    assert!(error_message(&reply).contains("POST"), "{}", reply.text());
    let long = "x".repeat(20 << 10);
    let reply = send("/v1/completions", &[("X-Long", &long)], body.as_bytes());
    assert_eq!(reply.status, 431, "{}", reply.text());
    error_message(&reply);
    let reply = send(
        &format!("/v1/completions?{long}"),
        &authorized,
        body.as_bytes(),
    );
    assert_eq!(reply.status, 414, "{}", reply.text());
    error_message(&reply);
    // A model no engine serves is the client's mistake: 404 `model_not_found`, not a 5xx it
    // would retry.
    let unknown = json!({ "model": "nobody-serves-it", "prompt": "x" }).to_string();
    let reply = send("/v1/completions", &authorized, unknown.as_bytes());
    assert_eq!(reply.status, 404, "{}", reply.text());
    let error = &reply.json()["error"];
    assert_eq!(
        (&error["code"], &error["type"]),
        (&json!("model_not_found"), &json!("invalid_request_error"))
    );
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|message| message.contains("nobody-serves-it")),
        "{}",
        reply.text()
    );
    let models = Connection::open(routed.route).send_with("GET", "/v1/models", &authorized, None);
    assert_eq!(models.json()["data"][0]["id"], MODEL);

    // One request in flight (a slow stream): the next is 429.
    let mut stream_body = chat("busy", true);
    stream_body["max_tokens"] = json!(20);
    let streaming = sse_client::post(
        routed.route,
        "/v1/chat/completions",
        &authorized,
        stream_body.to_string().as_bytes(),
    );
    assert_eq!(streaming.status, 200);
    let reply = send("/v1/completions", &authorized, body.as_bytes());
    assert_eq!(reply.status, 429, "{}", reply.text());
    assert!(error_message(&reply).contains("max_concurrent_requests"));
    drop(streaming);
    routed.all_released("refusals");
}

#[test]
fn a_connection_past_the_cap_is_refused_as_an_openai_error() {
    // 512 held connections are 1,024 descriptors in this process (both ends).
    kv_indexer::registry::raise_open_files_limit().expect("raising RLIMIT_NOFILE");
    // The cap is twice max_concurrent_requests, at least the API's 512.
    let routed = routed(
        1,
        1,
        OpenAiConfig::default(),
        &[("max_concurrent_requests", "1")],
    );
    let held: Vec<Connection> = (0..kv_indexer::serve::MAX_CONNECTIONS)
        .map(|_| Connection::open(routed.route))
        .collect();
    // Until the server has admitted every held connection, a probe is answered and closed.
    let reply = wait_for(60, "a connection past the cap to be refused", || {
        let reply = Connection::open(routed.route).send_with("GET", "/health", &[], None);
        (reply.status == 503).then_some(reply)
    });
    assert!(
        error_message(&reply).contains("connections are open"),
        "{}",
        reply.text()
    );
    drop(held);
}

#[test]
fn hop_by_hop_and_proxy_headers_stay_behind_and_host_is_the_engines() {
    let routed = routed(1, 1, OpenAiConfig::default(), &[]);
    let body = completion("headers").to_string();
    let reply = Connection::open(routed.route).send_with(
        "POST",
        "/v1/completions",
        &[
            ("Content-Type", "application/json"),
            ("Connection", "keep-alive, X-Private"),
            ("X-Private", "1"),
            ("Proxy-Authorization", "Basic eA=="),
            ("X-Forwarded-For", "10.1.2.3"),
            ("X-data-parallel-rank", "7"),
            ("Authorization", "Bearer the-clients-own"),
            ("X-Custom", "kept"),
        ],
        Some(body.as_bytes()),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = routed.server(0).last_request().expect("a request");
    for gone in [
        "x-private",
        "proxy-authorization",
        "x-forwarded-for",
        "connection",
        "authorization",
    ] {
        assert_eq!(seen.header(gone), None, "{gone} reached the engine");
    }
    assert_eq!(seen.header("x-custom"), Some("kept"));
    assert_eq!(
        seen.header("x-data-parallel-rank"),
        Some("0"),
        "the front end's rank"
    );
    let url = routed.server(0).url();
    assert_eq!(seen.header("host"), url.strip_prefix("http://"));
    routed.all_released("one answer");
    drop(routed.running);
}

/// A stream that outlasts the server's 30 s idle timeout (`http::IDLE_TIMEOUT`) three times
/// arrives whole: 90 tokens a second apart, every chunk. The idle deadline is for a connection
/// waiting for its next request, never for one whose answer is being written.
#[test]
fn a_90_s_stream_arrives_whole() {
    let slow = OpenAiConfig {
        inter_token: Duration::from_secs(1),
        ..OpenAiConfig::default()
    };
    let routed = routed(1, 1, slow, &[]);
    let mut body = chat("a long story", true);
    body["max_tokens"] = json!(90);
    let mut answer = stream(routed.route, "/v1/chat/completions", &body);
    assert_eq!(answer.status, 200);
    let events = rest(&mut answer).expect("the whole stream, not a cut one");
    assert_every_token(&events, 90);
}

/// A whole answer whose engine takes 45 s to its first token arrives: no deadline of the
/// server runs while an answer is being produced (the front end's is `first_byte_timeout_s`).
#[test]
fn a_whole_answer_after_45_s_arrives() {
    let thinking = OpenAiConfig {
        first_token_floor: Duration::from_secs(45),
        ..OpenAiConfig::default()
    };
    let routed = routed(1, 1, thinking, &[]);
    let body = chat("a hard question", false);
    let mut answer = sse_client::send_timed(
        routed.route,
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
        Duration::from_secs(70),
    )
    .expect("an answer after 45 s, not a closed connection");
    assert_eq!(answer.status, 200);
    let answer = answer.json();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4, "{answer}");
}

/// The real binary routing from a port of its own to one engine of `routed`'s, `/ready`.
struct RoutedProcess {
    process: IndexerProcess,
    route: SocketAddr,
    _fleet: Fleet,
    _tokenizers: tempfile::TempDir,
}

impl RoutedProcess {
    fn start(openai: OpenAiConfig, keys: &[(&str, &str)]) -> RoutedProcess {
        let route = SocketAddr::from(([127, 0, 0, 1], crate::support::free_port()));
        let (fleet, toml, tokenizers) =
            fleet_toml(1, 1, openai, &route.to_string(), keys, &|_, engine| engine);
        let process = crate::support::start_indexer(&toml);
        wait_for(30, "every rank to be active", || {
            (get(process.address, "/ready").status == 200).then_some(())
        });
        RoutedProcess {
            process,
            route,
            _fleet: fleet,
            _tokenizers: tokenizers,
        }
    }

    /// A chat of `tokens` streamed through the front end, its first event read.
    fn open_stream(&self, tokens: u32) -> Answer {
        let mut body = chat("a story told while stopping", true);
        body["max_tokens"] = json!(tokens);
        let mut answer = stream(self.route, "/v1/chat/completions", &body);
        assert_eq!(answer.status, 200);
        let first = answer.next_event().expect("a stream").expect("an event");
        assert!(first.contains("chat.completion.chunk"), "{first:?}");
        answer
    }

    /// SIGTERM, then the drain begun: `/ready` answers 503.
    fn begin_drain(&mut self) {
        let api = self.process.address;
        self.process.signal(libc::SIGTERM).expect("SIGTERM");
        wait_for(2, "/ready to answer 503", || {
            (get(api, "/ready").status == 503).then_some(())
        });
    }

    fn exits_0(&mut self, within: Duration) {
        let (status, _) = self
            .process
            .wait_exit(within)
            .unwrap_or_else(|error| panic!("{error:#}\n{}", self.process.log()));
        assert!(status.success(), "{status}\n{}", self.process.log());
    }
}

/// Every token of a chat stream of `tokens` arrived, a chunk each, the last with the finish
/// reason, then `[DONE]`.
fn assert_every_token(events: &[String], tokens: usize) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let contents: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|event| serde_json::from_str::<Value>(event).expect("a JSON chunk"))
        .filter(|chunk| {
            let content = chunk["choices"][0]["delta"]["content"].as_str();
            content.is_some_and(|content| !content.is_empty())
        })
        .collect();
    assert_eq!(contents.len(), tokens, "one chunk a token: {events:?}");
    assert_eq!(
        contents[tokens - 1]["choices"][0]["finish_reason"],
        "length"
    );
}

/// SIGTERM while a stream is open: `/ready` answers 503 at once, the route listener refuses a
/// new connection, the open stream arrives whole, and then the process exits 0.
#[test]
fn sigterm_drains_the_open_stream_then_exits() {
    let slow = OpenAiConfig {
        inter_token: Duration::from_millis(250),
        ..OpenAiConfig::default()
    };
    let mut routed = RoutedProcess::start(slow, &[("drain_s", "30")]);
    let mut answer = routed.open_stream(16);
    routed.begin_drain();
    wait_for(2, "the route listener to refuse a connection", || {
        let refused = std::net::TcpStream::connect(routed.route)
            .is_err_and(|err| err.kind() == std::io::ErrorKind::ConnectionRefused);
        refused.then_some(())
    });
    let events = rest(&mut answer).expect("the whole stream, not a cut one");
    assert_every_token(&events, 16);
    routed.exits_0(Duration::from_secs(10));
    let log = routed.process.log();
    assert!(
        log.contains("draining 1 open requests for up to 30s"),
        "{log}"
    );
    assert!(log.contains("drained in"), "{log}");
}

/// A stream longer than `drain_s` is cut when the drain's time is up, and the process exits.
#[test]
fn a_stream_longer_than_the_drain_is_cut_at_drain_s_then_the_process_exits() {
    let slow = OpenAiConfig {
        inter_token: Duration::from_millis(500),
        ..OpenAiConfig::default()
    };
    let mut routed = RoutedProcess::start(slow, &[("drain_s", "2")]);
    let mut answer = routed.open_stream(60);
    let stopped = std::time::Instant::now();
    routed.process.signal(libc::SIGTERM).expect("SIGTERM");
    let cut = rest(&mut answer);
    let after = stopped.elapsed();
    assert!(cut.is_err(), "a 30 s stream ended whole: {cut:?}");
    assert!(
        (Duration::from_secs(2)..Duration::from_secs(6)).contains(&after),
        "cut {after:?} after SIGTERM"
    );
    routed.exits_0(Duration::from_secs(10));
    let log = routed.process.log();
    assert!(
        log.contains("drain ended at 2s; 1 connections cut"),
        "{log}"
    );
}

/// The heads hyper would answer with a bare 400 are OpenAI errors on the route listener,
/// naming their cause: a second `Content-Length`, obsolete line folding, a bad request line or
/// header name, a head too large; and a head pipelined behind a request is refused the same
/// way, after the first request's answer.
#[test]
fn malformed_heads_are_openai_errors_naming_their_cause() {
    let routed = routed(1, 1, OpenAiConfig::default(), &[]);
    let huge = format!(
        "GET /health HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(kv_indexer::serve::MAX_HEAD_BYTES)
    );
    let cases: [(&[u8], u16, &str); 6] = [
        (
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
            400,
            "more than one Content-Length",
        ),
        (
            b"GET /health HTTP/1.1\r\nX-A: a\r\n\tb\r\n\r\n",
            400,
            "obsolete line folding",
        ),
        (b"GET /health  HTTP/1.1\r\n\r\n", 400, "the request line"),
        (
            b"GET /health HTTP/1.1\r\nX A: 1\r\n\r\n",
            400,
            "header name",
        ),
        (b"GET /health HTTP/3.0\r\n\r\n", 505, "HTTP/3.0"),
        (huge.as_bytes(), 431, "request head over the limit"),
    ];
    for (head, status, cause) in cases {
        let mut connection = Connection::open(routed.route);
        connection.write_raw(head);
        let reply = connection.read_reply();
        let shown = String::from_utf8_lossy(&head[..head.len().min(80)]);
        assert_eq!(reply.status, status, "{shown:?}: {}", reply.text());
        let error = &reply.json()["error"];
        assert_eq!(error["code"], status, "{shown:?}: {error}");
        assert!(error["type"].is_string(), "{shown:?}: {error}");
        assert!(error_message(&reply).contains(cause), "{shown:?}: {error}");
    }
    let mut connection = Connection::open(routed.route);
    connection.write_raw(
        b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n\
          POST /v1/completions HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    );
    assert_eq!(connection.read_reply().status, 200, "the first request");
    let refused = connection.read_reply();
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert_eq!(refused.json()["error"]["type"], "invalid_request_error");
    assert!(error_message(&refused).contains("both Transfer-Encoding"));
    assert!(connection.closed_by_peer(), "closed after the refusal");
}

/// A second SIGTERM during the drain cuts it short: the open stream is cut at once, long before
/// `drain_s`, and the process exits 0.
#[test]
fn a_second_sigterm_cuts_the_drain_short() {
    let slow = OpenAiConfig {
        inter_token: Duration::from_millis(500),
        ..OpenAiConfig::default()
    };
    let mut routed = RoutedProcess::start(slow, &[("drain_s", "60")]);
    let mut answer = routed.open_stream(60);
    routed.begin_drain();
    let again = std::time::Instant::now();
    routed
        .process
        .signal(libc::SIGTERM)
        .expect("a second SIGTERM");
    assert!(rest(&mut answer).is_err(), "the stream was cut");
    assert!(
        again.elapsed() < Duration::from_secs(5),
        "{:?}",
        again.elapsed()
    );
    routed.exits_0(Duration::from_secs(10));
    let log = routed.process.log();
    assert!(log.contains("drain is cut short"), "{log}");
}

#[test]
fn an_engine_gets_its_own_api_key_rotated_on_reload_and_never_the_clients_token() {
    let dir = tempfile::tempdir().expect("temp dir");
    let token = dir.path().join("route-token");
    std::fs::write(&token, "clients-token\n").expect("write the token");
    let key = dir.path().join("engine-key");
    std::fs::write(&key, "engine-key-1\n").expect("write the key");
    let key_path = key.display().to_string();
    let token_value = format!("{:?}", token.display().to_string());
    let routed = routed_with(
        1,
        1,
        OpenAiConfig::default(),
        &[("auth_token_file", &token_value)],
        &|_, engine| EngineToml {
            api_key_file: Some(key_path.clone()),
            ..engine
        },
        "/ready",
    );
    let send = || {
        Connection::open(routed.route).send_with(
            "POST",
            "/v1/completions",
            &[
                ("Content-Type", "application/json"),
                ("Authorization", "Bearer clients-token"),
            ],
            Some(completion("keys").to_string().as_bytes()),
        )
    };
    let reply = send();
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = routed.server(0).last_request().expect("a request");
    assert_eq!(seen.header("authorization"), Some("Bearer engine-key-1"));
    // Rotated: the next request after a reload carries the new key.
    std::fs::write(&key, "engine-key-2\n").expect("rotate the key");
    let reload = Connection::open(routed.api).send("POST", "/reload", None);
    assert_eq!(reload.status, 200, "{}", reload.text());
    assert_eq!(send().status, 200);
    let seen = routed.server(0).last_request().expect("a request");
    assert_eq!(seen.header("authorization"), Some("Bearer engine-key-2"));
    // The reload's answer names what it changed of the front end, and what waits for a restart.
    let file = std::fs::read_to_string(routed.running.config_path()).expect("the file");
    let changed = file
        .replace("[route]\n", "[route]\nidle_timeout_s = 7\n")
        .replace("listen = \"127.0.0.1:0\"", "listen = \"127.0.0.1:1\"");
    std::fs::write(routed.running.config_path(), changed).expect("rewrite the file");
    let reload = Connection::open(routed.api).send("POST", "/reload", None);
    assert_eq!(reload.status, 200, "{}", reload.text());
    let answer = reload.json();
    assert_eq!(
        answer["route_changed"],
        json!(["[route] idle_timeout_s: 60 -> 7"]),
        "{answer}"
    );
    assert_eq!(
        answer["restart_pending"],
        json!([
            "[route] listen changed from 127.0.0.1:0 to 127.0.0.1:1; restart kv-indexer to \
             apply it (keeping 127.0.0.1:0)"
        ]),
        "{answer}"
    );
    // A key file that cannot be read refuses the reload whole; the key in effect stays.
    std::fs::remove_file(&key).expect("remove the key");
    let reload = Connection::open(routed.api).send("POST", "/reload", None);
    assert_ne!(reload.status, 200, "{}", reload.text());
    assert!(reload.text().contains("api_key_file"), "{}", reload.text());
    assert_eq!(send().status, 200);
    let seen = routed.server(0).last_request().expect("a request");
    assert_eq!(seen.header("authorization"), Some("Bearer engine-key-2"));
    routed.all_released("answers");
}

#[test]
fn a_whole_answer_is_passed_on_as_it_arrives_and_its_usage_read_on_the_way() {
    const FIRST: &[u8] =
        br#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"one half, "#;
    const REST: &[u8] = br#"then the other"}],"usage":{"prompt_tokens":3,"completion_tokens":5}}"#;
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        FIRST.len() + REST.len()
    );
    let first: &'static [u8] = [head.as_bytes(), FIRST].concat().leak();
    let (engine, go_on) = raw_engine([first, REST]);
    let running = routing_to(engine);
    let route = running.route_addr().expect("[route] is set");
    let body = json!({ "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5 }).to_string();
    let mut answer = sse_client::send_timed(
        route,
        "/v1/completions",
        &[],
        body.as_bytes(),
        Duration::from_secs(20),
    )
    .expect("the answer's head");
    assert_eq!(answer.status, 200);
    // The first half reaches the client while the engine holds the rest back: nothing is
    // collected before it is passed on.
    let mut got = Vec::new();
    while got.len() < FIRST.len() {
        got.extend_from_slice(&answer.read_some().expect("the first half"));
    }
    assert_eq!(got, FIRST);
    go_on.send(()).expect("the engine waits");
    got.extend_from_slice(&answer.body().expect("the rest"));
    assert_eq!(got, [FIRST, REST].concat());
    one_answered_and_released(running.http_addr());
}

#[test]
fn an_answer_that_breaks_before_its_first_byte_is_a_502_not_an_empty_reply() {
    const HEAD: &[u8] =
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    let (engine, go_on) = raw_engine([HEAD, b""]);
    let running = routing_to(engine);
    let route = running.route_addr().expect("[route] is set");
    let body = json!({ "model": MODEL, "prompt": [1, 2, 3] }).to_string();
    // The engine closes after its head: the body never comes.
    drop(go_on);
    let reply = Connection::open(route).send("POST", "/v1/completions", Some(body.as_bytes()));
    assert_eq!(reply.status, 502, "{}", reply.text());
    assert!(
        error_message(&reply).contains("broke before its first byte"),
        "{}",
        reply.text()
    );
    assert_eq!(reply.header("x-kv-indexer-rank"), Some("raw/0"));
}

/// What the front end does with each kind of chat: text content parts are tokenized as vLLM
/// renders them (the rank holding their prefix is chosen and predicted exactly); a tool-call
/// turn, a `tool` message or an image part is routed by load alone, saying why; only a body that
/// is not an OpenAI chat is a 400.
#[test]
fn every_valid_chat_is_routed_and_only_a_body_that_is_not_one_is_refused() {
    let routed = routed(1, 2, OpenAiConfig::default(), &[]);
    let long = "which rank holds the prefix of this conversation? ".repeat(30);
    let parts = json!({
        "model": MODEL,
        "messages": [
            { "role": "system", "content": [{ "type": "text", "text": long }] },
            { "role": "user", "content": [
                { "type": "text", "text": "Part one." },
                { "type": "text", "text": "Part two." },
            ] },
        ],
        "max_tokens": 2,
    });
    // The same chat with its text parts written as vLLM joins them: the same prompt to the
    // engine (which tokenizes as kv-indexer does) and to the index.
    let mut joined = parts.clone();
    joined["messages"][1]["content"] = json!("Part one.\nPart two.");
    routed.warm(0, 1, "/v1/chat/completions", &joined);
    let reply = routed.send("/v1/chat/completions", &parts);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(0, 1).as_str())
    );
    assert_eq!(
        reply.header("x-kv-indexer-routing"),
        None,
        "{:?}",
        reply.headers
    );
    let predicted: u64 = reply
        .header("x-kv-indexer-predicted-cached-tokens")
        .and_then(|n| n.parse().ok())
        .expect("the prediction header");
    assert!(predicted > 0);
    assert_eq!(predicted, cached_tokens(&reply.json()), "predicted exactly");
    routed.all_released("a chat of text parts");

    let user = json!({ "role": "user", "content": "What is the weather in Paris?" });
    let call = json!({ "role": "assistant", "content": null, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": { "name": "weather", "arguments": "{\"city\": \"Paris\"}" },
    }] });
    let tool = json!({ "role": "tool", "tool_call_id": "call_1", "content": "18 C" });
    let image = json!({ "role": "user", "content": [
        { "type": "text", "text": "What is this?" },
        { "type": "image_url", "image_url": { "url": "data:image/png;base64,AAAA" } },
    ] });
    let load_only = [
        (
            json!([user, call]),
            "load only: messages[1] is a tool-call turn",
        ),
        (
            json!([user, call, tool]),
            "load only: messages[1] is a tool-call turn",
        ),
        (
            json!([user, tool]),
            "load only: messages[1] is a tool message",
        ),
        (
            json!([image]),
            "load only: messages[0].content[1] is a \"image_url\" part",
        ),
    ];
    for (messages, why) in load_only {
        let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 2 });
        let reply = routed.send("/v1/chat/completions", &body);
        let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
        assert!(
            routing.starts_with(why),
            "{messages}: {:?} ({})",
            reply.headers,
            reply.text()
        );
        assert_eq!(
            reply.header("x-kv-indexer-predicted-cached-tokens"),
            Some("0")
        );
        let seen = routed.server(0).last_request().expect("the engine got it");
        let sent: Value = serde_json::from_slice(&seen.body).expect("a JSON body");
        assert_eq!(
            sent["messages"], messages,
            "the body reaches the engine as sent"
        );
    }
    routed.all_released("load-only chats");

    let refused: [(&[u8], &str); 7] = [
        (b"not json", "not a JSON object"),
        (br#"{"model": "chatml"}"#, "`messages` is missing"),
        (br#"{"model": "chatml", "messages": "hi"}"#, "messages: must be an array"),
        (br#"{"model": "chatml", "messages": [{"content": "hi"}]}"#, "messages[0].role: must be a string"),
        (br#"{"model": "chatml", "messages": [{"role": "user", "content": 7}]}"#, "messages[0].content: must be"),
        (br#"{"model": "chatml", "messages": [{"role": "user", "content": [{"text": "x"}]}]}"#, "messages[0].content[0].type: must be a string"),
        (br#"{"model": "chatml", "messages": [{"role": "user", "content": [{"type": "text"}]}]}"#, "messages[0].content[0].text: must be a string"),
    ];
    for (body, wanted) in refused {
        let reply = Connection::open(routed.route).send("POST", "/v1/chat/completions", Some(body));
        assert_eq!(reply.status, 400, "{}", reply.text());
        let message = error_message(&reply);
        assert!(message.contains(wanted), "{message:?}, wanted {wanted:?}");
    }
}

/// An engine's server (or a proxy before it) that answers 413 once it has read a request's
/// head, then closes, while the body is still on its way: the answer reaches the client, the
/// request is not sent again, and no rank is backed off.
#[test]
fn an_answer_before_the_whole_body_was_read_reaches_the_client() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let proxy = listener.local_addr().expect("address");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&accepted);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            let mut head = Vec::new();
            let mut buffer = [0u8; 4096];
            while memchr::memmem::find(&head, b"\r\n\r\n").is_none() {
                match stream.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buffer[..n]),
                }
            }
            let refusal = "{\"error\": \"request entity too large\"}";
            let answer = format!(
                "HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{refusal}",
                refusal.len()
            );
            let _ = stream.write_all(answer.as_bytes());
            // Dropped with the body unread: the close is a reset, as a proxy's is.
        }
    });

    let tokenizers = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(tokenizers.path()).expect("tokenizer directories");
    let chatml = tokenizers.path().join(MODEL);
    let fleet = Fleet::start_on_consecutive_ports(1, |_| SimConfig {
        dp_size: 1,
        block_size: 16,
        capacity_blocks: 4_096,
        seed: 0x34,
        ..SimConfig::default()
    })
    .expect("a simulated engine");
    let tomls: Vec<EngineToml> = fleet
        .engine_tomls()
        .into_iter()
        .map(|engine| EngineToml {
            model: Some(MODEL.into()),
            tokenizer: Some(chatml.display().to_string()),
            openai_url: Some(format!("http://{proxy}")),
            ..engine
        })
        .collect();
    // No health checks, no load scrapes: every connection the proxy accepts is the routed
    // request's.
    let toml = indexer_toml(None, 16, &tomls)
        + &route_table("127.0.0.1:0", &[("health_interval_s", "0")])
        + "\n[select]\nload_interval_ms = 0\n";
    let running = start_service_with_select_clock(&toml, Clock::manual());
    let (api, route) = (running.http_addr(), running.route_addr().expect("[route]"));
    wait_for(30, "the rank to be active", || {
        (get(api, "/ready").status == 200).then_some(())
    });

    // A 1 MiB body: far more than the sockets' buffers take before the proxy's close.
    let body = json!({
        "model": MODEL,
        "prompt": [1, 2, 3, 4],
        "max_tokens": 4,
        "user": "u".repeat(1 << 20),
    });
    let reply =
        Connection::open(route).send("POST", "/v1/completions", Some(body.to_string().as_bytes()));
    assert_eq!(reply.status, 413, "{}", reply.text());
    assert!(reply.text().contains("too large"), "{}", reply.text());
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "sent once");
    let retries = metric_value(api, "kv_indexer_route_retries_total");
    assert_eq!(retries.unwrap_or(0.0), 0.0, "not sent again");
    let excluded = "kv_indexer_route_rank_excluded{instance=\"sim-0\",dp_rank=\"0\"}";
    assert_eq!(
        metric_value(api, excluded).unwrap_or(0.0),
        0.0,
        "not backed off"
    );
    drop(running);
}

/// The README's demo chat, sent twice through the front end to simulated engines like the
/// demo's: longer than a block, so the second answer reports the prefix cached, as the README
/// says.
#[test]
fn the_readme_demo_chat_is_found_cached_the_second_time() {
    let readme = include_str!("../../README.md");
    let body = readme
        .lines()
        .find(|line| line.contains("localhost:8080/v1/chat/completions"))
        .and_then(|line| line.split_once("-d '"))
        .and_then(|(_, rest)| rest.strip_suffix('\''))
        .expect("the README's demo curl");
    let body: Value = serde_json::from_str(body).expect("the demo's body is JSON");
    assert_eq!(
        body["model"], MODEL,
        "the demo's model is the simulated engines'"
    );
    let routed = routed(2, 2, OpenAiConfig::default(), &[]);
    let first = routed.send("/v1/chat/completions", &body);
    assert_eq!(first.status, 200, "{}", first.text());
    // The engine's events reach the index before the next request is chosen.
    wait_for(10, "the first answer's blocks to be indexed", || {
        let query = json!({ "model": MODEL, "messages": body["messages"] });
        let answer =
            Connection::open(routed.api).send("POST", "/query", Some(query.to_string().as_bytes()));
        let scores = answer.json()["scores"].as_array()?.clone();
        (!scores.is_empty()).then_some(())
    });
    let second = routed.send("/v1/chat/completions", &body);
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(
        second.header("x-kv-indexer-rank"),
        first.header("x-kv-indexer-rank"),
        "the rank holding the prefix"
    );
    assert!(
        cached_tokens(&second.json()) >= 16,
        "at least a block cached: {}",
        second.text()
    );
}

/// An indexer whose one engine serves `MODEL` with a tokenizer whose `model_max_length` is
/// `context` (written into its `tokenizer_config.json`), and whose ranks never connect: a
/// prompt is judged before any rank is chosen.
fn front_with_context(context: u64) -> (RunningService, tempfile::TempDir) {
    let tokenizers = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(tokenizers.path()).expect("tokenizer directories");
    let chatml = tokenizers.path().join(MODEL);
    let config_path = chatml.join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("written"))
            .expect("JSON");
    config["model_max_length"] = json!(context);
    std::fs::write(&config_path, config.to_string()).expect("rewritten");
    let engine = EngineToml {
        model: Some(MODEL.into()),
        tokenizer: Some(chatml.display().to_string()),
        openai_url: Some("http://127.0.0.1:9".into()),
        ..EngineToml::new("sim-0", crate::support::free_port())
    };
    let toml = indexer_toml(None, 16, &[engine]) + &route_table("127.0.0.1:0", &[]);
    (crate::support::start_service(&toml), tokenizers)
}

/// A completion prompt of `bytes` bytes of plain words.
fn prompt_of(bytes: usize) -> String {
    "the cache holds the prefix of every prompt. "
        .repeat(bytes / 44 + 1)
        .chars()
        .take(bytes)
        .collect()
}

#[test]
fn a_prompt_past_its_models_context_is_413_naming_the_limit_on_the_route_and_the_api() {
    let (running, _dirs) = front_with_context(100);
    let route = running.route_addr().expect("[route] is set");
    let api = running.http_addr();
    let prompt = prompt_of(64 << 10);
    let completion = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1 });
    let reply = Connection::open(route).send(
        "POST",
        "/v1/completions",
        Some(completion.to_string().as_bytes()),
    );
    assert_eq!(reply.status, 413, "{}", reply.text());
    let message = error_message(&reply);
    assert!(
        message.contains("65536 bytes")
            && message.contains("100 tokens")
            && message.contains("model_max_length"),
        "{message}"
    );
    let chat = json!({ "model": MODEL, "messages": [{ "role": "user", "content": prompt }] });
    let reply = Connection::open(route).send(
        "POST",
        "/v1/chat/completions",
        Some(chat.to_string().as_bytes()),
    );
    assert_eq!(reply.status, 413, "a chat: {}", reply.text());
    // The API's own shape, the same limit.
    for path in ["/query", "/select"] {
        let body = json!({ "model": MODEL, "prompt": prompt });
        let reply = Connection::open(api).send("POST", path, Some(body.to_string().as_bytes()));
        assert_eq!(reply.status, 413, "{path}: {}", reply.text());
        let message = reply.json()["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(message.contains("100 tokens"), "{path}: {message}");
    }
    // A prompt within the limit is tokenized (and, its engine being down, refused later).
    let short = json!({ "model": MODEL, "prompt": "the cache holds the prefix", "max_tokens": 1 });
    let reply = Connection::open(route).send(
        "POST",
        "/v1/completions",
        Some(short.to_string().as_bytes()),
    );
    assert!(reply.status >= 500, "{}", reply.text());
}

/// Sends `count` copies of `body` to `path` on `addr` at once; their answers.
/// `bytes` of words no two prompts (`seed`) and no two places in one share, so that no span
/// of one is tokenized from the cache.
fn unique_prompt(bytes: usize, seed: usize) -> String {
    let mut prompt = String::with_capacity(bytes + 32);
    let mut word = 0;
    while prompt.len() < bytes {
        prompt.push_str(&format!("w{seed}x{word} "));
        word += 1;
    }
    prompt.truncate(bytes);
    prompt
}

/// Each of `bodies` sent at once, each by a client of its own.
fn at_once(addr: SocketAddr, path: &'static str, bodies: Vec<Value>) -> Vec<Reply> {
    let sent: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let body = body.to_string();
            std::thread::spawn(move || {
                let mut connection = Connection::open(addr);
                connection.set_read_timeout(Duration::from_secs(120));
                connection.send("POST", path, Some(body.as_bytes()))
            })
        })
        .collect();
    sent.into_iter()
        .map(|client| client.join().expect("a client"))
        .collect()
}

/// Tokenizing admits 2 MiB of prompts at once and a prompt waits for it 2 s: of six distinct
/// 1.5 MiB prompts at once (each of which takes far longer than 2 s / 6 to tokenize, none from
/// the cache), one is tokenized
/// at a time and the last ones are refused 429, saying why, on the route and the API alike. A
/// prompt over the whole budget is never tokenized: the API answers 413 naming the budget.
#[test]
fn past_the_tokenizing_budget_prompts_wait_then_get_429_and_a_prompt_over_it_413() {
    let (running, _dirs) = front_with_context(1_000_000);
    let route = running.route_addr().expect("[route] is set");
    let api = running.http_addr();
    let prompts: Vec<String> = (0..12).map(|seed| unique_prompt(3 << 19, seed)).collect();

    let completions = prompts[..6]
        .iter()
        .map(|prompt| json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1 }))
        .collect();
    let replies = at_once(route, "/v1/completions", completions);
    let statuses: Vec<u16> = replies.iter().map(|reply| reply.status).collect();
    // A tokenized prompt reaches no engine (5xx); the others wait and are refused.
    let tokenized = statuses.iter().filter(|&&status| status >= 500).count();
    assert!(
        statuses
            .iter()
            .all(|&status| status == 429 || status >= 500),
        "{statuses:?}"
    );
    assert!(tokenized >= 1, "one was tokenized: {statuses:?}");
    let refused = replies
        .iter()
        .find(|reply| reply.status == 429)
        .unwrap_or_else(|| panic!("none refused: {statuses:?}"));
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error");
    assert_eq!(refused.header("retry-after"), Some("1"));
    let message = error_message(refused);
    assert!(
        message.contains("tokenizing") && message.contains("2097152 bytes"),
        "{message}"
    );

    let queries = prompts[6..]
        .iter()
        .map(|prompt| json!({ "model": MODEL, "prompt": prompt }))
        .collect();
    let replies = at_once(api, "/query", queries);
    let statuses: Vec<u16> = replies.iter().map(|reply| reply.status).collect();
    assert!(
        statuses
            .iter()
            .all(|&status| status == 429 || status == 200),
        "{statuses:?}"
    );
    assert!(
        statuses.contains(&200) && statuses.contains(&429),
        "{statuses:?}"
    );

    let over = json!({ "model": MODEL, "prompt": prompt_of(3 << 20) });
    let reply = Connection::open(api).send("POST", "/query", Some(over.to_string().as_bytes()));
    assert_eq!(reply.status, 413, "{}", reply.text());
    let message = reply.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("tokenizing budget of 2097152 bytes"),
        "{message}"
    );
}

/// A chat of `count` messages of about 1.5 KB, each its own words (`seed`): a long prompt in
/// many pieces, none of them in the tokenizer's cache of another seed's.
fn long_chat(seed: &str, count: usize) -> Value {
    let messages: Vec<Value> = (0..count)
        .map(|at| {
            let content = format!("{seed} {at}: the cache holds the prefix of prompt {at}. ")
                .repeat(1_500 / (40 + seed.len()));
            let role = if at % 2 == 0 { "user" } else { "assistant" };
            json!({ "role": role, "content": content })
        })
        .collect();
    json!({ "model": MODEL, "messages": messages, "max_tokens": 1 })
}

/// A client that goes away stops its tokenizing at its next step: the chat's render runs on,
/// its pieces are not encoded, and the gate's budget is free long before the whole chat would
/// have been tokenized (`kv_indexer_tokenizing_bytes`).
#[test]
fn a_client_that_goes_away_stops_its_tokenizing_at_its_next_step() {
    let (running, _dirs) = front_with_context(1_000_000);
    let route = running.route_addr().expect("[route] is set");
    let api = running.http_addr();
    let taken = || metric_value(api, "kv_indexer_tokenizing_bytes").unwrap_or(0.0);
    let chat = long_chat("alpha", 1_000).to_string();
    let started = std::time::Instant::now();
    let mut whole_chat = Connection::open(route);
    // The whole chat, tokenized by a debug build on a loaded machine, can take longer than the
    // kit's 10 s: this request measures how long, it must not time out.
    whole_chat.set_read_timeout(std::time::Duration::from_secs(120));
    let reply = whole_chat.send("POST", "/v1/chat/completions", Some(chat.as_bytes()));
    let whole = started.elapsed();
    assert!(
        reply.status >= 500,
        "tokenized, then no engine: {}",
        reply.text()
    );
    assert_eq!(taken(), 0.0, "the budget is given back");

    // The front end, and `/query` on the API (whose routes run on blocking threads).
    for (addr, path, seed) in [
        (route, "/v1/chat/completions", "omega"),
        (api, "/query", "sigma"),
    ] {
        let chat = long_chat(seed, 1_000).to_string();
        let mut client = Connection::open(addr);
        client.write_raw(
            format!(
                "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{chat}",
                chat.len()
            )
            .as_bytes(),
        );
        wait_for(30, "the chat to be admitted", || {
            (taken() > 0.0).then_some(())
        });
        let gone = std::time::Instant::now();
        drop(client);
        wait_for(30, "the budget to be given back", || {
            (taken() == 0.0).then_some(())
        });
        let stopped = gone.elapsed();
        eprintln!("{path}: stopped {stopped:?} after the client went; whole {whole:?}");
        assert!(
            stopped < whole / 2,
            "{path}: stopped {stopped:?} after the client went; the whole takes {whole:?}"
        );
    }
}

/// A completion no other shares a block of: `topic` begins it.
fn cold(topic: &str) -> Value {
    json!({
        "model": MODEL,
        "prompt": format!("{topic} is a word of its own. ").repeat(40),
        "max_tokens": 3,
    })
}

/// `GET /loads`' entry of engine `engine`'s rank 0.
fn rank_load(routed: &Routed, engine: usize) -> Option<Value> {
    let loads = get(routed.api, "/loads").json();
    let name = Fleet::name(engine);
    loads
        .as_array()?
        .iter()
        .find(|rank| rank["instance"] == name && rank["dp_rank"] == 0)
        .cloned()
}

/// Issue 36: load the router never sent is in every choice. Streams held open straight on
/// sim-0's OpenAI server show in its scraped `/metrics`, and every cold prompt goes to sim-1,
/// where the rotation alone would alternate them; once the streams end, they take turns again.
#[test]
fn an_engine_loaded_from_outside_is_avoided() {
    let slow = OpenAiConfig {
        inter_token: Duration::from_millis(50),
        ..OpenAiConfig::default()
    };
    let routed = routed(2, 1, slow, &[]);
    let engine = addr_of(&routed.server(0));
    let long = json!({ "model": MODEL, "prompt": "outside traffic", "max_tokens": 20_000, "stream": true });
    let held: Vec<Answer> = (0..6)
        .map(|_| stream(engine, "/v1/completions", &long))
        .collect();
    let loaded = wait_for(20, "sim-0's scrape to show the outside streams", || {
        let rank = rank_load(&routed, 0)?;
        (rank["engine_load"]["running"].as_f64()? >= 6.0).then_some(rank)
    });
    assert_eq!(loaded["outside_requests"], json!(6.0), "{loaded}");
    assert_eq!(loaded["reservations"], json!(0), "{loaded}");
    assert!(loaded["engine_load"]["age_ms"].is_u64(), "{loaded}");
    let chosen = Connection::open(routed.api).send(
        "POST",
        "/select",
        Some(
            json!({ "token_ids": (0..64).collect::<Vec<u32>>() })
                .to_string()
                .as_bytes(),
        ),
    );
    let candidates = chosen.json()["candidates"].clone();
    let sim0 = candidates
        .as_array()
        .and_then(|all| {
            all.iter()
                .find(|c| c["instance"] == Fleet::name(0))
                .cloned()
        })
        .unwrap_or_else(|| panic!("sim-0 among {candidates}"));
    assert_eq!(sim0["outside_requests"], json!(6.0), "{sim0}");
    assert_eq!(sim0["engine_load"]["running"], json!(6.0), "{sim0}");
    for topic in ["alpha", "bravo", "charlie", "delta"] {
        let reply = routed.send("/v1/completions", &cold(topic));
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(
            reply.header("x-kv-indexer-rank"),
            Some(rank_name(1, 0).as_str())
        );
    }
    drop(held);
    wait_for(20, "sim-0's scrape to show its streams gone", || {
        let rank = rank_load(&routed, 0)?;
        (rank["outside_requests"].as_f64()? == 0.0).then_some(())
    });
    let ranks: std::collections::BTreeSet<String> = ["echo", "foxtrot"]
        .into_iter()
        .map(|topic| {
            let reply = routed.send("/v1/completions", &cold(topic));
            assert_eq!(reply.status, 200, "{}", reply.text());
            reply
                .header("x-kv-indexer-rank")
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(ranks.len(), 2, "cold prompts take turns again: {ranks:?}");
}

/// Issue 36: a scrape that fails (sim-0's `/metrics` answers 500, sim-1's `metrics_url` points
/// nowhere) leaves routing on reservations alone: requests are answered, each failure is
/// counted per engine, and `/workers` and `/loads` say why; the next good scrape is weighed.
#[test]
fn a_failing_scrape_is_survived_counted_and_shown() {
    let routed = routed_with(
        2,
        1,
        OpenAiConfig::default(),
        &[],
        &|i, engine| match i {
            1 => EngineToml {
                metrics_url: Some("http://127.0.0.1:1/metrics".into()),
                ..engine
            },
            _ => engine,
        },
        "/ready",
    );
    routed.server(0).fail_metrics(Some(500));
    let scrapes = |engine: usize, outcome: &str| {
        let series = format!(
            "kv_indexer_engine_load_scrapes_total{{instance=\"{}\",outcome=\"{outcome}\"}}",
            Fleet::name(engine)
        );
        routed.metric(&series)
    };
    wait_for(20, "both engines' scrapes to fail twice", || {
        (scrapes(0, "failed") >= 2.0 && scrapes(1, "failed") >= 2.0).then_some(())
    });
    let workers = get(routed.api, "/workers").json();
    for (engine, cause) in [(0, "answered 500"), (1, "connect")] {
        let instance = workers
            .as_array()
            .and_then(|all| {
                all.iter()
                    .find(|i| i["instance"] == Fleet::name(engine))
                    .cloned()
            })
            .unwrap_or_else(|| panic!("{} on {workers}", Fleet::name(engine)));
        let shown = instance["listeners"][0]["engine_load"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            shown.starts_with("stale: GET http://127.0.0.1:") && shown.contains(cause),
            "{shown}"
        );
        let load = rank_load(&routed, engine).expect("a load");
        assert_eq!(load["engine_load"], json!(shown), "{load}");
        assert_eq!(load["outside_requests"], json!(0.0), "{load}");
    }
    for topic in ["golf", "hotel", "india", "juliett"] {
        let reply = routed.send("/v1/completions", &cold(topic));
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    routed.all_released("answers routed by reservations alone");
    routed.server(0).fail_metrics(None);
    wait_for(20, "sim-0's next good scrape to be weighed", || {
        let rank = rank_load(&routed, 0)?;
        rank["engine_load"]["age_ms"].as_u64().map(drop)
    });
    assert!(scrapes(0, "ok") >= 1.0);
    assert_eq!(scrapes(1, "ok"), 0.0);
}

/// A `/metrics` server that takes connections and never answers (`huge`: answers 200 with a
/// 5 MiB body instead), for as long as the test runs.
fn raw_metrics(huge: bool) -> SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for connection in listener.incoming() {
            let Ok(mut connection) = connection else {
                return;
            };
            if huge {
                let mut head = [0u8; 4096];
                let _ = connection.read(&mut head);
                let line = b"vllm:num_requests_running{engine=\"0\"} 1\n".repeat(128);
                let _ = connection.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5242880\r\n\r\n");
                for _ in 0..(5 << 20) / line.len() + 1 {
                    if connection.write_all(&line).is_err() {
                        break;
                    }
                }
            }
            held.push(connection);
        }
    });
    addr
}

/// Issue 36: a scrape is bounded in time and size. sim-0's `metrics_url` never answers and
/// sim-1's answers 5 MiB: each scrape fails within its bound and says why, and routing goes on.
#[test]
fn a_slow_or_huge_metrics_answer_fails_its_scrape_within_bounds() {
    let slow = raw_metrics(false);
    let huge = raw_metrics(true);
    let routed = routed_with(
        2,
        1,
        OpenAiConfig::default(),
        &[],
        &|i, engine| EngineToml {
            metrics_url: Some(format!("http://{}/metrics", [slow, huge][i])),
            ..engine
        },
        "/ready",
    );
    let failed = |engine: usize| {
        routed.metric(&format!(
            "kv_indexer_engine_load_scrapes_total{{instance=\"{}\",outcome=\"failed\"}}",
            Fleet::name(engine)
        ))
    };
    wait_for(20, "both scrapes to fail", || {
        (failed(0) >= 1.0 && failed(1) >= 1.0).then_some(())
    });
    for (engine, cause) in [
        (0, "no whole answer within 500 ms"),
        (1, "larger than 4194304 bytes"),
    ] {
        let load = rank_load(&routed, engine).expect("a load");
        let shown = load["engine_load"].as_str().unwrap_or_default();
        assert!(
            shown.starts_with("stale: GET http://127.0.0.1:") && shown.contains(cause),
            "{load}"
        );
    }
    for topic in ["kilo", "lima"] {
        let reply = routed.send("/v1/completions", &cold(topic));
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
}

/// `metrics_url` and `load_interval_ms` follow the file: a reload that turns sim-0's scrape off
/// shows its rank unscraped (`engine_load` null) and drops its scrape series.
#[test]
fn a_reload_turns_an_engines_scrape_off() {
    let routed = routed(1, 1, OpenAiConfig::default(), &[]);
    let series = format!(
        "kv_indexer_engine_load_scrapes_total{{instance=\"{}\",outcome=\"ok\"}}",
        Fleet::name(0)
    );
    wait_for(20, "sim-0's load to be scraped", || {
        rank_load(&routed, 0)?["engine_load"]["age_ms"].as_u64()
    });
    assert!(routed.metric(&series) >= 1.0);
    let file = std::fs::read_to_string(routed.running.config_path()).expect("the file");
    let off = file.replacen("[[engine]]\n", "[[engine]]\nmetrics_url = \"\"\n", 1);
    assert_ne!(off, file);
    std::fs::write(routed.running.config_path(), off).expect("rewrite the file");
    let reload = Connection::open(routed.api).send("POST", "/reload", None);
    assert_eq!(reload.status, 200, "{}", reload.text());
    let load = rank_load(&routed, 0).expect("a load");
    assert_eq!(load["engine_load"], Value::Null, "{load}");
    let scrape = get(routed.api, "/metrics").text();
    assert!(
        !scrape.contains("kv_indexer_engine_load_scrapes_total{"),
        "{scrape}"
    );
}

/// `x-kv-indexer-explain: 1` answers with the policy and the chosen and runner-up ranks'
/// cost terms; a request that does not ask gets no such header.
#[test]
fn a_request_that_asks_has_its_choice_explained_with_the_runner_up() {
    let routed = routed(2, 1, OpenAiConfig::default(), &[]);
    let body = chat("tidal pools", false);
    routed.warm(1, 0, "/v1/chat/completions", &body);
    let plain = routed.send("/v1/chat/completions", &body);
    assert_eq!(plain.status, 200, "{}", plain.text());
    assert_eq!(plain.header("x-kv-indexer-explain"), None);
    routed.all_released("the unexplained answer");

    let reply = Connection::open(routed.route).send_with(
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("x-kv-indexer-explain", "1"),
        ],
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 0).as_str())
    );
    let text = reply
        .header("x-kv-indexer-explain")
        .expect("the explain header");
    let explained: Value = serde_json::from_str(text).expect("JSON");
    assert_eq!(explained["policy"], "cost", "{explained}");
    let query_blocks = explained["query_blocks"].as_u64().expect("query_blocks");
    let (chosen, runner_up) = (&explained["chosen"], &explained["runner_up"]);
    assert_eq!(chosen["instance"], Fleet::name(1), "{explained}");
    assert_eq!(runner_up["instance"], Fleet::name(0), "{explained}");
    assert!(query_blocks > 0, "{explained}");
    assert_eq!(chosen["matched_blocks"], query_blocks, "{explained}");
    assert_eq!(runner_up["matched_blocks"], 0, "{explained}");
    // The first answer's reservation is released; its prediction may still count on sim-1.
    for terms in [chosen, runner_up] {
        assert_eq!(terms["reservations"], 0, "{explained}");
        assert_eq!(terms["outside_requests"], 0.0, "{explained}");
        assert!(terms["predicted_blocks"].is_u64(), "{explained}");
        assert!(terms.get("engine_load").is_some(), "{explained}");
    }
    let cost = |terms: &Value| terms["cost"].as_f64().expect("a cost");
    assert!(cost(chosen) < cost(runner_up), "{explained}");
}

/// `/workers`' `cached_tokens` for `instance`: `None` before the front end passed on an answer.
fn cached_tokens_reporting(api: SocketAddr, instance: &str) -> Option<String> {
    let workers = get(api, "/workers").json();
    let engine = workers
        .as_array()?
        .iter()
        .find(|engine| engine["instance"] == instance)?
        .clone();
    engine["cached_tokens"].as_str().map(str::to_owned)
}

/// vLLM before 0.33 leaves `prompt_tokens_details` out when nothing was cached: once the engine
/// has reported the details, an answer without them counts as 0 cached tokens, so the hit ratio
/// covers every answer rather than the hits alone.
#[test]
fn an_omitted_prompt_tokens_details_counts_as_0_once_the_engine_has_reported_them() {
    let openai = OpenAiConfig {
        prompt_tokens_details: TokensDetails::WhenCached,
        ..OpenAiConfig::default()
    };
    let routed = routed(1, 1, openai, &[]);
    let prompt_tokens = "kv_indexer_route_prompt_tokens_total{instance=\"sim-0\",dp_rank=\"0\"}";
    let reported =
        "kv_indexer_route_reported_cached_tokens_total{instance=\"sim-0\",dp_rank=\"0\"}";
    assert_eq!(cached_tokens_reporting(routed.api, "sim-0"), None);

    let cold = routed.send("/v1/chat/completions", &chat("otters", false));
    assert_eq!(cold.status, 200, "{}", cold.text());
    assert!(cold.json()["usage"].get("prompt_tokens_details").is_none());
    routed.all_released("the cold answer");
    assert_eq!(
        cached_tokens_reporting(routed.api, "sim-0").as_deref(),
        Some("not_reporting")
    );
    assert_eq!(
        routed.metric(prompt_tokens),
        0.0,
        "not taken for a miss yet"
    );

    let warm = routed.send("/v1/chat/completions", &chat("otters", false));
    let warm = warm.json();
    let cached = cached_tokens(&warm);
    assert!(cached > 0, "{warm}");
    routed.all_released("the warm answer");
    assert_eq!(
        cached_tokens_reporting(routed.api, "sim-0").as_deref(),
        Some("reporting")
    );
    let warm_prompt = warm["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt_tokens");
    assert_eq!(routed.metric(prompt_tokens), warm_prompt as f64);
    assert_eq!(routed.metric(reported), cached as f64);

    let other = routed.send("/v1/chat/completions", &chat("badgers", false));
    let other = other.json();
    assert!(
        other["usage"].get("prompt_tokens_details").is_none(),
        "{other}"
    );
    routed.all_released("the other cold answer");
    let other_prompt = other["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt_tokens");
    assert_eq!(
        routed.metric(prompt_tokens),
        (warm_prompt + other_prompt) as f64,
        "the miss counts, as 0 cached tokens"
    );
    assert_eq!(routed.metric(reported), cached as f64);
}

/// vLLM without `--enable-prompt-tokens-details` never reports: `/workers` says so, and its
/// answers stay out of the hit ratio rather than counting as misses.
#[test]
fn an_engine_that_never_reports_cached_tokens_is_shown_not_reporting() {
    let openai = OpenAiConfig {
        prompt_tokens_details: TokensDetails::Never,
        ..OpenAiConfig::default()
    };
    let routed = routed(1, 1, openai, &[]);
    for _ in 0..2 {
        let reply = routed.send("/v1/chat/completions", &chat("herons", false));
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(reply.json()["usage"].get("prompt_tokens_details").is_none());
    }
    routed.all_released("both answers");
    assert_eq!(
        cached_tokens_reporting(routed.api, "sim-0").as_deref(),
        Some("not_reporting")
    );
    assert_eq!(
        routed.metric("kv_indexer_route_prompt_tokens_total{instance=\"sim-0\",dp_rank=\"0\"}"),
        0.0
    );
}

/// A warm rank's engine (sim-0) and the 93-block chat it holds, routed by a front end that
/// explains its choices, for the tests of docs.md "Engine load".
struct WarmRank {
    routed: Routed,
    engine: SocketAddr,
    body: Value,
}

impl WarmRank {
    fn start() -> WarmRank {
        let slow = OpenAiConfig {
            inter_token: Duration::from_millis(50),
            ..OpenAiConfig::default()
        };
        let routed = routed(2, 1, slow, &[]);
        let body = chat("lighthouses", false);
        routed.warm(0, 0, "/v1/chat/completions", &body);
        let engine = addr_of(&routed.server(0));
        WarmRank {
            routed,
            engine,
            body,
        }
    }

    /// `streams` streams of `prompt` held open on sim-0 straight (not routed), once its scrape
    /// shows them.
    fn hold(&self, streams: usize, prompt: Value) -> Vec<Answer> {
        let outside =
            json!({ "model": MODEL, "prompt": prompt, "max_tokens": 20_000, "stream": true });
        let held: Vec<Answer> = (0..streams)
            .map(|_| stream(self.engine, "/v1/completions", &outside))
            .collect();
        wait_for(
            20,
            &format!("sim-0's scrape to show {streams} outside streams"),
            || {
                let rank = rank_load(&self.routed, 0)?;
                (rank["outside_requests"].as_f64()? == streams as f64).then_some(())
            },
        );
        held
    }

    /// The chat routed, with where it went and its choice explained.
    fn routed_to(&self) -> (String, Value) {
        let reply = Connection::open(self.routed.route).send_with(
            "POST",
            "/v1/chat/completions",
            &[
                ("Content-Type", "application/json"),
                ("x-kv-indexer-explain", "1"),
            ],
            Some(self.body.to_string().as_bytes()),
        );
        assert_eq!(reply.status, 200, "{}", reply.text());
        self.routed.all_released("the warm prompt");
        let explained: Value = serde_json::from_str(
            reply
                .header("x-kv-indexer-explain")
                .expect("the choice explained"),
        )
        .expect("the explanation is JSON");
        let rank = reply
            .header("x-kv-indexer-rank")
            .unwrap_or_default()
            .to_owned();
        (rank, explained)
    }
}

/// docs.md "Engine load": a warm rank keeps its prompt while its engine is lightly loaded from
/// outside, and yields it to an idle cold rank once the outside load costs more than the
/// prefill the cache saves (each outside request weighs `engine_request_weight`, 10 blocks,
/// and each block it holds `decode_weight`, 0.1: "outside traffic" is one block).
#[test]
fn a_warm_rank_yields_to_an_idle_one_once_its_engine_is_overloaded() {
    let warm = WarmRank::start();
    let routed = &warm.routed;
    let hold = |streams: usize| warm.hold(streams, json!("outside traffic"));
    let routed_to = || warm.routed_to();
    let light = hold(1);
    let (rank, explained) = routed_to();
    assert_eq!(
        rank,
        rank_name(0, 0),
        "one outside request costs less than the cache saves: {explained}"
    );
    let blocks = explained["query_blocks"].as_u64().expect("query_blocks");
    assert_eq!(
        blocks, 93,
        "docs.md \"Engine load\" works this 93-block chat"
    );
    assert_eq!(
        explained["chosen"]["matched_blocks"],
        json!(blocks),
        "{explained}"
    );
    assert_eq!(
        explained["chosen"]["outside_blocks"],
        json!(1.0),
        "{explained}"
    );
    assert_eq!(
        explained["chosen"]["cost"],
        json!(10.0 + 0.1 * 1.0),
        "{explained}"
    );
    assert_eq!(
        explained["runner_up"]["cost"],
        json!(blocks as f64),
        "{explained}"
    );
    drop(light);
    wait_for(20, "sim-0's outside stream to end", || {
        (rank_load(routed, 0)?["outside_requests"].as_f64()? == 0.0).then_some(())
    });

    // Enough outside requests to cost more than prefilling the whole prompt cold.
    let outside_requests = blocks / 10 + 2;
    let heavy = hold(outside_requests as usize);
    let (rank, explained) = routed_to();
    assert_eq!(rank, rank_name(1, 0), "the warm rank yields: {explained}");
    assert_eq!(
        explained["chosen"]["prefill_blocks"],
        json!(blocks as f64),
        "{explained}"
    );
    let outside = outside_requests as f64;
    assert_eq!(
        explained["runner_up"]["cost"],
        json!(outside * 10.0 + 0.1 * outside),
        "the warm rank's cost is its outside load, a block each: {explained}"
    );
    drop(heavy);
}

/// docs.md "Engine load": one request from outside whose 16,000-token prompt sim-0 holds (1,000
/// blocks) weighs what it holds, 10 + 0.1 × 1,000 = 110, more than the 93 blocks the warm rank
/// saves: the chat goes to the cold rank. Weighed by its number alone it would cost 10, and the
/// chat would stay.
#[test]
fn a_warm_rank_yields_to_one_huge_prompt_from_outside() {
    let warm = WarmRank::start();
    let huge: Vec<u32> = (0..16_000).map(|at| 100 + at % 5_000).collect();
    let held = warm.hold(1, json!(huge));
    let loaded = wait_for(
        20,
        "sim-0's scrape to show the prompt's blocks held",
        || {
            let rank = rank_load(&warm.routed, 0)?;
            (rank["outside_blocks"].as_f64()? > 0.0).then_some(rank)
        },
    );
    assert_eq!(loaded["outside_blocks"], json!(1000.0), "{loaded}");
    let (rank, explained) = warm.routed_to();
    assert_eq!(rank, rank_name(1, 0), "the warm rank yields: {explained}");
    assert_eq!(explained["query_blocks"], json!(93), "{explained}");
    let warm_rank = &explained["runner_up"];
    assert_eq!(warm_rank["matched_blocks"], json!(93), "{explained}");
    assert_eq!(
        (&warm_rank["outside_requests"], &warm_rank["outside_blocks"]),
        (&json!(1.0), &json!(1000.0)),
        "{explained}"
    );
    assert_eq!(warm_rank["cost"], json!(10.0 + 100.0), "{explained}");
    assert_eq!(explained["chosen"]["cost"], json!(93.0), "{explained}");
    drop(held);
}

/// `routed` with `engines` engines of two ranks each, the indexer given no tokenizer (the
/// engines keep theirs, and serve `/tokenize` with it).
fn routed_without_tokenizer(engines: usize, keys: &[(&str, &str)]) -> Routed {
    let no_tokenizer = |_, engine| EngineToml {
        tokenizer: None,
        ..engine
    };
    routed_with(
        engines,
        2,
        OpenAiConfig::default(),
        keys,
        &no_tokenizer,
        "/ready",
    )
}

fn load_only(routed: &Routed, reason: &str) -> f64 {
    routed.metric(&format!(
        "kv_indexer_route_load_only_total{{reason=\"{reason}\"}}"
    ))
}

#[test]
fn without_a_local_tokenizer_a_prompt_is_tokenized_by_its_engine_and_goes_to_the_warm_rank() {
    let routed = routed_without_tokenizer(2, &[]);
    let asked = |routed: &Routed| -> Vec<u64> {
        (0..2)
            .map(|engine| routed.server(engine).tokenize_requests())
            .collect()
    };
    let body = chat("lighthouses", false);
    routed.warm(1, 1, "/v1/chat/completions", &body);
    let before = asked(&routed);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 1).as_str())
    );
    assert_eq!(reply.header("x-kv-indexer-tokenizer"), Some("engine"));
    assert_eq!(reply.header("x-kv-indexer-routing"), None);
    let predicted: u64 = reply
        .header("x-kv-indexer-predicted-cached-tokens")
        .and_then(|n| n.parse().ok())
        .expect("the prediction header");
    let cached = cached_tokens(&reply.json());
    assert!(predicted > 0, "predicted {predicted}");
    assert_eq!(predicted, cached, "the engine's ids are the ones it cached");

    // One engine was asked, once, with vLLM's chat tokenize body.
    let after = asked(&routed);
    let grown: Vec<usize> = (0..2).filter(|&e| after[e] > before[e]).collect();
    assert_eq!(grown.len(), 1, "{before:?} -> {after:?}");
    assert_eq!(after[grown[0]], before[grown[0]] + 1);
    let seen = routed
        .server(grown[0])
        .last_tokenize()
        .expect("a /tokenize");
    let sent: Value = serde_json::from_slice(&seen.body).expect("JSON");
    assert_eq!(
        sent,
        json!({"model": MODEL, "messages": body["messages"], "add_generation_prompt": true})
    );
    assert_eq!(seen.header("content-type"), Some("application/json"));

    let body = completion("a dragon slept");
    routed.warm(0, 1, "/v1/completions", &body);
    let reply = routed.send("/v1/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(0, 1).as_str())
    );
    assert_eq!(reply.header("x-kv-indexer-tokenizer"), Some("engine"));
    assert!(cached_tokens(&reply.json()) > 0);
    assert_eq!(load_only(&routed, "no_tokenizer"), 0.0);
    assert_eq!(load_only(&routed, "engine_tokenize_failed"), 0.0);
    routed.all_released("two answers");
}

#[test]
fn an_engine_tokenize_that_hangs_or_fails_is_routed_by_load_alone_within_its_timeout() {
    let routed = routed_without_tokenizer(1, &[("engine_tokenize_timeout_ms", "300")]);
    let server = routed.server(0);
    let body = chat("tides", false);
    let faults = [
        (
            Fault::Stall(Duration::from_secs(5)),
            "no whole answer within 300 ms",
        ),
        (Fault::Status(500), "answered 500"),
        (Fault::BreakAfter(0), "the answer broke"),
    ];
    for (failed, (fault, why)) in faults.into_iter().enumerate() {
        server.inject_tokenize(fault, 1);
        let started = std::time::Instant::now();
        let reply = routed.send("/v1/chat/completions", &body);
        let took = started.elapsed();
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(took < Duration::from_secs(2), "{why}: {took:?}");
        assert_eq!(reply.header("x-kv-indexer-tokenizer"), Some("none"));
        let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
        assert!(
            routing.starts_with("load only: POST http://") && routing.contains(why),
            "{routing:?}"
        );
        assert_eq!(
            load_only(&routed, "engine_tokenize_failed"),
            (failed + 1) as f64
        );
    }
    // A failure is not remembered: the next prompt is asked for, and tokenized.
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.header("x-kv-indexer-tokenizer"), Some("engine"));
    assert_eq!(server.tokenize_requests(), 4);
    routed.all_released("four answers");
}

#[test]
fn an_engine_without_tokenize_is_asked_once_and_then_left_alone() {
    let routed = routed_without_tokenizer(1, &[]);
    let server = routed.server(0);
    server.inject_tokenize(Fault::Status(404), 1);
    let body = chat("harbours", false);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
    assert!(routing.contains("answered 404"), "{routing:?}");
    assert_eq!(load_only(&routed, "engine_tokenize_failed"), 1.0);
    for _ in 0..3 {
        let reply = routed.send("/v1/chat/completions", &body);
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.header("x-kv-indexer-tokenizer"), Some("none"));
        let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
        assert!(routing.contains("POST /tokenize"), "{routing:?}");
    }
    assert_eq!(server.tokenize_requests(), 1, "asked once");
    assert_eq!(load_only(&routed, "no_tokenizer"), 3.0);
    assert_eq!(load_only(&routed, "engine_tokenize_failed"), 1.0);
}

#[test]
fn a_tokenizer_in_the_hugging_face_cache_is_found_used_and_shown() {
    // The hub's layout, holding the engines' own tokenizer files.
    let files = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(files.path()).expect("tokenizer directories");
    let hub = crate::support::hf_hub_with(MODEL, &files.path().join(MODEL));
    let snapshot = hub
        .path()
        .join(format!("models--{MODEL}/snapshots/5e3a1c0ffee"));

    // Engines are never asked: the cache's tokenizer is the only one.
    let route = SocketAddr::from(([127, 0, 0, 1], crate::support::free_port()));
    let no_tokenizer = |_, engine| EngineToml {
        tokenizer: None,
        ..engine
    };
    let keys = [("engine_tokenize_timeout_ms", "0")];
    let (fleet, toml, _tokenizers) = fleet_toml(
        1,
        2,
        OpenAiConfig::default(),
        &route.to_string(),
        &keys,
        &no_tokenizer,
    );
    let env = [("HF_HUB_CACHE".to_owned(), hub.path().display().to_string())];
    let process = IndexerProcess::launch(crate::support::indexer_binary(), &toml)
        .log_filter("info")
        .env(&env)
        .start(Duration::from_secs(10))
        .unwrap_or_else(|error| panic!("{error:#}"));
    wait_for(30, "every rank to be active", || {
        (get(process.address, "/ready").status == 200).then_some(())
    });
    let shown = format!("tokenizer {}", snapshot.display());
    assert!(
        process
            .log()
            .contains(&format!("{shown} (from the Hugging Face cache)")),
        "{}",
        process.log()
    );

    let server = fleet
        .engine(RankRef { engine: 0, rank: 0 })
        .openai()
        .expect("an OpenAI server");
    let body = chat("harbours", false);
    warm_at(
        &server,
        process.address,
        0,
        1,
        "/v1/chat/completions",
        &body,
    );
    let warmed = server.tokenize_requests();
    let reply = Connection::open(route).send(
        "POST",
        "/v1/chat/completions",
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(0, 1).as_str())
    );
    assert_eq!(reply.header("x-kv-indexer-tokenizer"), Some("hf_cache"));
    assert!(cached_tokens(&reply.json()) > 0);
    assert_eq!(
        server.tokenize_requests(),
        warmed,
        "the engine was not asked"
    );

    // `--check` shows where the tokenizer comes from.
    let check = std::process::Command::new(crate::support::indexer_binary())
        .arg("--check")
        .arg("--config")
        .arg(process.config_path())
        .env("HF_HUB_CACHE", hub.path())
        .output()
        .expect("kv-indexer --check");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{check:?}");
    assert!(
        stdout.contains(&format!("{shown} (Hugging Face cache)")),
        "{stdout}"
    );
}
