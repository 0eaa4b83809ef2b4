//! Engines with OpenAI servers and an in-process indexer routing to them (`[route]`), as the
//! route front end's tests start them: `routed` and its variants, and what those tests read
//! of it (the engines' servers, `/loads`' reservations, `/metrics`).

use std::net::SocketAddr;
use std::time::Duration;

use kv_indexer::select::Clock;
use kv_indexer_sim::fleet::{Fleet, RankRef};
use kv_indexer_sim::indexer_toml::{indexer_toml, route_table, EngineToml};
use kv_indexer_sim::openai::{OpenAiConfig, OpenAiServer};
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::server::SimConfig;
use kv_indexer_sim::tokenizer_dir;
use serde_json::{json, Value};

use super::http_client::{get, metric_value, wait_for, Connection, Reply};
use super::start_service_with_select_clock;

pub const MODEL: &str = "chatml";

/// Engines `sim-0`, `sim-1`, … of `dp_size` ranks each, with OpenAI servers, and an indexer routing
/// to them on a clock the test advances.
pub struct Routed {
    pub running: RunningService,
    pub fleet: Fleet,
    pub clock: Clock,
    pub route: SocketAddr,
    pub api: SocketAddr,
    _tokenizers: tempfile::TempDir,
}

pub fn routed(engines: usize, dp_size: u32, openai: OpenAiConfig, keys: &[(&str, &str)]) -> Routed {
    routed_with(
        engines,
        dp_size,
        openai,
        keys,
        &|_, engine| engine,
        "/ready",
    )
}

/// `routed`, each engine's table as `edit` makes it, ready when `GET ready_path` on the API
/// answers 200.
pub fn routed_with(
    engines: usize,
    dp_size: u32,
    openai: OpenAiConfig,
    keys: &[(&str, &str)],
    edit: &dyn Fn(usize, EngineToml) -> EngineToml,
    ready_path: &str,
) -> Routed {
    let (fleet, toml, tokenizers) = fleet_toml(engines, dp_size, openai, "127.0.0.1:0", keys, edit);
    start_routed(fleet, &toml, tokenizers, ready_path)
}

