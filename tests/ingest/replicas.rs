//! Replicas (docs.md "Replicas"): several `kv-indexer` processes on one simulated fleet, each
//! subscribed to every rank, recovering a rank from a peer when the engines cannot help. Real
//! processes, sockets and HTTP on 127.0.0.1; the engines' caches are the ground truth. A peer
//! reading a large snapshot slowly gets it whole.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::http_client::{get, metric_sum, post, Connection};
use crate::support::{
    assert_exact, free_port, recovered_by, settle, start_indexer, trace_prompts, warm_up,
};
use kv_indexer_sim::fleet::{Fleet, RankRef, BLOCK_SIZE};
use kv_indexer_sim::indexer_toml::replica_keys;
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::watch::{self, IndexerView, OverHttp, RankView};
use kv_indexer_sim::workload::Route;

const ENGINES: usize = 2;
const DP_SIZE: u32 = 2;
const REQUESTS: usize = 160;
/// Below what 160 requests store on a rank: ranks evict, and replicas follow the removals.
const EVICTING: usize = 2_500;
/// Above it: what a replica missed is still cached, so missing it shows.
const ROOMY: usize = 20_000;
const DEADLINE: Duration = Duration::from_secs(20);

/// Engines that publish on consecutive ports (the indexer's `port + rank`); `helpful`: with a
/// replay socket (else neither replay nor `/kv_recover`: a real vLLM long past its buffer).
fn fleet(helpful: bool, drop_fraction: f64, capacity_blocks: usize) -> Fleet {
    crate::support::logs::install_logger();
    Fleet::start_on_consecutive_ports(ENGINES, |i| SimConfig {
        dp_size: DP_SIZE,
        replay_port: helpful.then_some(0),
        recover_port: None,
        block_size: BLOCK_SIZE,
        capacity_blocks,
        drop_fraction,
        seed: 0x5EE5 + i as u64,
        ..SimConfig::default()
    })
    .expect("fleet")
}

fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

fn config(fleet: &Fleet, peers: &[SocketAddr], serve: bool, token: Option<&Path>) -> String {
    format!(
        "{}{}",
        replica_keys(peers, serve, token),
        fleet.indexer_config()
    )
}

fn serve(fleet: &Fleet, prompts: &[Vec<u32>]) -> Vec<RankRef> {
    let mut router = fleet.router(Route::Sticky);
    fleet.serve_all(&mut router, prompts).expect("serve")
}

/// Settles `indexer` and checks it against every rank's ground truth.
fn assert_settled_exact(
    fleet: &Fleet,
    indexer: &IndexerProcess,
    prompts: &[Vec<u32>],
) -> Vec<RankView> {
    let mut view = OverHttp::new(indexer.address);
    let views = settle(fleet, &mut view, DEADLINE);
    assert_exact(fleet, &mut view, &views, prompts, &[]);
    views
}

