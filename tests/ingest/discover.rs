//! Discovery against real HTTP servers on loopback: a tiny_http server plays an engine's API
//! server (vLLM's `/kv_event_sources`, SGLang's `/server_info`, or a broken one), and real ZMQ
//! publishers on OS-chosen ports prove the discovered endpoints are the ranks themselves.
//! Every wait is bounded by the client's `Limits` (at most 2 s here) or a 10 s socket timeout.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::support::fake_engine::FakeRank;
use crate::support::{block_on, free_port};
use kv_indexer::discover::{
    Client, DiscoverError, Discovery, EngineApi, EngineKind, Failure, Limits,
};

/// What the fake API server answers on one route.
#[derive(Clone)]
enum Reply {
    Json(u16, String),
    /// A 302 back to the same URL: a redirect loop.
    RedirectToSelf,
    /// `{}` padded with spaces to this many bytes, sent chunked: valid JSON, only too big.
    Padded(usize),
    /// `{}` padded to 40 bytes, one byte every 100 ms (4 s in all): valid JSON, only slow.
    Trickle,
}

/// A tiny_http server answering canned replies per route (404 elsewhere), counting requests.
struct ApiServer {
    url: String,
    routes: Arc<Mutex<HashMap<String, Reply>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    fn start(routes: &[(&str, Reply)]) -> ApiServer {
        let server = tiny_http::Server::http("127.0.0.1:0").expect("HTTP server");
        let port = server.server_addr().to_ip().expect("IP address").port();
        let routes: HashMap<String, Reply> = routes
            .iter()
            .map(|(route, reply)| (route.to_string(), reply.clone()))
            .collect();
        let routes = Arc::new(Mutex::new(routes));
        let hits = Arc::new(Mutex::new(HashMap::new()));
        let stopping = Arc::new(AtomicBool::new(false));
        let thread = {
            let (routes, hits, stopping) = (routes.clone(), hits.clone(), stopping.clone());
            std::thread::spawn(move || {
                while !stopping.load(Ordering::Relaxed) {
                    let Ok(Some(request)) = server.recv_timeout(Duration::from_millis(50)) else {
                        continue;
                    };
                    let path = request.url().to_string();
                    *hits.lock().unwrap().entry(path.clone()).or_insert(0) += 1;
                    let reply = routes.lock().unwrap().get(&path).cloned();
                    // Each reply on its own thread: a trickle must not hold up the next request.
                    std::thread::spawn(move || answer(request, reply));
                }
            })
        };
        ApiServer {
            url: format!("http://127.0.0.1:{port}"),
            routes,
            hits,
            stopping,
            thread: Some(thread),
        }
    }

    fn set(&self, route: &str, reply: Reply) {
        self.routes.lock().unwrap().insert(route.to_string(), reply);
    }

    fn hits(&self, route: &str) -> usize {
        self.hits.lock().unwrap().get(route).copied().unwrap_or(0)
    }

    fn api(&self) -> EngineApi {
        EngineApi::new("e", &self.url, None).expect("valid discover URL")
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn answer(request: tiny_http::Request, reply: Option<Reply>) {
    let json = tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap();
    let _ = match reply {
        None => request.respond(
            tiny_http::Response::from_string(r#"{"detail":"Not Found"}"#)
                .with_status_code(404)
                .with_header(json),
        ),
        Some(Reply::Json(status, body)) => request.respond(
            tiny_http::Response::from_string(body)
                .with_status_code(status)
                .with_header(json),
        ),
        Some(Reply::RedirectToSelf) => {
            let location = request.url().to_string();
            let header = tiny_http::Header::from_bytes("Location", location).unwrap();
            request.respond(tiny_http::Response::empty(302).with_header(header))
        }
        Some(Reply::Padded(size)) => request.respond(tiny_http::Response::new(
            200.into(),
            vec![json],
            padded_json(size),
            None,
            None,
        )),
        Some(Reply::Trickle) => request.respond(tiny_http::Response::new(
            200.into(),
            vec![json],
            Trickle(padded_json(40)),
            Some(40),
            None,
        )),
    };
}

/// `{` spaces `}`, `size` bytes in all.
fn padded_json(size: usize) -> std::io::Cursor<Vec<u8>> {
    let mut body = vec![b' '; size];
    body[0] = b'{';
    body[size - 1] = b'}';
    std::io::Cursor::new(body)
}

struct Trickle(std::io::Cursor<Vec<u8>>);

impl Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::thread::sleep(Duration::from_millis(100));
        let end = buf.len().min(1);
        self.0.read(&mut buf[..end])
    }
}

/// A client with short deadlines, so the slow cases end quickly.
fn client() -> Client {
    Client::new(Limits {
        connect: Duration::from_secs(2),
        whole: Duration::from_millis(1_000),
        max_body: 1 << 20,
    })
}

fn vllm_entry(endpoint: &str) -> serde_json::Value {
    serde_json::json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": endpoint,
        "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
        "topic": ""})
}