/// The indexer of `toml` routing to `fleet`, ready when `GET ready_path` on its API answers
/// 200; `tokenizers` is kept as long as it runs.
pub fn start_routed(
    fleet: Fleet,
    toml: &str,
    tokenizers: tempfile::TempDir,
    ready_path: &str,
) -> Routed {
    let clock = Clock::manual();
    let running = start_service_with_select_clock(toml, clock.clone());
    let api = running.http_addr();
    let route = running.route_addr().expect("[route] is set");
    wait_for(30, &format!("{ready_path} to answer 200"), || {
        (get(api, ready_path).status == 200).then_some(())
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

/// The engines of `routed` and an indexer's file routing to them from `route_listen`, each
/// engine's table as `edit` makes it; the tokenizers' directory lives as long as the returned
/// guard.
pub fn fleet_toml(
    engines: usize,
    dp_size: u32,
    openai: OpenAiConfig,
    route_listen: &str,
    keys: &[(&str, &str)],
    edit: &dyn Fn(usize, EngineToml) -> EngineToml,
) -> (Fleet, String, tempfile::TempDir) {
    let model = |_| MODEL.to_owned();
    fleet_toml_of(engines, dp_size, openai, route_listen, keys, edit, &model)
}

/// `fleet_toml`, engine `i` serving model `model(i)` (with `MODEL`'s tokenizer).
pub fn fleet_toml_of(
    engines: usize,
    dp_size: u32,
    openai: OpenAiConfig,
    route_listen: &str,
    keys: &[(&str, &str)],
    edit: &dyn Fn(usize, EngineToml) -> EngineToml,
    model: &dyn Fn(usize) -> String,
) -> (Fleet, String, tempfile::TempDir) {
    let tokenizers = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(tokenizers.path()).expect("tokenizer directories");
    let chatml = tokenizers.path().join(MODEL);
    let fleet = Fleet::start_on_consecutive_ports(engines, |i| SimConfig {
        dp_size,
        block_size: 16,
        capacity_blocks: 4_096,
        openai_port: Some(0),
        openai: OpenAiConfig {
            model: model(i),
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
            model: Some(model(i)),
            tokenizer: Some(chatml.display().to_string()),
            openai_url: fleet.engine(RankRef { engine: i, rank: 0 }).openai_url(),
            ..engine
        })
        .enumerate()
        .map(|(i, engine)| edit(i, engine))
        .collect();
    let toml = indexer_toml(None, 16, &tomls) + &route_table(route_listen, keys);
    (fleet, toml, tokenizers)
}

impl Routed {
    pub fn server(&self, engine: usize) -> OpenAiServer {
        self.fleet
            .engine(RankRef { engine, rank: 0 })
            .openai()
            .expect("an OpenAI server")
    }

    /// Serves `body` on `engine`'s rank `rank` directly (not through the front end), and waits
    /// until the index shows that rank holding the prompt's blocks.
    pub fn warm(&self, engine: usize, rank: u32, path: &str, body: &Value) {
        warm_at(&self.server(engine), self.api, engine, rank, path, body);
    }

    /// `GET /loads`' reservations over every rank.
    pub fn reservations(&self) -> u64 {
        get(self.api, "/loads")
            .json()
            .as_array()
            .expect("a list")
            .iter()
            .map(|rank| rank["reservations"].as_u64().unwrap_or(0))
            .sum()
    }

    /// Waits until no reservation is open.
    pub fn all_released(&self, after: &str) {
        wait_for(
            10,
            &format!("reservations to be released after {after}"),
            || (self.reservations() == 0).then_some(()),
        );
    }

    pub fn metric(&self, series: &str) -> f64 {
        metric_value(self.api, series).unwrap_or(0.0)
    }

    pub fn send(&self, path: &str, body: &Value) -> Reply {
        Connection::open(self.route).send("POST", path, Some(body.to_string().as_bytes()))
    }
}

/// How the front end names rank `rank` of engine `engine` (`x-kv-indexer-rank`).
pub fn rank_name(engine: usize, rank: u32) -> String {
    format!("{}/{rank}", Fleet::name(engine))
}

/// An engine over a raw socket: it answers one request with `head` and the first part of a
/// body, then the rest once the test says so; what it read of the request comes back.
pub fn raw_engine(parts: [&'static [u8]; 2]) -> (SocketAddr, std::sync::mpsc::Sender<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let (go_on, rest_allowed) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        // The health checks come and go on connections of their own: the routed request is
        // the one that POSTs.
        for connection in listener.incoming() {
            let Ok(mut connection) = connection else {
                return;
            };
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            while memchr::memmem::find(&request, b"\r\n\r\n").is_none() {
                match connection.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buffer[..n]),
                }
            }
            if !request.starts_with(b"POST") {
                let _ = connection.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
                continue;
            }
            let _ = connection.write_all(parts[0]);
            if rest_allowed.recv_timeout(Duration::from_secs(20)).is_ok() {
                let _ = connection.write_all(parts[1]);
            }
            return;
        }
    });
    (addr, go_on)
}

/// The front end before a raw engine at `engine`, whose events nobody publishes (the rank is
/// routed by load).
pub fn routing_to(engine: SocketAddr) -> RunningService {
    let dead_port = super::free_port();
    let toml = indexer_toml(
        None,
        16,
        &[EngineToml {
            model: Some(MODEL.into()),
            openai_url: Some(format!("http://{engine}")),
            ..EngineToml::new("raw", dead_port)
        }],
    ) + &route_table("127.0.0.1:0", &[("health_interval_s", "0")]);
    super::start_service(&toml)
}

/// The address `server` listens on, to send it requests directly.
pub fn addr_of(server: &OpenAiServer) -> SocketAddr {
    server
        .url()
        .trim_start_matches("http://")
        .parse()
        .expect("an IP:port")
}

/// Serves `body` on rank `rank` of `server` (engine `engine`) directly, and waits until the
/// index behind `api` shows that rank holding the prompt's blocks (its ids as the engine's
/// `/tokenize` makes them: the indexer may have no tokenizer of its own).
pub fn warm_at(
    server: &OpenAiServer,
    api: SocketAddr,
    engine: usize,
    rank: u32,
    path: &str,
    body: &Value,
) {
    let addr = addr_of(server);
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
    let asked = match path {
        "/v1/chat/completions" => json!({ "model": MODEL, "messages": body["messages"] }),
        _ => json!({ "model": MODEL, "prompt": body["prompt"] }),
    };
    let ids = Connection::open(addr).send("POST", "/tokenize", Some(asked.to_string().as_bytes()));
    assert_eq!(ids.status, 200, "{}", ids.text());
    let query = json!({ "model": MODEL, "token_ids": ids.json()["tokens"] });
    let instance = Fleet::name(engine);
    wait_for(20, "the index to hold the warmed prompt", || {
        let answer =
            Connection::open(api).send("POST", "/query", Some(query.to_string().as_bytes()));
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

/// The front end behind `api` has counted one answered request and released its reservation.
pub fn one_answered_and_released(api: SocketAddr) {
    wait_for(10, "the answer to be counted", || {
        (metric_value(api, "kv_indexer_route_requests_total{outcome=\"answered\"}") == Some(1.0))
            .then_some(())
    });
    assert_eq!(
        get(api, "/loads").json()[0]["reservations"].as_u64(),
        Some(0),
        "released at the answer's end"
    );
}
