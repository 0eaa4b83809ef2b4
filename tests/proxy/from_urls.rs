//! One command to route: the real binary started from engines' URLs alone (`--engine`,
//! `--route-listen`, or their environment variables), no file, against simulated engines on
//! 127.0.0.1 whose one OpenAI port also says where their ranks publish: a vLLM-style one
//! (`GET /kv_event_sources`) and an SGLang-style one (`GET /server_info`, rank r on port + r).
//! Every wait has a deadline.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::http_client::{get, metric_value, post, wait_for};
use crate::support::{free_port, indexer_binary};
use kv_indexer_sim::openai::{EventSources, OpenAiConfig};
use kv_indexer_sim::ports::free_port_range;
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::server::{SimConfig, SimEngine};
use kv_indexer_sim::tokenizer_dir;
use serde_json::json;

const VLLM_MODEL: &str = "vllm-model";
const SGLANG_MODEL: &str = "sglang-model";

/// Two ranks behind one OpenAI port serving `model`, saying where they publish as `sources`
/// does, each with its replay socket (the index is trusted, `active`, once the replay confirms
/// it). SGLang's answer gives rank 0's ports only (rank r is on port + r), so its ranks are
/// bound on consecutive ports: picked free, and picked again when another process took one
/// meanwhile.
fn engine(model: &str, sources: EventSources, tokenizers: &Path) -> SimEngine {
    let mut failures = Vec::new();
    for _ in 0..20 {
        let (port, replay) = match sources {
            EventSources::Sglang => match (free_port_range(2), free_port_range(2)) {
                (Some(port), Some(replay)) => (port, replay),
                _ => continue,
            },
            EventSources::Vllm | EventSources::None => (0, 0),
        };
        let started = SimEngine::start(SimConfig {
            dp_size: 2,
            port,
            replay_port: Some(replay),
            recover_port: None,
            openai_port: Some(0),
            openai: OpenAiConfig {
                model: model.into(),
                // The engine's own; kv-indexer is given none, and routes by load.
                tokenizer: Some(tokenizers.join("chatml")),
                sources,
                ..OpenAiConfig::default()
            },
            seed: 11,
            ..SimConfig::default()
        });
        match started {
            Ok(engine) => return engine,
            Err(error) => failures.push(format!("{error:#}")),
        }
    }
    panic!("no simulated engine started in 20 tries: {failures:#?}");
}

/// The simulator's tokenizer directories, for the engines' own tokenizing.
fn tokenizers() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    tokenizer_dir::write_all(dir.path()).expect("tokenizer directories");
    dir
}

fn url(engine: &SimEngine) -> String {
    engine.openai_url().expect("its OpenAI server runs")
}

/// The name kv-indexer derives from the engine's URL: host-port.
fn name(engine: &SimEngine) -> String {
    format!(
        "127.0.0.1-{}",
        engine.openai_port().expect("its OpenAI server")
    )
}

fn chat(model: &str) -> Vec<u8> {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Which rank answers?"}],
        "max_tokens": 2,
    })
    .to_string()
    .into_bytes()
}