fn workers(indexer: &IndexerProcess) -> serde_json::Value {
    let reply = get(indexer.address, "/workers");
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

/// Waits until every listener of `indexer` is connected and every rank of `fleet` (whose only
/// subscriber it is) has seen its subscriber's handshake: on engines that cannot replay, a
/// first batch lost to the PUB/SUB slow joiner would be lost for good.
fn subscribed(fleet: &Fleet, indexer: &IndexerProcess) {
    let started = Instant::now();
    while !workers(indexer)
        .as_array()
        .expect("an array")
        .iter()
        .flat_map(|instance| {
            instance["listeners"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .all(|listener| listener["connected"] == true)
    {
        assert!(started.elapsed() < DEADLINE, "{}", workers(indexer));
        std::thread::sleep(Duration::from_millis(20));
    }
    for at in fleet.ranks() {
        while fleet.engine(at).subscribers(at.rank).expect("rank") == 0 {
            assert!(started.elapsed() < DEADLINE, "{at:?}: no subscriber");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Two replicas naming each other, started together on a fleet that drops 10% of its batches
/// (repaired by replay): each is exact, so they answer identically.
#[test]
fn two_replicas_naming_each_other_agree_with_each_other_and_the_engines() {
    let fleet = fleet(true, 0.1, EVICTING);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS);
    let binary = Path::new(env!("CARGO_BIN_EXE_kv-indexer"));
    let (a_addr, b_addr) = (free_addr(), free_addr());
    let start = |own: SocketAddr, peer: SocketAddr| {
        IndexerProcess::launch(binary, &config(&fleet, &[peer], false, None))
            .address(own)
            .log_filter("info")
            .start(DEADLINE)
            .unwrap_or_else(|error| panic!("{error:#}"))
    };
    let a = start(a_addr, b_addr);
    let b = start(b_addr, a_addr);
    for indexer in [&a, &b] {
        warm_up(&fleet, &mut OverHttp::new(indexer.address), DEADLINE);
    }
    let placed = serve(&fleet, &prompts);
    assert!(fleet.ranks().iter().any(|&at| fleet
        .engine(at)
        .dropped_batches(at.rank)
        .expect("rank")
        > 0));
    for indexer in [&a, &b] {
        let mut view = OverHttp::new(indexer.address);
        let views = settle(&fleet, &mut view, DEADLINE);
        assert_exact(&fleet, &mut view, &views, &prompts, &placed);
        assert_eq!(watch::total(&views, |v| v.lost_batches), 0);
    }
    let (mut view_a, mut view_b) = (OverHttp::new(a.address), OverHttp::new(b.address));
    for prompt in &prompts {
        assert_eq!(
            view_a.matched(prompt).expect("a"),
            view_b.matched(prompt).expect("b")
        );
    }
    for indexer in [&a, &b] {
        assert!(!indexer.log().contains("panicked"), "{}", indexer.log());
    }
}

/// On engines that cannot help (no replay, no snapshot), a replica that joins mid-run, or is
/// killed and restarted, is exact again from its peer; one without peers is not.
#[test]
fn a_replica_joining_or_restarted_recovers_from_its_peer_and_one_without_peers_does_not() {
    let fleet = fleet(false, 0.0, ROOMY);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS);
    let half = prompts.len() / 2;
    let first = start_indexer(&config(&fleet, &[], true, None));
    subscribed(&fleet, &first);
    warm_up(&fleet, &mut OverHttp::new(first.address), DEADLINE);
    serve(&fleet, &prompts[..half]);
    assert_settled_exact(&fleet, &first, &prompts[..half]);

    let joined = start_indexer(&config(&fleet, &[first.address], false, None));
    let alone = start_indexer(&fleet.indexer_config());
    serve(&fleet, &prompts[half..]);
    assert_settled_exact(&fleet, &joined, &prompts);
    assert!(
        recovered_by(&joined)
            .iter()
            .all(|by| by == &format!("peer http://{}", first.address)),
        "{:?}",
        recovered_by(&joined)
    );
    assert!(
        metric_sum(
            joined.address,
            "kv_indexer_recoveries_total",
            &["method=\"peer\"", "outcome=\"ok\""]
        ) >= 4.0
    );

    let views = crate::support::caught_up(&fleet, &alone, DEADLINE);
    assert!(views.iter().all(|v| v.state == "partial"), "{views:#?}");
    let accuracy = watch::compare(
        &fleet,
        &mut OverHttp::new(alone.address),
        &views,
        &prompts,
        &[],
    )
    .expect("compare");
    assert!(
        accuracy.exact < accuracy.pairs,
        "without peers it cannot know: {accuracy:?}"
    );

    // Killed and started again: exact again from the same peer.
    let toml = config(&fleet, &[first.address], false, None);
    drop(joined);
    let restarted = start_indexer(&toml);
    assert_settled_exact(&fleet, &restarted, &prompts);
}

/// A peer whose rank is partial (it joined mid-stream and holds only what it saw since) answers
/// 503 and is not used: the asking replica stays partial rather than copying part of a state.
#[test]
fn a_partial_peer_is_not_used() {
    let fleet = fleet(false, 0.0, ROOMY);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS / 2);
    serve(&fleet, &prompts);
    // Joins after the prompts: it misses their history and is partial, yet would serve.
    let partial = start_indexer(&config(&fleet, &[], true, None));
    let views = crate::support::caught_up(&fleet, &partial, DEADLINE);
    assert!(views.iter().all(|v| v.state == "partial"), "{views:#?}");
    let reply = get(partial.address, "/snapshot/sim-0/0");
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(reply.text().contains("partial"), "{}", reply.text());

    let asking = start_indexer(&config(&fleet, &[partial.address], false, None));
    let views = crate::support::caught_up(&fleet, &asking, DEADLINE);
    assert!(views.iter().all(|v| v.state == "partial"), "{views:#?}");
    assert!(
        metric_sum(
            asking.address,
            "kv_indexer_recoveries_total",
            &["method=\"peer\"", "outcome=\"failed\""]
        ) >= 4.0
    );
    assert_eq!(
        metric_sum(
            asking.address,
            "kv_indexer_recoveries_total",
            &["method=\"peer\"", "outcome=\"ok\""]
        ),
        0.0
    );
    // `peers` is reloadable without touching a listener.
    asking
        .write_config(&config(
            &fleet,
            &[partial.address, free_addr()],
            false,
            None,
        ))
        .expect("config");
    let reply = post(asking.address, "/reload", b"");
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["unchanged"], 4, "{}", reply.text());
    assert_eq!(reply.json()["replaced"], serde_json::json!([]));
    // An indexer that keeps no contents says how to turn snapshots on.
    let plain = start_indexer(&fleet.indexer_config());
    let reply = get(plain.address, "/snapshot/sim-0/0");
    assert_eq!(reply.status, 409, "{}", reply.text());
    assert!(reply.text().contains("serve_snapshots"), "{}", reply.text());
    assert_eq!(get(partial.address, "/snapshot/sim-9/0").status, 404);
}

/// With `auth_token_file`, the snapshot and reload routes want the token (401 otherwise,
/// counted), the open routes stay open, and a peer holding the token recovers.
#[test]
fn with_a_token_only_a_peer_holding_it_gets_snapshots() {
    let fleet = fleet(false, 0.0, ROOMY);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), REQUESTS / 2);
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "correct-horse-battery\n").expect("token file");
    let guarded = start_indexer(&config(&fleet, &[], true, Some(&token_file)));
    subscribed(&fleet, &guarded);
    warm_up(&fleet, &mut OverHttp::new(guarded.address), DEADLINE);
    serve(&fleet, &prompts);
    assert_settled_exact(&fleet, &guarded, &prompts);

    let ask = |method: &str, path: &str, authorization: Option<&str>| {
        let mut connection = Connection::open(guarded.address);
        let header =
            authorization.map_or_else(String::new, |value| format!("Authorization: {value}\r\n"));
        connection.write_raw(
            format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{header}Content-Length: 0\r\n\r\n")
                .as_bytes(),
        );
        let reply = connection.read_reply();
        if reply.status == 401 {
            assert_eq!(
                reply.header("WWW-Authenticate"),
                Some("Bearer realm=\"kv-indexer\""),
                "a 401 carries its challenge (RFC 7235)"
            );
        }
        reply.status
    };
    for authorization in [
        None,
        Some("Bearer wrong"),
        Some("Basic correct-horse-battery"),
    ] {
        assert_eq!(
            ask("GET", "/snapshot/sim-0/0", authorization),
            401,
            "{authorization:?}"
        );
        assert_eq!(
            ask("POST", "/reload", authorization),
            401,
            "{authorization:?}"
        );
    }
    assert_eq!(
        metric_sum(
            guarded.address,
            "kv_indexer_http_errors_total",
            &["status=\"401\""]
        ),
        6.0
    );
    assert_eq!(
        ask(
            "GET",
            "/snapshot/sim-0/0",
            Some("Bearer correct-horse-battery")
        ),
        200
    );
    assert_eq!(
        ask("POST", "/reload", Some("bearer correct-horse-battery")),
        200
    );
    assert_eq!(ask("GET", "/workers", None), 200);
    assert!(!guarded.log().contains("correct-horse-battery"));

    let holder = start_indexer(&config(
        &fleet,
        &[guarded.address],
        false,
        Some(&token_file),
    ));
    assert_settled_exact(&fleet, &holder, &prompts);
    let stranger = start_indexer(&config(&fleet, &[guarded.address], false, None));
    let views = crate::support::caught_up(&fleet, &stranger, DEADLINE);
    assert!(views.iter().all(|v| v.state == "partial"), "{views:#?}");
    assert!(stranger.log().contains("401"), "{}", stranger.log());
}