/// Two publishers on OS-chosen ports and a vLLM API server reporting rank r on
/// `{prefixes[r]}:{its port}`.
fn vllm_with_two_ranks(zmq: &zmq::Context, prefixes: [&str; 2]) -> ([FakeRank; 2], ApiServer) {
    let ranks = [FakeRank::bind(zmq, 0), FakeRank::bind(zmq, 1)];
    let body: serde_json::Map<String, serde_json::Value> = ranks
        .iter()
        .zip(prefixes)
        .enumerate()
        .map(|(rank, (fake, prefix))| {
            (
                rank.to_string(),
                vllm_entry(&format!("{prefix}:{}", fake.port)),
            )
        })
        .collect();
    let body = serde_json::Value::Object(body).to_string();
    let api = ApiServer::start(&[("/kv_event_sources", Reply::Json(200, body))]);
    (ranks, api)
}

/// Connects a SUB to every discovered rank and waits (10 s at most) for each publisher to see
/// the subscription: the endpoints are the ranks' own.
fn assert_reaches(discovery: &Discovery, ranks: &[FakeRank]) {
    let zmq = zmq::Context::new();
    let subs: Vec<zmq::Socket> = discovery
        .ranks
        .iter()
        .map(|rank| {
            let sub = zmq.socket(zmq::SUB).unwrap();
            sub.set_linger(0).unwrap();
            sub.set_subscribe(rank.topic.as_bytes()).unwrap();
            sub.connect(&rank.endpoint.to_string()).unwrap();
            sub
        })
        .collect();
    for rank in ranks {
        rank.wait_subscribed();
    }
    drop(subs);
}

fn expect_failure(result: Result<Discovery, DiscoverError>) -> DiscoverError {
    match result {
        Ok(discovery) => panic!("expected a failure, got {discovery:?}"),
        Err(err) => {
            eprintln!("{err}");
            err
        }
    }
}

#[test]
fn two_vllm_ranks_on_os_chosen_ports_are_found_as_reported() {
    let zmq = zmq::Context::new();
    // With `tcp://*:0` vLLM reports the node's IP and the port each rank bound.
    let (ranks, api) = vllm_with_two_ranks(&zmq, ["tcp://127.0.0.1", "tcp://127.0.0.1"]);
    let discovery = block_on(client().discover(&api.api(), None)).expect("discovered");
    assert_eq!(discovery.kind, EngineKind::Vllm);
    assert_eq!(discovery.url, format!("{}/kv_event_sources", api.url));
    let found: Vec<_> = discovery
        .ranks
        .iter()
        .map(|r| (r.dp_rank, r.endpoint.to_string()))
        .collect();
    let expected: Vec<_> = ranks
        .iter()
        .enumerate()
        .map(|(rank, fake)| (rank as u32, format!("tcp://127.0.0.1:{}", fake.port)))
        .collect();
    assert_eq!(found, expected);
    assert_reaches(&discovery, &ranks);
    assert_eq!(
        api.hits("/server_info"),
        0,
        "vLLM answered: SGLang's route is not asked"
    );
}

#[test]
fn wildcard_hosts_are_replaced_by_the_engine_host() {
    let zmq = zmq::Context::new();
    let (ranks, api) = vllm_with_two_ranks(&zmq, ["tcp://*", "tcp://0.0.0.0"]);
    // The host defaults to the URL's (127.0.0.1) ...
    let discovery = block_on(client().discover(&api.api(), None)).expect("discovered");
    assert!(discovery
        .ranks
        .iter()
        .all(|r| r.endpoint.host.to_string() == "127.0.0.1"));
    assert_reaches(&discovery, &ranks);
    // ... and a configured host wins over it.
    let elsewhere = "10.0.0.5".parse().expect("a host");
    let api_elsewhere = EngineApi::new("e", &api.url, Some(elsewhere)).unwrap();
    let discovery = block_on(client().discover(&api_elsewhere, None)).expect("discovered");
    assert_eq!(
        discovery.ranks[1].endpoint.to_string(),
        format!("tcp://10.0.0.5:{}", ranks[1].port)
    );
}

