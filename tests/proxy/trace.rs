//! The `route_request` span (docs.md "Tracing") on real routed requests: the id it carries, the
//! choice's cost terms as the explain header shows them, the cached tokens the engine served,
//! and the request's log lines carrying its id. Read through the test kit's subscriber.

use std::net::{SocketAddr, TcpListener};

use crate::support::http_client::{wait_for, Connection};
use crate::support::logs::{closed_spans, install_logger, warnings_about, ClosedSpan};
use crate::support::routed::{rank_name, routed, routing_to, MODEL};
use kv_indexer_sim::fleet::Fleet;
use kv_indexer_sim::openai::OpenAiConfig;
use serde_json::{json, Value};

/// The one `route_request` span with `request_id`, once it has closed (the answer ended).
fn span_of(request_id: &str) -> ClosedSpan {
    let mut spans = wait_for(10, "the request's span to close", || {
        let spans = closed_spans("route_request", "request_id", request_id);
        (!spans.is_empty()).then_some(spans)
    });
    assert_eq!(spans.len(), 1, "{spans:?}");
    spans.remove(0)
}

/// A routed request's span holds the client's id, the policy and the chosen rank's terms as
/// the explain header lists them, and the cached tokens predicted beside those served.
#[test]
fn a_routed_requests_span_holds_its_id_its_choice_and_the_tokens_served() {
    install_logger();
    let routed = routed(2, 1, OpenAiConfig::default(), &[]);
    let body = json!({
        "model": MODEL,
        "messages": [{ "role": "user", "content": "a span of lichen: ".repeat(60) }],
        "max_tokens": 4,
    });
    routed.warm(1, 0, "/v1/chat/completions", &body);
    let request_id = format!("trace-{}-choice", std::process::id());
    let reply = Connection::open(routed.route).send_with(
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("x-request-id", &request_id),
            ("x-kv-indexer-explain", "1"),
        ],
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(rank_name(1, 0).as_str())
    );
    let explained: Value =
        serde_json::from_str(reply.header("x-kv-indexer-explain").expect("explained"))
            .expect("JSON");
    let served = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("the engine reports cached tokens");
    assert!(served > 0, "the warmed prefix is served from the cache");

    let span = span_of(&request_id);
    let field = |name: &str| span.fields.get(name).map(str::to_owned);
    let chosen = &explained["chosen"];
    assert_eq!(field("policy").as_deref(), explained["policy"].as_str());
    assert_eq!(field("engine"), Some(Fleet::name(1)), "{span:?}");
    assert_eq!(field("rank").as_deref(), Some("0"), "{span:?}");
    assert_eq!(field("path").as_deref(), Some("/v1/chat/completions"));
    for (term, shown) in [
        ("query_blocks", &explained["query_blocks"]),
        ("matched_blocks", &chosen["matched_blocks"]),
        ("predicted_blocks", &chosen["predicted_blocks"]),
        ("active_decode_blocks", &chosen["active_decode_blocks"]),
        ("reservations", &chosen["reservations"]),
        ("cost", &chosen["cost"]),
    ] {
        assert_eq!(field(term), Some(shown.to_string()), "{term}: {span:?}");
    }
    assert!(field("engine_load").is_some(), "{span:?}");
    let predicted: u64 = field("predicted_cached_tokens")
        .and_then(|tokens| tokens.parse().ok())
        .expect("the prediction");
    assert!(predicted > 0, "{span:?}");
    assert_eq!(field("served_cached_tokens"), Some(served.to_string()));
}

/// A port nothing listens on: bound by the OS, then closed.
fn dead_address() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address")
}

/// The front end's warnings about a request carry its id, and its span closes with the rank
/// tried even when no engine answers.
#[test]
fn a_requests_warnings_carry_its_id() {
    install_logger();
    let running = routing_to(dead_address());
    let route = running.route_addr().expect("[route] is set");
    let body = json!({ "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5 }).to_string();
    let request_id = format!("trace-{}-down", std::process::id());
    let reply = Connection::open(route).send_with(
        "POST",
        "/v1/completions",
        &[
            ("Content-Type", "application/json"),
            ("x-request-id", &request_id),
        ],
        Some(body.as_bytes()),
    );
    assert_eq!(reply.status, 502, "{}", reply.text());
    let lines = warnings_about(&format!("request_id={request_id}"));
    assert!(
        lines
            .iter()
            .any(|line| line.contains("route: engine server")),
        "{lines:?}"
    );
    let span = span_of(&request_id);
    assert_eq!(span.fields.get("engine"), Some("raw"), "{span:?}");
    assert_eq!(span.fields.get("served_cached_tokens"), None, "{span:?}");
}
