//! The route front end's surface beyond chat and completions, over real HTTP on 127.0.0.1:
//! simulated engines (`sim::openai`: `/v1/embeddings`, `/v1/responses`, `/tokenize`) and a raw
//! socket engine for a stream, an in-process indexer routing to them. Each test sends requests
//! as a client would and reads which engine and rank served them, what the client got and
//! `/metrics`.

use std::time::Duration;

use crate::support::http_client::{get, metric_value, wait_for, Connection, Reply};
use crate::support::routed::{
    fleet_toml_of, one_answered_and_released, rank_name, raw_engine, routed, routed_with,
    routing_to, start_routed, Routed, MODEL,
};
use crate::support::sse_client;
use kv_indexer_sim::openai::OpenAiConfig;
use serde_json::{json, Value};

/// The engine index of the rank an answer names (`x-kv-indexer-rank`: `sim-N/R`).
fn engine_of(reply: &Reply) -> usize {
    let rank = reply.header("x-kv-indexer-rank").expect("the rank header");
    rank.trim_start_matches("sim-")
        .split('/')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a simulated engine's rank: {rank}"))
}

/// Requests served by `engine`, every rank summed.
fn served(routed: &Routed, engine: usize) -> u64 {
    routed.server(engine).served_per_rank().iter().sum()
}