#[test]
fn an_empty_object_is_a_valid_answer_of_zero_ranks() {
    let api = ApiServer::start(&[("/kv_event_sources", Reply::Json(200, "{}".into()))]);
    let discovery = block_on(client().discover(&api.api(), None)).expect("discovered");
    assert_eq!(
        (discovery.kind, discovery.ranks.len()),
        (EngineKind::Vllm, 0)
    );
}

#[test]
fn sglang_is_told_apart_by_its_route_and_puts_rank_r_on_port_plus_r() {
    let zmq = zmq::Context::new();
    let (first, second) = FakeRank::bind_pair(&zmq);
    let ranks = [first, second];
    let config = format!(
        r#"{{"publisher": "zmq", "endpoint": "tcp://*:{}", "topic": ""}}"#,
        ranks[0].port
    );
    let info = serde_json::json!({"model_path": "m", "dp_size": 2, "tp_size": 2,
        "enable_dp_attention": true, "kv_events_config": config});
    let api = ApiServer::start(&[("/server_info", Reply::Json(200, info.to_string()))]);
    let discovery = block_on(client().discover(&api.api(), None)).expect("discovered");
    assert_eq!(discovery.kind, EngineKind::Sglang);
    assert_eq!(discovery.url, format!("{}/server_info", api.url));
    let ports: Vec<_> = discovery
        .ranks
        .iter()
        .map(|r| r.endpoint.to_string())
        .collect();
    assert_eq!(
        ports,
        ranks
            .iter()
            .map(|r| format!("tcp://127.0.0.1:{}", r.port))
            .collect::<Vec<_>>()
    );
    assert_reaches(&discovery, &ranks);
    assert_eq!(
        api.hits("/kv_event_sources"),
        1,
        "vLLM's route is asked first"
    );

    // Once the kind is known, its route is asked first, and alone when it answers.
    block_on(client().discover(&api.api(), Some(EngineKind::Sglang))).expect("discovered");
    assert_eq!(api.hits("/kv_event_sources"), 1);
    assert_eq!(api.hits("/server_info"), 2);
}

#[test]
fn an_engine_replaced_by_the_other_kind_is_still_found() {
    let api = ApiServer::start(&[("/kv_event_sources", Reply::Json(200, "{}".into()))]);
    let discovery =
        block_on(client().discover(&api.api(), Some(EngineKind::Sglang))).expect("discovered");
    assert_eq!(discovery.kind, EngineKind::Vllm);
    assert_eq!(
        (api.hits("/server_info"), api.hits("/kv_event_sources")),
        (1, 1)
    );
}

#[test]
fn a_server_that_is_down_is_unreachable_and_named() {
    let url = format!("http://127.0.0.1:{}", free_port());
    let api = EngineApi::new("vllm-a", &url, None).unwrap();
    let err = expect_failure(block_on(client().discover(&api, None)));
    assert_eq!(err.failure, Failure::Unreachable);
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "engine vllm-a: {url}/kv_event_sources cannot be reached"
        )),
        "{text}"
    );
}

#[test]
fn a_server_that_speaks_no_http_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        if let Ok((mut stream, _)) = listener.accept() {
            let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.6\r\n\r\n");
        }
    });
    let api = EngineApi::new("e", &format!("http://127.0.0.1:{port}"), None).unwrap();
    let err = expect_failure(block_on(client().discover(&api, None)));
    assert_eq!(err.failure, Failure::NotHttp, "{err}");
    server.join().unwrap();
}