/// `kv-indexer ARGS` in an empty directory (no `indexer.toml` there), with `env`.
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().expect("temp dir");
    Command::new(indexer_binary())
        .current_dir(dir.path())
        .args(args)
        .env_remove("KV_INDEXER_ENGINES")
        .env_remove("KV_INDEXER_ROUTE_LISTEN")
        .envs(env.iter().copied())
        .output()
        .expect("running kv-indexer")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn engines_given_by_url_alone_are_discovered_and_routed_to_the_rank_chosen() {
    let tokenizers = tokenizers();
    let vllm = engine(VLLM_MODEL, EventSources::Vllm, tokenizers.path());
    let sglang = engine(SGLANG_MODEL, EventSources::Sglang, tokenizers.path());
    let route = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args = [
        "--engine".to_string(),
        url(&vllm),
        "--engine".to_string(),
        url(&sglang),
        "--route-listen".to_string(),
        route.to_string(),
    ];
    let indexer = IndexerProcess::launch(indexer_binary(), "")
        .without_file()
        .args(&args)
        .log_filter("info")
        .start(Duration::from_secs(20))
        .unwrap_or_else(|error| panic!("{error:#}"));
    let api = indexer.address;
    // Ready: both engines discovered, their four ranks' event links up.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ready = get(api, "/ready");
        if ready.status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not ready in 30 s: {}\n{}",
            ready.text(),
            indexer.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = indexer.log();
    assert!(
        log.contains("no --config and no indexer.toml here"),
        "{log}"
    );
    let mut expected = vec![
        (name(&vllm), VLLM_MODEL.to_string(), 2),
        (name(&sglang), SGLANG_MODEL.to_string(), 2),
    ];
    expected.sort();
    // Each engine's answer is applied on its own: wait until both are.
    wait_for(20, "both engines' ranks, with their models", || {
        let workers = get(api, "/workers").json();
        let engines: Vec<(String, String, usize)> = workers
            .as_array()?
            .iter()
            .map(|engine| {
                let listeners = engine["listeners"].as_array().map_or(0, Vec::len);
                let name = engine["instance"].as_str().unwrap_or_default().to_string();
                let model = engine["model"].as_str().unwrap_or_default().to_string();
                (name, model, listeners)
            })
            .collect();
        (engines == expected).then_some(())
    });
    wait_for(20, "every rank ready", || {
        (get(api, "/ready").status == 200).then_some(())
    });

    // The front end lists the models the engines said they serve.
    let models = get(route, "/v1/models").json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("a list of models")
        .iter()
        .filter_map(|model| model["id"].as_str())
        .collect();
    let mut ids = ids;
    ids.sort_unstable();
    assert_eq!(ids, [SGLANG_MODEL, VLLM_MODEL], "{models}");

    for (engine, model) in [(&vllm, VLLM_MODEL), (&sglang, SGLANG_MODEL)] {
        let openai = engine.openai().expect("its OpenAI server");
        for _ in 0..2 {
            let reply = post(route, "/v1/chat/completions", &chat(model));
            assert_eq!(reply.status, 200, "{}", reply.text());
            // Only the engine serving the model, at the rank the indexer chose, by its header.
            let chosen = reply.header("x-kv-indexer-rank").expect("the rank chosen");
            let (engine_name, rank) = chosen.rsplit_once('/').expect("ENGINE/RANK");
            assert_eq!(engine_name, name(engine), "{model}");
            let seen = openai.last_request().expect("the engine saw the request");
            assert_eq!(seen.header("x-data-parallel-rank"), Some(rank), "{model}");
            // No tokenizer for this model here: the engine's own `POST /tokenize` made the
            // ids the choice was weighed on, and the answer says so.
            assert_eq!(
                reply.header("x-kv-indexer-tokenizer"),
                Some("engine"),
                "{model}"
            );
            assert_eq!(reply.header("x-kv-indexer-routing"), None, "{model}");
        }
        assert_eq!(
            openai.requests(),
            2,
            "{model}: each of its requests, no other"
        );
    }

    // A reload reads the same source again (no file, the same flags): nothing leaves.
    indexer
        .signal(libc::SIGHUP)
        .unwrap_or_else(|error| panic!("{error:#}"));
    let applied = wait_for(10, "the reload to be applied", || {
        let log = indexer.log();
        log.lines()
            .find(|line| {
                line.contains("reload of (no file: defaults and the command line) applied")
            })
            .map(str::to_string)
    });
    assert!(applied.contains("removed [], replaced []"), "{applied}");
    let reply = post(route, "/v1/chat/completions", &chat(SGLANG_MODEL));
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// An engine that publishes no KV events, its tokenizers' directory (kept while it runs), and
/// kv-indexer started from its URL alone with `env`, routing on `route`.
struct SilentRouted {
    _tokenizers: tempfile::TempDir,
    silent: SimEngine,
    route: SocketAddr,
    indexer: IndexerProcess,
}

fn routing_to_silent_engine(env: &[(String, String)]) -> SilentRouted {
    let tokenizers = tokenizers();
    let silent = engine(VLLM_MODEL, EventSources::None, tokenizers.path());
    let route = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args = [
        "--engine".to_string(),
        url(&silent),
        "--route-listen".to_string(),
        route.to_string(),
    ];
    let indexer = IndexerProcess::launch(indexer_binary(), "")
        .without_file()
        .args(&args)
        .env(env)
        .start(Duration::from_secs(20))
        .unwrap_or_else(|error| panic!("{error:#}"));
    SilentRouted {
        _tokenizers: tokenizers,
        silent,
        route,
        indexer,
    }
}

#[test]
fn an_engine_that_publishes_no_events_is_routed_by_load_and_says_why() {
    // Every part bound: what a pattern leaves out of a temporary is dropped at once.
    let SilentRouted {
        _tokenizers,
        silent,
        route,
        indexer,
    } = routing_to_silent_engine(&[]);
    let api = indexer.address;
    // One rank, with no event link, and /workers says why.
    let listeners = wait_for(10, "the engine's one rank", || {
        let workers = get(api, "/workers").json();
        let listeners = workers[0]["listeners"].as_array()?.clone();
        (!listeners.is_empty()).then_some(listeners)
    });
    assert_eq!(listeners.len(), 1, "{listeners:?}");
    assert_eq!(listeners[0]["dp_rank"], 0);
    assert_eq!(listeners[0]["connected"], false);
    let reason = listeners[0]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("publishes no KV events"), "{reason}");
    // Not waited for: the indexer is ready.
    assert_eq!(get(api, "/ready").status, 200);

    // A prompt of token ids: what the index would be asked, had the rank an event link.
    let completion =
        json!({"model": VLLM_MODEL, "prompt": (1..=64).collect::<Vec<u32>>(), "max_tokens": 2})
            .to_string()
            .into_bytes();
    let reply = post(route, "/v1/completions", &completion);
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-kv-indexer-rank"),
        Some(format!("{}/0", name(&silent)).as_str())
    );
    let routing = reply.header("x-kv-indexer-routing").unwrap_or_default();
    assert!(
        routing.starts_with(&format!(
            "load only: rank {}/0: the engine publishes no KV events",
            name(&silent)
        )),
        "{routing}"
    );
    let openai = silent.openai().expect("its OpenAI server");
    let seen = openai.last_request().expect("the engine saw the request");
    assert_eq!(seen.header("x-data-parallel-rank"), Some("0"));
    let counted = metric_value(
        api,
        "kv_indexer_route_load_only_total{reason=\"no_events\"}",
    );
    assert_eq!(counted, Some(1.0));
    // `--check --discover` shows it so.
    let checked = run(&["--check", "--discover", "--engine", &url(&silent)], &[]);
    let stdout = text(&checked.stdout);
    assert!(checked.status.success(), "{checked:?}");
    let row: Vec<&str> = stdout
        .lines()
        .find(|line| line.starts_with(&name(&silent)))
        .expect("its row")
        .split_whitespace()
        .collect();
    assert_eq!((row[2], row[row.len() - 1]), ("-", "no-events"), "{stdout}");

    // Nothing matched: the rank holds no block (a later request may still be predicted to
    // find what this one left there, as on any rank).
    assert_eq!(
        reply.header("x-kv-indexer-predicted-cached-tokens"),
        Some("0")
    );
}