#[test]
fn embeddings_tokenize_and_detokenize_are_passed_to_a_rank_of_their_model() {
    let routed = routed(2, 2, OpenAiConfig::default(), &[]);
    let body = json!({ "model": MODEL, "input": ["a lighthouse", "a lighthouse"] });
    let reply = routed.send("/v1/embeddings", &body);
    assert_eq!(reply.status, 200, "{}", reply.text());
    let answer = reply.json();
    let vectors = answer["data"].as_array().expect("data");
    assert_eq!(vectors.len(), 2);
    assert_eq!(
        vectors[0]["embedding"], vectors[1]["embedding"],
        "deterministic"
    );
    assert_eq!(vectors[0]["embedding"].as_array().map(Vec::len), Some(8));
    // The rank the answer names served it, as the header the front end set asks.
    let engine = engine_of(&reply);
    let seen = routed.server(engine).last_request().expect("a request");
    assert_eq!(seen.path, "/v1/embeddings");
    let rank = seen
        .header("x-data-parallel-rank")
        .expect("the rank header");
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(engine, rank.parse().expect("a rank")).as_str())
    );

    let reply = routed.send(
        "/tokenize",
        &json!({ "model": MODEL, "prompt": "Once upon a time" }),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    let tokens = reply.json()["tokens"].clone();
    assert!(tokens.as_array().is_some_and(|t| !t.is_empty()), "{tokens}");
    let engine = engine_of(&reply);
    let seen = routed.server(engine).last_tokenize().expect("a /tokenize");
    assert!(seen.header("x-data-parallel-rank").is_some());
    let reply = routed.send("/detokenize", &json!({ "model": MODEL, "tokens": tokens }));
    assert_eq!(reply.status, 200, "{}", reply.text());
    let prompt = reply.json()["prompt"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(prompt.contains("Once upon a time"), "{prompt:?}");

    // A model nobody serves is OpenAI's 404; an engine path outside `/v1/` that the front
    // end does not name, or one under it without a served model, is never sent anywhere.
    let before = served(&routed, 0) + served(&routed, 1);
    let other = routed.send("/v1/embeddings", &json!({ "model": "nope", "input": "x" }));
    assert_eq!(other.status, 404, "{}", other.text());
    assert_eq!(other.json()["error"]["code"], "model_not_found");
    for (path, body) in [
        ("/v1/made_up", json!({ "input": "x" })),
        ("/v1/made_up", json!({ "model": "nope" })),
        ("/v1/load_lora_adapter", json!({ "model": MODEL })),
        ("/reset_prefix_cache", json!({ "model": MODEL })),
    ] {
        let refused = routed.send(path, &body);
        assert_eq!(refused.status, 404, "{path}: {}", refused.text());
        assert!(refused.json()["error"]["message"].is_string());
    }
    // A declared path asked with another method is a 405, never passed.
    let refused = routed.send("/v1/responses/resp_1", &json!({ "model": MODEL }));
    assert_eq!(refused.status, 405, "{}", refused.text());
    assert_eq!(get(routed.route, "/v1/embeddings").status, 404);
    assert_eq!(served(&routed, 0) + served(&routed, 1), before);
    routed.all_released("passed-through answers");
}

/// Two engines of one rank each, chosen in turn (`[select] policy = "round_robin"`), so that
/// a request sent anywhere but where it must go would land on the other engine.
fn in_turn() -> Routed {
    let model = |_| MODEL.to_owned();
    let (fleet, toml, tokenizers) = fleet_toml_of(
        2,
        1,
        OpenAiConfig::default(),
        "127.0.0.1:0",
        &[],
        &|_, engine| engine,
        &model,
    );
    let toml = toml + "\n[select]\npolicy = \"round_robin\"\n";
    start_routed(fleet, &toml, tokenizers, "/ready")
}

#[test]
fn a_response_named_as_previous_goes_back_to_the_engine_that_made_it_whole_or_streamed() {
    let routed = in_turn();
    let first = routed.send(
        "/v1/responses",
        &json!({ "model": MODEL, "input": "Tell me about lighthouses.", "instructions": "Be brief." }),
    );
    assert_eq!(first.status, 200, "{}", first.text());
    let whole_id = first.json()["id"].as_str().expect("an id").to_owned();
    let whole_engine = engine_of(&first);
    // A streamed one: its id is its `response.created` event's.
    let mut stream = sse_client::post(
        routed.route,
        "/v1/responses",
        &[],
        json!({ "model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "And bridges?"}]}], "stream": true })
            .to_string()
            .as_bytes(),
    );
    assert_eq!(stream.status, 200);
    let streamed_engine = stream
        .header("x-kv-indexer-rank")
        .and_then(|rank| {
            rank.trim_start_matches("sim-")
                .split('/')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .expect("the rank header");
    let text = String::from_utf8(stream.body().expect("the events")).expect("UTF-8");
    let created = text
        .split("\n\n")
        .find(|event| event.starts_with("event: response.created"))
        .and_then(|event| event.split_once("data: "))
        .map(|(_, data)| serde_json::from_str::<Value>(data).expect("JSON"))
        .expect("a response.created event");
    let streamed_id = created["response"]["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    assert!(text.contains("event: response.completed"), "{text}");
    assert_ne!(whole_engine, streamed_engine, "in turn");

    // Each follow-up goes where its response is, however the turn falls: each id twice in a
    // row, so that taking turns would send one of the two to the other engine.
    for round in 0..3 {
        for (id, engine) in [
            (&whole_id, whole_engine),
            (&whole_id, whole_engine),
            (&streamed_id, streamed_engine),
        ] {
            let reply = routed.send(
                "/v1/responses",
                &json!({ "model": MODEL, "input": format!("More, {round}."), "previous_response_id": id }),
            );
            assert_eq!(reply.status, 200, "round {round}: {}", reply.text());
            assert_eq!(engine_of(&reply), engine, "round {round}");
            // Its prompt is the engine's, earlier turns first: weighed by load, and said so.
            let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
            assert!(routing.contains("previous_response_id"), "{routing}");
        }
    }
    // A stored response is fetched where it is stored too.
    for (id, engine) in [
        (&whole_id, whole_engine),
        (&whole_id, whole_engine),
        (&streamed_id, streamed_engine),
    ] {
        let reply =
            Connection::open(routed.route).send("GET", &format!("/v1/responses/{id}"), None);
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.json()["id"], id.as_str());
        assert_eq!(engine_of(&reply), engine);
    }
    assert_eq!(
        routed.metric("kv_indexer_route_previous_response_total{outcome=\"found\"}"),
        12.0
    );

    // An id nobody passed on is routed as any other, counted: the engine says it does not
    // know it.
    let reply = routed.send(
        "/v1/responses",
        &json!({ "model": MODEL, "input": "Again.", "previous_response_id": "resp_unknown" }),
    );
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert_eq!(
        routed.metric("kv_indexer_route_previous_response_total{outcome=\"unknown\"}"),
        1.0
    );
    routed.all_released("the responses");
}

#[test]
fn the_route_token_guards_pass_throughs_and_metrics_but_not_health() {
    let token = tempfile::NamedTempFile::new().expect("token file");
    std::fs::write(token.path(), "s3cret\n").expect("write the token");
    let path = format!("'{}'", token.path().display());
    let routed = routed(1, 1, OpenAiConfig::default(), &[("auth_token_file", &path)]);
    let body = json!({ "model": MODEL, "input": "x" }).to_string();
    let bearer = [("Authorization", "Bearer s3cret")];
    for (method, path, body) in [
        ("POST", "/v1/embeddings", Some(body.as_bytes())),
        ("POST", "/tokenize", Some(br#"{"prompt":"x"}"#.as_slice())),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
    ] {
        let refused = Connection::open(routed.route).send(method, path, body);
        assert_eq!(refused.status, 401, "{method} {path}: {}", refused.text());
        let wrong = Connection::open(routed.route).send_with(
            method,
            path,
            &[("Authorization", "Bearer nope")],
            body,
        );
        assert_eq!(wrong.status, 401, "{method} {path}");
        let taken = Connection::open(routed.route).send_with(method, path, &bearer, body);
        assert_eq!(taken.status, 200, "{method} {path}: {}", taken.text());
    }
    assert_eq!(
        routed.server(0).served_per_rank(),
        vec![1],
        "once, with the token"
    );
    assert_eq!(get(routed.route, "/health").status, 200);
}

#[test]
fn metrics_are_served_on_the_route_listener_as_on_the_api() {
    let routed = routed(1, 1, OpenAiConfig::default(), &[]);
    let reply = routed.send("/v1/embeddings", &json!({ "model": MODEL, "input": "x" }));
    assert_eq!(reply.status, 200, "{}", reply.text());
    let scrape = wait_for(10, "the answer to be counted", || {
        let scrape = get(routed.route, "/metrics");
        scrape
            .text()
            .contains("kv_indexer_route_requests_total{outcome=\"answered\"} 1")
            .then_some(scrape)
    });
    assert_eq!(scrape.status, 200);
    assert!(scrape
        .header("content-type")
        .is_some_and(|kind| kind.starts_with("application/openmetrics-text")));
    let text = scrape.text();
    for series in [
        "kv_indexer_route_requests_total{outcome=\"answered\"} 1",
        "kv_indexer_route_previous_response_total{outcome=\"unknown\"} 0",
        "kv_indexer_index_keys",
    ] {
        assert!(
            text.contains(series),
            "{series} missing from the route's /metrics"
        );
    }
    assert_eq!(
        metric_value(
            routed.api,
            "kv_indexer_route_requests_total{outcome=\"answered\"}"
        ),
        Some(1.0),
        "the API's /metrics is the same registry"
    );
}

#[test]
fn models_are_the_engines_own_lists_merged() {
    let model = |i: usize| ["chatml", "other-model", "chatml"][i].to_owned();
    let (fleet, toml, tokenizers) = fleet_toml_of(
        3,
        1,
        OpenAiConfig::default(),
        "127.0.0.1:0",
        &[],
        &|_, engine| engine,
        &model,
    );
    let routed = start_routed(fleet, &toml, tokenizers, "/ready");
    let listed = get(routed.route, "/v1/models");
    assert_eq!(listed.status, 200, "{}", listed.text());
    let list = listed.json();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|model| model["id"].as_str())
        .collect();
    assert_eq!(ids, ["chatml", "other-model"], "{list}");
    // The engines' own entries, as vLLM writes them.
    assert_eq!(list["data"][0]["owned_by"], "vllm");
    assert!(list["data"][1]["max_model_len"].is_u64(), "{list}");

    // A server that does not answer is left out; the others still list theirs.
    routed
        .server(1)
        .stop_listening()
        .expect("engine 1 stops listening");
    wait_for(10, "engine 1's model to leave the list", || {
        let list = get(routed.route, "/v1/models").json();
        let ids: Vec<Value> = list["data"]
            .as_array()?
            .iter()
            .map(|m| m["id"].clone())
            .collect();
        (ids == [json!("chatml")]).then_some(())
    });
}

#[test]
fn a_streamed_pass_through_is_passed_on_as_it_arrives_and_arrives_whole() {
    const FIRST: &[u8] = b"data: {\"type\":\"transcript.text.delta\",\"delta\":\"Hello\"}\n\n";
    const REST: &[u8] =
        b"data: {\"type\":\"transcript.text.done\",\"text\":\"Hello there\"}\n\ndata: [DONE]\n\n";
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let chunk =
        |bytes: &[u8]| [format!("{:x}\r\n", bytes.len()).as_bytes(), bytes, b"\r\n"].concat();
    let first: &'static [u8] = [head.as_bytes(), &chunk(FIRST)].concat().leak();
    let rest: &'static [u8] = [chunk(REST).as_slice(), b"0\r\n\r\n"].concat().leak();
    let (engine, go_on) = raw_engine([first, rest]);
    let running = routing_to(engine);
    let route = running.route_addr().expect("[route] is set");
    let body = json!({ "model": MODEL, "stream": true }).to_string();
    let mut answer = sse_client::send_timed(
        route,
        "/v1/audio/transcriptions",
        &[],
        body.as_bytes(),
        Duration::from_secs(20),
    )
    .expect("the answer's head");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-kv-indexer-rank"), Some("raw/0"));
    // The first event reaches the client while the engine holds the rest back.
    let first_event = answer.next_event().expect("the first event");
    assert_eq!(
        first_event.as_deref(),
        Some("{\"type\":\"transcript.text.delta\",\"delta\":\"Hello\"}")
    );
    go_on.send(()).expect("the engine waits");
    let mut got = answer.body().expect("the rest");
    got.splice(0..0, FIRST.iter().copied());
    assert_eq!(got, [FIRST, REST].concat(), "whole, every byte as sent");
    one_answered_and_released(running.http_addr());
}

#[test]
fn responses_remembered_0_remembers_no_response() {
    let routed = routed_with(
        1,
        1,
        OpenAiConfig::default(),
        &[("responses_remembered", "0")],
        &|_, engine| engine,
        "/ready",
    );
    let made = routed.send("/v1/responses", &json!({ "model": MODEL, "input": "Hi." }));
    assert_eq!(made.status, 200, "{}", made.text());
    let id = made.json()["id"].as_str().expect("an id").to_owned();
    let again = routed.send(
        "/v1/responses",
        &json!({ "model": MODEL, "input": "Again.", "previous_response_id": id }),
    );
    // One engine: it is served all the same, but the front end remembered nothing.
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(
        routed.metric("kv_indexer_route_previous_response_total{outcome=\"unknown\"}"),
        1.0
    );
    assert_eq!(
        routed.metric("kv_indexer_route_previous_response_total{outcome=\"found\"}"),
        0.0
    );
}

#[test]
fn a_response_is_tokenized_as_the_chat_it_renders_and_goes_to_the_rank_holding_its_prefix() {
    let routed = routed(2, 2, OpenAiConfig::default(), &[]);
    let system = format!(
        "You answer questions about lighthouses. {}",
        "lighthouses: ".repeat(120)
    );
    let question = "Tell me about lighthouses.";
    let chat = json!({
        "model": MODEL,
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": question },
        ],
        "max_tokens": 4,
    });
    routed.warm(1, 1, "/v1/chat/completions", &chat);
    let reply = routed.send(
        "/v1/responses",
        &json!({ "model": MODEL, "instructions": system, "input": question }),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 1).as_str())
    );
    let predicted: u64 = reply
        .header("x-kv-indexer-predicted-cached-tokens")
        .and_then(|n| n.parse().ok())
        .expect("the prediction header");
    assert!(predicted > 0, "the chat's blocks are the response's prefix");
    assert_eq!(reply.header("x-kv-indexer-routing"), None, "tokenized");

    // An item the front end does not render is weighed by load alone, and said so.
    let reply = routed.send(
        "/v1/responses",
        &json!({ "model": MODEL, "input": [
            { "type": "function_call_output", "call_id": "call_1", "output": "42" },
        ] }),
    );
    let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
    assert!(routing.starts_with("load only: "), "{routing}");
    routed.all_released("the responses");
}

#[test]
fn a_pass_through_goes_to_another_server_when_the_first_cannot_be_reached() {
    let routed = in_turn();
    routed
        .server(0)
        .stop_listening()
        .expect("engine 0 stops listening");
    // Taking turns, one of the two is chosen for engine 0 first: it never got there, so it
    // goes to engine 1.
    for _ in 0..2 {
        let reply = routed.send("/v1/embeddings", &json!({ "model": MODEL, "input": "x" }));
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(engine_of(&reply), 1);
    }
    assert_eq!(served(&routed, 1), 2);
    assert!(routed.metric("kv_indexer_route_retries_total") >= 1.0);
    routed.all_released("the retried pass-throughs");
}
