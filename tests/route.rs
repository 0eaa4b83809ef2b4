//! The route front end over real HTTP on 127.0.0.1: an in-process indexer with `[route]`, and
//! simulated engines whose OpenAI servers answer from their real prefix caches and publish the
//! KV events the indexer reads (`sim::openai`). Each test sends requests as a client would and
//! reads what the engines received, what the client got, `/loads` and `/metrics`.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use kv_indexer::select::Clock;
use kv_indexer_sim::fleet::{Fleet, RankRef};
use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::openai::{Fault, OpenAiConfig, OpenAiServer};
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::tokenizer_dir;
use serde_json::{json, Value};
use support::http_client::{get, metric_value, wait_for, Connection, Reply};
use support::sse_client::{self, Answer};
use support::start_service_with_select_clock;

const MODEL: &str = "chatml";

/// Engines `sim-0`, `sim-1`, … of `dp_size` ranks each, with OpenAI servers, and an indexer routing
/// to them on a clock the test advances.
struct Routed {
    running: RunningService,
    fleet: Fleet,
    clock: Clock,
    route: SocketAddr,
    api: SocketAddr,
    _tokenizers: tempfile::TempDir,
}

fn routed(engines: usize, dp_size: u32, openai: OpenAiConfig, keys: &[(&str, &str)]) -> Routed {
    let tokenizers = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(tokenizers.path()).expect("tokenizer directories");
    let chatml = tokenizers.path().join(MODEL);
    let fleet = Fleet::start_on_consecutive_ports(engines, |i| SimConfig {
        dp_size,
        block_size: 16,
        capacity_blocks: 4_096,
        openai_port: Some(0),
        openai: OpenAiConfig {
            model: MODEL.into(),
            tokenizer: Some(chatml.clone()),
            ..openai.clone()
        },
        seed: 0x20 + i as u64,
        ..SimConfig::default()
    })
    .expect("simulated engines");
    let tomls: Vec<EngineToml> = fleet
        .engine_tomls()
        .into_iter()
        .enumerate()
        .map(|(i, engine)| EngineToml {
            model: Some(MODEL.into()),
            tokenizer: Some(chatml.display().to_string()),
            openai_url: fleet.engine(RankRef { engine: i, rank: 0 }).openai_url(),
            ..engine
        })
        .collect();
    let toml = indexer_toml(None, 16, 8, &tomls) + &route_table("127.0.0.1:0", keys);
    let clock = Clock::manual();
    let running = start_service_with_select_clock(&toml, clock.clone());
    let api = running.http_addr();
    let route = running.route_addr().expect("[route] is set");
    wait_for(30, "every rank to be active", || {
        (get(api, "/ready").status == 200).then_some(())
    });
    Routed {
        running,
        fleet,
        clock,
        route,
        api,
        _tokenizers: tokenizers,
    }
}

impl Routed {
    fn server(&self, engine: usize) -> OpenAiServer {
        self.fleet
            .engine(RankRef { engine, rank: 0 })
            .openai()
            .expect("an OpenAI server")
    }

    /// Serves `body` on `engine`'s rank `rank` directly (not through the front end), and waits
    /// until the index shows that rank holding the prompt's blocks.
    fn warm(&self, engine: usize, rank: u32, path: &str, body: &Value) {
        let url = self.server(engine).url();
        let addr: SocketAddr = url
            .trim_start_matches("http://")
            .parse()
            .expect("an IP:port");
        let rank_header = rank.to_string();
        let reply = Connection::open(addr).send_with(
            "POST",
            path,
            &[
                ("Content-Type", "application/json"),
                ("X-data-parallel-rank", &rank_header),
            ],
            Some(body.to_string().as_bytes()),
        );
        assert_eq!(reply.status, 200, "{}", reply.text());
        let query = match path {
            "/v1/chat/completions" => json!({ "model": MODEL, "messages": body["messages"] }),
            _ => json!({ "model": MODEL, "prompt": body["prompt"] }),
        };
        let instance = Fleet::name(engine);
        wait_for(20, "the index to hold the warmed prompt", || {
            let answer = Connection::open(self.api).send(
                "POST",
                "/query",
                Some(query.to_string().as_bytes()),
            );
            let scores = answer.json()["scores"].as_array()?.clone();
            scores
                .iter()
                .any(|s| {
                    s["instance"] == instance
                        && s["dp_rank"] == rank
                        && s["matched_blocks"].as_u64() > Some(0)
                })
                .then_some(())
        });
    }

    /// `GET /loads`' reservations over every rank.
    fn reservations(&self) -> u64 {
        get(self.api, "/loads")
            .json()
            .as_array()
            .expect("a list")
            .iter()
            .map(|rank| rank["reservations"].as_u64().unwrap_or(0))
            .sum()
    }

    /// Waits until no reservation is open.
    fn all_released(&self, after: &str) {
        wait_for(
            10,
            &format!("reservations to be released after {after}"),
            || (self.reservations() == 0).then_some(()),
        );
    }

    fn metric(&self, series: &str) -> f64 {
        metric_value(self.api, series).unwrap_or(0.0)
    }

    fn send(&self, path: &str, body: &Value) -> Reply {
        Connection::open(self.route).send("POST", path, Some(body.to_string().as_bytes()))
    }
}

/// How the front end names rank `rank` of engine `engine` (`x-kv-indexer-rank`).
fn rank_name(engine: usize, rank: u32) -> String {
    format!("{}/{rank}", Fleet::name(engine))
}

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