#[test]
fn the_environment_names_the_engines_and_check_prints_what_they_answer() {
    let tokenizers = tokenizers();
    let vllm = engine(VLLM_MODEL, EventSources::Vllm, tokenizers.path());
    let sglang = engine(SGLANG_MODEL, EventSources::Sglang, tokenizers.path());
    let engines = format!("{}, {}", url(&vllm), url(&sglang));
    let output = run(
        &["--check", "--discover"],
        &[
            ("KV_INDEXER_ENGINES", &engines),
            ("KV_INDEXER_ROUTE_LISTEN", "127.0.0.1:18080"),
        ],
    );
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    for (engine, model, kind) in [
        (&vllm, VLLM_MODEL, "vllm"),
        (&sglang, SGLANG_MODEL, "sglang"),
    ] {
        let rows: Vec<Vec<&str>> = stdout
            .lines()
            .filter(|line| line.starts_with(&format!("{} ", name(engine))))
            .map(|line| line.split_whitespace().collect())
            .collect();
        assert_eq!(rows.len(), 2, "{stdout}");
        for (rank, row) in rows.iter().enumerate() {
            assert_eq!(row[1], rank.to_string(), "{stdout}");
            assert_eq!(row[row.len() - 2..], [model, kind], "{stdout}");
        }
        assert!(
            stdout.contains(&format!(
                "  {} -> {}; tokenizer: the engine's POST /tokenize\n",
                name(engine),
                url(engine)
            )),
            "{stdout}"
        );
    }
    assert!(stdout.contains("route: listen 127.0.0.1:18080"), "{stdout}");
}