/// An API reachable from other hosts with no token is a loud warning at start; with a token,
/// or on loopback, there is none.
#[test]
fn an_open_listen_without_a_token_is_a_loud_warning() {
    let fleet = fleet(false, 0.0, ROOMY);
    let binary = Path::new(env!("CARGO_BIN_EXE_kv-indexer"));
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "t0ken").expect("token file");
    let open = SocketAddr::from(([0, 0, 0, 0], free_port()));
    let warned = |toml: &str, address: SocketAddr| {
        let indexer = IndexerProcess::launch(binary, toml)
            .address(address)
            .log_filter("info")
            .start(DEADLINE)
            .unwrap_or_else(|error| panic!("{error:#}"));
        // Logged after the warning: once it is in, so is the warning, if any.
        let started = Instant::now();
        while !indexer.log().contains("HTTP API listening") {
            assert!(started.elapsed() < DEADLINE, "{}", indexer.log());
            std::thread::sleep(Duration::from_millis(10));
        }
        indexer.log().contains("SECURITY")
    };
    assert!(warned(&config(&fleet, &[], true, None), open));
    let open = SocketAddr::from(([0, 0, 0, 0], free_port()));
    assert!(!warned(&config(&fleet, &[], true, Some(&token_file)), open));
    assert!(!warned(&config(&fleet, &[], true, None), free_addr()));
}