#[test]
fn bad_answers_are_refused_whole_with_the_engine_the_url_and_why() {
    let cases: [(Reply, Failure, &str); 6] = [
        (Reply::Json(200, "<html>vLLM</html>".into()), Failure::NotJson, "not JSON"),
        (Reply::Json(200, "[1, 2]".into()), Failure::Shape, "object keyed by rank"),
        (
            Reply::Json(
                200,
                serde_json::json!({"0": vllm_entry("tcp://*:5557"), "1": {"endpoint": "tcp://*:5558"}})
                    .to_string(),
            ),
            Failure::Shape,
            "rank 1 has enable_kv_cache_events missing",
        ),
        (
            Reply::Json(503, r#"{"detail": "engine core is dead"}"#.into()),
            Failure::Status(503),
            "answered 503 Service Unavailable: \"{\\\"detail\\\": \\\"engine core is dead\\\"}\"",
        ),
        (Reply::RedirectToSelf, Failure::Redirect(302), "follows no redirect"),
        (Reply::Padded(2 << 20), Failure::TooLarge, "more than 1 MiB"),
    ];
    let api = ApiServer::start(&[]);
    for (reply, failure, expected) in cases {
        api.set("/kv_event_sources", reply);
        let err = expect_failure(block_on(client().discover(&api.api(), None)));
        let text = err.to_string();
        assert_eq!(err.failure, failure, "{text}");
        assert!(
            text.starts_with(&format!("engine e: {}/kv_event_sources ", api.url)),
            "{text}"
        );
        assert!(text.contains(expected), "{text}");
    }
    // The redirect loop was asked once: its first hop is the error.
    assert_eq!(api.hits("/kv_event_sources"), 6);
    assert_eq!(
        api.hits("/server_info"),
        0,
        "only a 404 sends discovery to SGLang's route"
    );
}

#[test]
fn a_body_slower_than_the_deadline_is_cut_off() {
    // Whole, the trickled body is a valid answer (`{}` with spaces): only the deadline fails it.
    let api = ApiServer::start(&[("/kv_event_sources", Reply::Trickle)]);
    let err = expect_failure(block_on(client().discover(&api.api(), None)));
    assert_eq!(err.failure, Failure::Timeout, "{err}");
    assert!(
        err.to_string().contains("no whole answer within 1s"),
        "{err}"
    );
}

#[test]
fn a_body_at_the_cap_is_taken() {
    // The cap refuses more than `max_body`, not `max_body` itself.
    let api = ApiServer::start(&[("/kv_event_sources", Reply::Padded(1 << 20))]);
    let discovery = block_on(client().discover(&api.api(), None)).expect("a 1 MiB answer is taken");
    assert!(discovery.ranks.is_empty());
}

#[test]
fn no_route_on_either_engine_names_both_urls() {
    let api = ApiServer::start(&[]);
    let err = expect_failure(block_on(client().discover(&api.api(), None)));
    assert_eq!(err.failure, Failure::Status(404));
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "{}/kv_event_sources answered 404, and so did {}/server_info",
            api.url, api.url
        )),
        "{text}"
    );
    assert!(
        text.ends_with(
            ": does this vLLM serve /kv_event_sources (vLLM 0.33 or later), or is \
                        discover not the engine's HTTP server (vLLM's or SGLang's)?"
        ),
        "{text}"
    );
    // With SGLang known, its route is named first.
    let err = expect_failure(block_on(
        client().discover(&api.api(), Some(EngineKind::Sglang)),
    ));
    assert!(
        err.to_string().contains(&format!(
            "{}/server_info answered 404, and so did {}/kv_event_sources",
            api.url, api.url
        )),
        "{err}"
    );
}

#[test]
fn a_discover_url_kv_indexer_cannot_ask_is_refused_up_front() {
    let err = EngineApi::new("vllm-a", "https://10.0.0.5:8000", None).expect_err("https");
    assert!(
        err.to_string()
            .starts_with("engine vllm-a: \"https://10.0.0.5:8000\": https is not supported"),
        "{err}"
    );
}

#[test]
fn one_client_serves_every_engine_from_many_threads_at_once() {
    let vllm = ApiServer::start(&[("/kv_event_sources", Reply::Json(200, "{}".into()))]);
    let info = serde_json::json!({"dp_size": 1,
        "kv_events_config": r#"{"publisher": "zmq", "endpoint": "tcp://*:5557"}"#});
    let sglang = ApiServer::start(&[("/server_info", Reply::Json(200, info.to_string()))]);
    let client = Arc::new(client());
    let threads: Vec<JoinHandle<(Discovery, Discovery)>> = (0..4)
        .map(|_| {
            let (client, vllm, sglang) = (client.clone(), vllm.api(), sglang.api());
            std::thread::spawn(move || {
                let first = block_on(client.discover(&vllm, None)).expect("vLLM discovered");
                let second = block_on(client.discover(&sglang, None)).expect("SGLang discovered");
                (first, second)
            })
        })
        .collect();
    for thread in threads {
        let (first, second) = thread.join().expect("a discovering thread");
        assert_eq!((first.kind, first.ranks.len()), (EngineKind::Vllm, 0));
        assert_eq!(second.kind, EngineKind::Sglang);
        let endpoints: Vec<String> = second
            .ranks
            .iter()
            .map(|r| r.endpoint.to_string())
            .collect();
        assert_eq!(endpoints, ["tcp://127.0.0.1:5557"]);
    }
    assert_eq!(vllm.hits("/kv_event_sources"), 4);
    assert_eq!(
        (
            sglang.hits("/kv_event_sources"),
            sglang.hits("/server_info")
        ),
        (4, 4),
        "each thread asked vLLM's route first, then SGLang's"
    );
}