#[test]
fn an_engine_given_by_url_that_clashes_with_a_file_engine_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("indexer.toml");
    std::fs::write(
        &file,
        "[[engine]]\nname = \"127.0.0.1-9\"\nhost = \"127.0.0.1\"\n",
    )
    .expect("writing the file");
    let file = file.display().to_string();
    let output = run(
        &[
            "--check",
            "--config",
            &file,
            "--engine",
            "http://127.0.0.1:9",
            "--engine",
            "http://127.0.0.1:10",
        ],
        &[],
    );
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        stderr.contains(
            "--engine http://127.0.0.1:9: its name \"127.0.0.1-9\" is an [[engine]] of the file \
             already"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("1 problem found; nothing started"),
        "{stderr}"
    );

    // Without the clash, the file's engine and the flag's are both in the plan.
    let output = run(
        &[
            "--check",
            "--config",
            &file,
            "--engine",
            "http://127.0.0.1:10",
        ],
        &[],
    );
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(stdout.contains("2 engines, 1 listener"), "{stdout}");
}

#[test]
fn help_says_it_routes_and_how_to_start_from_urls() {
    let output = run(&["--help"], &[]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let first = stdout.lines().next().unwrap_or_default();
    assert!(
        first.contains("indexer and router") && first.contains("routes OpenAI-compatible"),
        "{stdout}"
    );
    assert!(stdout.contains("--engine <URL>"), "{stdout}");
    assert!(stdout.contains("KV_INDEXER_ENGINES"), "{stdout}");
    assert!(
        stdout.contains("kv-indexer --engine http://HOST:8000 --route-listen 0.0.0.0:8080"),
        "{stdout}"
    );
}

/// A child process killed when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// README "Quick start": the no-Docker routing demo, its three commands run as written but for
/// their ports (free ones instead, so that tests run in parallel) and the tokenizers' directory
/// (a temporary one): the simulated engine, the router from its URL alone, and the same chat
/// twice, the second found cached on the rank the first went to.
#[test]
fn the_readmes_routing_demo_runs_as_written() {
    let readme = include_str!("../../README.md");
    let demo: Vec<&str> = readme
        .lines()
        .skip_while(|line| {
            !line.starts_with(
                "cargo run --release --example mock_engine -- --dp-size 2 --openai-port",
            )
        })
        .take(3)
        .collect();
    assert_eq!(
        demo.len(),
        3,
        "the README's routing demo: engine, router, chat"
    );
    let engine_args = demo[0]
        .strip_prefix("cargo run --release --example mock_engine -- ")
        .expect("the engine's command");
    let router_args = demo[1]
        .strip_prefix("cargo run --release -- ")
        .expect("the router's command");
    let chat = demo[2]
        .split_once("-d '")
        .and_then(|(_, rest)| rest.strip_suffix('\''))
        .expect("the chat's body");
    let chat: serde_json::Value = serde_json::from_str(chat).expect("the chat is JSON");

    let openai = free_port().to_string();
    let route = free_port().to_string();
    // Three pairs of ports in a row, apart from each other: picked again when the port after
    // the OS's pick was taken.
    let mut pairs: Vec<u16> = Vec::new();
    for _ in 0..100 {
        if pairs.len() == 3 {
            break;
        }
        if let Some(base) = free_port_range(2) {
            if pairs.iter().all(|other| base.abs_diff(*other) > 1) {
                pairs.push(base);
            }
        }
    }
    let [events, replay, recover] = pairs[..] else {
        panic!("no three pairs of free ports in a row in 100 tries: {pairs:?}")
    };
    let tokenizers = tempfile::tempdir().expect("temp dir");
    let tokenizers = tokenizers.path().join("tokenizers");
    let swap = |args: &str| -> Vec<String> {
        args.split_whitespace()
            .map(|arg| match arg {
                // Whole arguments and `:PORT`s only: a free port may contain "8000" or "8080".
                "8000" => openai.clone(),
                "/tmp/kv-indexer-tokenizers" => tokenizers.display().to_string(),
                _ => arg
                    .replace(":8000", &format!(":{openai}"))
                    .replace(":8080", &format!(":{route}")),
            })
            .collect()
    };
    let mock = indexer_binary()
        .parent()
        .expect("the build's directory")
        .join("examples")
        .join("mock_engine");
    let mut engine_command = Command::new(&mock);
    engine_command
        .args(swap(engine_args))
        .args(["--port", &events.to_string()])
        .args(["--replay-port", &replay.to_string()])
        .args(["--recover-port", &recover.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _engine = Child(engine_command.spawn().unwrap_or_else(|error| {
        panic!(
            "{}: {error} (cargo test builds the examples)",
            mock.display()
        )
    }));
    let engine_url: SocketAddr = format!("127.0.0.1:{openai}").parse().expect("an address");
    wait_for(30, "the simulated engine's OpenAI server", || {
        std::net::TcpStream::connect(engine_url).ok()?;
        (get(engine_url, "/health").status == 200).then_some(())
    });

    let router = IndexerProcess::launch(indexer_binary(), "")
        .without_file()
        .args(&swap(router_args))
        .start(Duration::from_secs(20))
        .unwrap_or_else(|error| panic!("{error:#}"));
    wait_for(30, "the engine's two ranks ready", || {
        (get(router.address, "/ready").status == 200).then_some(())
    });
    let route: SocketAddr = format!("127.0.0.1:{route}").parse().expect("an address");
    let send = || {
        let reply = post(route, "/v1/chat/completions", chat.to_string().as_bytes());
        assert_eq!(reply.status, 200, "{}", reply.text());
        let rank = reply.header("x-kv-indexer-rank").map(str::to_owned);
        assert_eq!(reply.header("x-kv-indexer-tokenizer"), Some("engine"));
        let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        (rank, cached)
    };
    let (first_rank, first_cached) = send();
    assert_eq!(first_cached, Some(0), "nothing cached the first time");
    wait_for(20, "the second send found cached", || {
        let (rank, cached) = send();
        (cached >= Some(16)).then(|| assert_eq!(rank, first_rank, "the warm rank"))
    });
}

/// An engine given by URL alone whose model (from its `/v1/models`) has a snapshot in the local
/// Hugging Face cache: the router tokenizes with that tokenizer, never asking the engine.
#[test]
fn an_engine_given_by_url_is_tokenized_from_the_hugging_face_cache_when_its_model_is_there() {
    let tokenizers = tokenizers();
    let vllm = engine(VLLM_MODEL, EventSources::Vllm, tokenizers.path());
    let hub = crate::support::hf_hub_with(VLLM_MODEL, &tokenizers.path().join("chatml"));
    let route = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args = [
        "--engine".to_string(),
        url(&vllm),
        "--route-listen".to_string(),
        route.to_string(),
    ];
    let env = [("HF_HUB_CACHE".to_owned(), hub.path().display().to_string())];
    let indexer = IndexerProcess::launch(indexer_binary(), "")
        .without_file()
        .args(&args)
        .env(&env)
        .log_filter("info")
        .start(Duration::from_secs(20))
        .unwrap_or_else(|error| panic!("{error:#}"));
    wait_for(30, "the engine's ranks ready, its model known", || {
        let workers = get(indexer.address, "/workers").json();
        let known = workers.as_array()?.iter().any(|e| e["model"] == VLLM_MODEL);
        (known && get(indexer.address, "/ready").status == 200).then_some(())
    });
    let openai = vllm.openai().expect("its OpenAI server");
    let reply = wait_for(20, "the cache's tokenizer in use", || {
        let reply = post(route, "/v1/chat/completions", &chat(VLLM_MODEL));
        assert_eq!(reply.status, 200, "{}", reply.text());
        (reply.header("x-kv-indexer-tokenizer") == Some("hf_cache")).then_some(reply)
    });
    assert_eq!(reply.header("x-kv-indexer-routing"), None);
    assert!(
        indexer.log().contains("(from the Hugging Face cache)"),
        "{}",
        indexer.log()
    );
    assert_eq!(openai.tokenize_requests(), 0, "the engine is never asked");
}

/// Built with the `otlp` feature (`cargo test --features otlp`) and started with
/// `OTEL_EXPORTER_OTLP_ENDPOINT`, the binary sends a routed request's `route_request` span,
/// with its id, to the collector there over HTTP/protobuf, by its clean stop at the latest.
#[cfg(feature = "otlp")]
#[test]
fn the_otlp_feature_exports_a_routed_requests_span_to_the_collector() {
    let collector = tiny_http::Server::http("127.0.0.1:0").expect("the collector binds");
    let collector_addr = collector.server_addr().to_ip().expect("an IP address");
    let env = [(
        "OTEL_EXPORTER_OTLP_ENDPOINT".to_string(),
        format!("http://{collector_addr}"),
    )];
    let SilentRouted {
        _tokenizers,
        silent: _silent,
        route,
        mut indexer,
    } = routing_to_silent_engine(&env);
    wait_for(10, "the engine's rank", || {
        (get(indexer.address, "/ready").status == 200).then_some(())
    });
    let request_id = format!("otlp-{}", std::process::id());
    let reply = crate::support::http_client::Connection::open(route).send_with(
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("x-request-id", &request_id),
        ],
        Some(&chat(VLLM_MODEL)),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    indexer.signal(libc::SIGTERM).expect("SIGTERM");
    let (status, _) = indexer
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|error| panic!("{error:#}\n{}", indexer.log()));
    assert!(status.success(), "{status:?}\n{}", indexer.log());

    // The export was sent before the exit: it waits in the collector's queue.
    let mut exported = Vec::new();
    while let Ok(Some(mut request)) = collector.recv_timeout(Duration::from_secs(1)) {
        let mut body = Vec::new();
        std::io::Read::read_to_end(request.as_reader(), &mut body).expect("the body");
        let content_type = request
            .headers()
            .iter()
            .find(|header| header.field.equiv("Content-Type"))
            .map(|header| header.value.to_string());
        exported.push((request.url().to_owned(), content_type, body));
        let _ = request.respond(tiny_http::Response::empty(200));
    }
    let holds = |body: &[u8], text: &str| body.windows(text.len()).any(|w| w == text.as_bytes());
    let span = exported
        .iter()
        .find(|(_, _, body)| holds(body, &request_id))
        .unwrap_or_else(|| panic!("no export holds {request_id}: {} sent", exported.len()));
    assert_eq!(span.0, "/v1/traces");
    assert_eq!(span.1.as_deref(), Some("application/x-protobuf"));
    for field in ["route_request", "served_cached_tokens", "kv-indexer"] {
        assert!(holds(&span.2, field), "{field} missing from the export");
    }
}