/// A TCP listener that counts the connections it is offered (and closes each at once).
struct Recorder {
    address: SocketAddr,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Recorder {
    fn start() -> Recorder {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = connections.clone();
        // Ends with the test process; it owns nothing but the listener.
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(stream);
            }
        });
        Recorder {
            address,
            connections,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A proxy in the environment (`HTTP_PROXY`, `ALL_PROXY`, lower case too) is never used for a
/// peer's snapshot: the request carries the bearer token and the answer users' token ids. The
/// peer is asked directly, and the "proxy" sees no connection.
#[test]
fn peer_fetches_never_go_through_a_proxy_from_the_environment() {
    let fleet = fleet(false, 0.0, ROOMY);
    let prompts = trace_prompts(env!("CARGO_MANIFEST_DIR"), 20);
    serve(&fleet, &prompts);
    let peer = Recorder::start();
    let proxy = Recorder::start();
    let proxy_url = format!("http://{}", proxy.address);
    let env: Vec<(String, String)> = [
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ]
    .iter()
    .map(|name| (name.to_string(), proxy_url.clone()))
    .chain(["NO_PROXY", "no_proxy"].map(|name| (name.to_string(), String::new())))
    .collect();
    let toml = config(&fleet, &[peer.address], false, None);
    let indexer = IndexerProcess::launch(crate::support::indexer_binary(), &toml)
        .log_filter("info")
        .env(&env)
        .start(DEADLINE)
        .unwrap_or_else(|error| panic!("{error:#}"));
    // Joining mid-stream with engines that cannot replay, each rank asks its peer.
    let started = Instant::now();
    while peer.connections() == 0 {
        for at in fleet.ranks() {
            fleet.nudge(at).expect("nudge");
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the peer was never asked (proxy saw {}): {}",
            proxy.connections(),
            indexer.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    crate::support::caught_up(&fleet, &indexer, DEADLINE);
    assert_eq!(proxy.connections(), 0, "{}", indexer.log());
}

/// A peer reading a large snapshot slowly gets it whole: 60 s at a steady pace, the server
/// still writing long past its 30 s idle timeout (the client's receive buffer is kept small,
/// so the rest waits in the server's), which never runs while an answer is being written.
#[test]
fn a_large_snapshot_read_slowly_for_60_s_arrives_whole() {
    use std::io::{BufRead, BufReader, Read, Write};

    const PROMPTS: u32 = 400;
    const PROMPT_TOKENS: u32 = 4_096;
    const BLOCKS: u32 = PROMPTS * PROMPT_TOKENS / BLOCK_SIZE;
    const READ_FOR: Duration = Duration::from_secs(60);
    const PACE: Duration = Duration::from_millis(100);
    let fleet = fleet(true, 0.0, 2 * BLOCKS as usize);
    let indexer = start_indexer(&config(&fleet, &[], true, None));
    subscribed(&fleet, &indexer);
    let rank = RankRef { engine: 0, rank: 0 };
    for prompt in 0..PROMPTS {
        let tokens: Vec<u32> = (prompt * PROMPT_TOKENS..(prompt + 1) * PROMPT_TOKENS).collect();
        fleet.engine(rank).serve(0, &tokens).expect("served");
    }
    // 102,400 blocks: a debug build on a busy 2-core machine ingests them in tens of seconds.
    let views = settle(
        &fleet,
        &mut OverHttp::new(indexer.address),
        Duration::from_secs(120),
    );
    let held = views
        .iter()
        .find(|view| view.engine == "sim-0" && view.dp_rank == 0)
        .map(|view| view.blocks);
    assert_eq!(held, Some(u64::from(BLOCKS)), "{views:#?}");

    let mut socket = std::net::TcpStream::connect(indexer.address).expect("connect");
    rustix::net::sockopt::set_socket_recv_buffer_size(&socket, 16 << 10).expect("SO_RCVBUF");
    socket.set_read_timeout(Some(DEADLINE)).expect("timeout");
    socket
        .write_all(b"GET /snapshot/sim-0/0 HTTP/1.1\r\nHost: test\r\n\r\n")
        .expect("request");
    let mut reader = BufReader::with_capacity(4 << 10, socket);
    let mut length = None;
    let mut line = String::new();
    while {
        line.clear();
        reader.read_line(&mut line).expect("the head");
        line != "\r\n"
    } {
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse::<usize>().ok();
            }
        }
    }
    let length = length.expect("a Content-Length");
    assert!(
        length > 8 << 20,
        "a snapshot larger than the sockets' buffers: {length}"
    );
    let step = length / (READ_FOR.as_millis() / PACE.as_millis()) as usize + 1;
    let started = Instant::now();
    let mut body = Vec::with_capacity(length);
    while body.len() < length {
        let want = step.min(length - body.len());
        let before = body.len();
        (&mut reader)
            .take(want as u64)
            .read_to_end(&mut body)
            .expect("the snapshot, not a cut");
        assert!(
            body.len() > before,
            "cut after {} of {length} bytes",
            body.len()
        );
        std::thread::sleep(PACE);
    }
    assert!(
        started.elapsed() >= READ_FOR - PACE,
        "{:?}",
        started.elapsed()
    );
    let snapshot: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    let stored: usize = snapshot["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|event| event["block_hashes"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(stored, BLOCKS as usize);
}