#[test]
fn a_failing_rank_is_retried_then_left_out_then_readmitted() {
    let routed = routed(2, 1, OpenAiConfig::default(), &[]);
    let body = chat("harbours", false);
    routed.warm(0, 0, "/v1/chat/completions", &body);
    // e0 holds the prefix, and fails once: the request is retried on e1 and answered.
    routed.server(0).inject(Fault::Status(503), 1);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 0).as_str())
    );
    assert_eq!(routed.metric("kv_indexer_route_retries_total"), 1.0);
    assert_eq!(
        routed.metric("kv_indexer_route_rank_excluded{instance=\"sim-0\",dp_rank=\"0\"}"),
        1.0
    );
    let workers = get(routed.api, "/workers").json();
    let e0 = workers
        .as_array()
        .and_then(|engines| engines.iter().find(|e| e["instance"] == "sim-0"))
        .expect("sim-0 on /workers");
    let left = e0["listeners"][0]["route_backoff_ms"]
        .as_u64()
        .expect("a back-off");
    assert!(left > 0 && left <= 1_000, "{left}");
    // Left out for its back-off, though it holds the prefix.
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 0).as_str())
    );
    // Readmitted once the back-off is over: e0 and e1 both hold the prefix now, and take
    // turns.
    routed.clock.advance(Duration::from_secs(1));
    let chosen: Vec<String> = (0..2)
        .map(|_| {
            let reply = routed.send("/v1/chat/completions", &body);
            assert_eq!(reply.status, 200, "{}", reply.text());
            reply
                .header("x-kv-indexer-rank")
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(chosen.contains(&rank_name(0, 0)), "{chosen:?}");
    assert_eq!(
        routed.metric("kv_indexer_route_rank_excluded{instance=\"sim-0\",dp_rank=\"0\"}"),
        0.0
    );
    routed.all_released("retries");

    // Both ranks fail: two tries, then 502 naming the engine's answer.
    routed.server(0).inject(Fault::Status(500), 1);
    routed.server(1).inject(Fault::Status(500), 1);
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 502, "{}", reply.text());
    assert!(error_message(&reply).contains("500"), "{}", reply.text());
    // Refused connections count as failures too; with every rank out, 503.
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
    let reply = routed.send("/v1/chat/completions", &body);
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(
        error_message(&reply).contains("no connected rank"),
        "{}",
        reply.text()
    );
    routed.all_released("failures");
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
    let reply = send("/v1/embeddings", &authorized, body.as_bytes());
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert!(error_message(&reply).contains("/v1/embeddings"));
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
    let held: Vec<Connection> = (0..kv_indexer::http::MAX_CONNECTIONS)
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

/// Answers that outlast the server's 30 s idle timeout (`http::IDLE_TIMEOUT`) arrive whole: a
/// stream of 36 tokens a second apart, and a whole answer whose engine takes 35 s to its first
/// token. The idle deadline is for a connection waiting for its next request, never for one
/// whose answer is being produced or written.
#[test]
fn answers_that_outlast_the_idle_timeout_arrive_whole() {
    let streaming = std::thread::spawn(|| {
        let slow = OpenAiConfig {
            inter_token: Duration::from_secs(1),
            ..OpenAiConfig::default()
        };
        let routed = routed(1, 1, slow, &[]);
        let mut body = chat("a long story", true);
        body["max_tokens"] = json!(36);
        let mut answer = stream(routed.route, "/v1/chat/completions", &body);
        assert_eq!(answer.status, 200);
        let events = rest(&mut answer).expect("the whole stream, not a cut one");
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        assert!(events.len() >= 36, "one event a token: {events:?}");
    });
    let thinking = OpenAiConfig {
        first_token_floor: Duration::from_secs(35),
        ..OpenAiConfig::default()
    };
    let routed = routed(1, 1, thinking, &[]);
    let body = chat("a hard question", false);
    let mut answer = sse_client::send_timed(
        routed.route,
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
        Duration::from_secs(60),
    )
    .expect("an answer after 35 s, not a closed connection");
    assert_eq!(answer.status, 200);
    let answer = answer.json();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    streaming.join().expect("the stream arrived whole");
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
        ..EngineToml::new("sim-0", support::free_port())
    };
    let toml = indexer_toml(None, 16, 8, &[engine]) + &route_table("127.0.0.1:0", &[]);
    (support::start_service(&toml), tokenizers)
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
fn at_once(addr: SocketAddr, path: &'static str, body: &Value, count: usize) -> Vec<Reply> {
    let body = body.to_string();
    let sent: Vec<_> = (0..count)
        .map(|_| {
            let body = body.clone();
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

/// Tokenizing admits 2 MiB of prompts at once and a prompt waits for it 2 s: of six 1.5 MiB
/// prompts at once (each of which takes far longer than 2 s / 6 to tokenize), one is tokenized
/// at a time and the last ones are refused 429, saying why, on the route and the API alike. A
/// prompt over the whole budget is never tokenized: the API answers 413 naming the budget.
#[test]
fn past_the_tokenizing_budget_prompts_wait_then_get_429_and_a_prompt_over_it_413() {
    let (running, _dirs) = front_with_context(1_000_000);
    let route = running.route_addr().expect("[route] is set");
    let api = running.http_addr();
    let prompt = prompt_of(3 << 19);

    let completion = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1 });
    let replies = at_once(route, "/v1/completions", &completion, 6);
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

    let query = json!({ "model": MODEL, "prompt": prompt });
    let replies = at_once(api, "/query", &query, 6);
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
    let reply = Connection::open(route).send("POST", "/v1/chat/completions", Some(chat.as_bytes()));
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
