//! The `kv-indexer` command: reads the command line (and `KV_INDEXER_ENGINES`,
//! `KV_INDEXER_ROUTE_LISTEN`), sets up logging, loads and validates the configuration (the file,
//! or the defaults without one, plus the engines given by URL), then either prints the expanded
//! plan (`--check`, offline; with `--discover` after asking every discovered engine) or hands
//! everything to `service::run`. It never serves anything itself, and starts nothing from a
//! broken file.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use kv_indexer::config::{self, Config, Flags, Source};
use kv_indexer::discover::{Client, DiscoverError, Limits};
use kv_indexer::plan::{self, Discoveries};
use kv_indexer::preflight;
use kv_indexer::proxy::Proxy;
use kv_indexer::service;
use kv_indexer::tokenize::hf_cache;
use tracing::info;

/// The file read when `--config` is not given, if it exists.
const DEFAULT_CONFIG: &str = "indexer.toml";

/// The engines' URLs when no `--engine` is given: separated by commas or spaces.
const ENGINES_ENV: &str = "KV_INDEXER_ENGINES";
/// The route front end's address when no `--route-listen` is given.
const ROUTE_LISTEN_ENV: &str = "KV_INDEXER_ROUTE_LISTEN";

/// The command line; `--help`'s first line is the package's description (it says it routes),
/// its example is `after_help`.
#[derive(Parser)]
#[command(
    version,
    about,
    after_help = "Route with no file: kv-indexer --engine http://HOST:8000 --route-listen 0.0.0.0:8080"
)]
struct Args {
    /// The configuration file (default: indexer.toml, when it exists; without one every
    /// default applies and the engines come from --engine).
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// An engine's OpenAI server, e.g. http://10.0.0.5:8000 (repeatable; env
    /// KV_INDEXER_ENGINES, comma- or space-separated): its ranks are asked of its
    /// /kv_event_sources (vLLM) or /server_info (SGLang), its model of its /v1/models, and
    /// requests are routed to it; added to the file's engines.
    #[arg(long = "engine", value_name = "URL")]
    engines: Vec<String>,
    /// Serve the OpenAI-compatible route front end here, IP:port (env KV_INDEXER_ROUTE_LISTEN);
    /// overrides the file's [route] listen.
    #[arg(long, value_name = "ADDR")]
    route_listen: Option<String>,
    /// HTTP API address (IP:port or hostname:port); overrides the file's `listen`.
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Validate the file, print the expanded per-rank plan, read the files it points to (token,
    /// key and tokenizer files), resolve its addresses, and exit: 0 when valid, else 1.
    /// Offline: an engine with `discover` shows no ranks.
    #[arg(long)]
    check: bool,
    /// With --check: also ask every engine with `discover` for its ranks and print the plan
    /// kv-indexer would run (SOURCE marks the rows from an engine's answer); 1 when an engine
    /// cannot be asked.
    #[arg(long, requires = "check")]
    discover: bool,
}

/// `--check`'s route plan: where the front end listens and each engine's OpenAI server.
fn route_plan(config: &Config, route: &config::Route) -> String {
    let mut text =
        format!(
        "route: listen {}, up to {} requests at once, first byte within {}s, idle {}s, token {}\n",
        route.listen,
        route.max_concurrent_requests,
        route.first_byte_timeout_s,
        route.idle_timeout_s,
        if route.auth_token_file.is_some() { "required" } else { "none" },
    );
    let hub = hf_cache::hub_root();
    for ((engine, server), engine_config) in Proxy::plan(config).into_iter().zip(&config.engines) {
        let tokenizer = preflight::tokenizer_source(config, engine_config, hub.as_deref());
        match server {
            Some(url) => text.push_str(&format!("  {engine} -> {url}; {tokenizer}\n")),
            None => text.push_str(&format!(
                "  {engine}: no openai_url (and no discover): not routed to\n"
            )),
        }
    }
    text
}

fn main() -> ExitCode {
    let args = Args::parse();
    let _logging = kv_indexer::logs::init("info");

    let source = source(&args);
    let (config, problems) = load(&args, &source);
    let Some(config) = config.filter(|_| problems.is_empty()) else {
        for problem in &problems {
            eprintln!("{problem}");
        }
        eprintln!(
            "{}: {} found; nothing started",
            source.describe(),
            count(problems.len(), "problem", "problems")
        );
        return ExitCode::FAILURE;
    };

    if args.check {
        let (discovered, failed) = match args.discover {
            true => match ask_engines(&config) {
                Ok(asked) => asked,
                Err(err) => {
                    eprintln!("--discover: no runtime to ask the engines on: {err}");
                    return ExitCode::FAILURE;
                }
            },
            false => (Discoveries::new(), Vec::new()),
        };
        let specs = plan::expand_with(&config, &discovered);
        print!("{}", plan::render_table(&specs, &discovered));
        println!(
            "{}, {}; listen {}, block_size {}",
            count(config.engines.len(), "engine", "engines"),
            count(specs.len(), "listener", "listeners"),
            args.listen.as_deref().unwrap_or(&config.listen),
            config.block_size,
        );
        if let Some(route) = &config.route {
            print!("{}", route_plan(&config, route));
        }
        let origin = source.describe();
        let text = source
            .path
            .as_ref()
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default();
        let listen = args.listen.as_deref().unwrap_or(&config.listen);
        let findings = preflight::check(&config, listen, &text, &origin);
        for warning in &findings.warnings {
            eprintln!("warning: {warning}");
        }
        if !findings.problems.is_empty() {
            for problem in &findings.problems {
                eprintln!("{problem}");
            }
            eprintln!(
                "{origin}: {} found in what the file points to; nothing would start",
                count(findings.problems.len(), "problem", "problems")
            );
            return ExitCode::FAILURE;
        }
        if failed.is_empty() {
            return ExitCode::SUCCESS;
        }
        for error in &failed {
            eprintln!("{error}");
        }
        eprintln!(
            "{}: {} could not be asked; their ranks are missing above",
            source.describe(),
            count(failed.len(), "engine", "engines")
        );
        return ExitCode::FAILURE;
    }

    match service::run(source, config, args.listen) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kv-indexer: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Where the configuration comes from: `--config`, else `indexer.toml` when it exists, else no
/// file (said in the log); the engines of `--engine`, else of `KV_INDEXER_ENGINES`; the route
/// listener of `--route-listen`, else of `KV_INDEXER_ROUTE_LISTEN`.
fn source(args: &Args) -> Source {
    let path = match &args.config {
        Some(path) => Some(path.clone()),
        None if Path::new(DEFAULT_CONFIG).exists() => Some(PathBuf::from(DEFAULT_CONFIG)),
        None => {
            info!(
                "no --config and no {DEFAULT_CONFIG} here: every default applies (docs.md \
                 \"Configuration reference\"), the engines are those of --engine"
            );
            None
        }
    };
    let env = |name: &str| {
        std::env::var(name)
            .ok()
            .filter(|value| !value.trim().is_empty())
    };
    let engines = match args.engines.is_empty() {
        true => env(ENGINES_ENV).map_or_else(Vec::new, |urls| Flags::split_urls(&urls)),
        false => args.engines.clone(),
    };
    let route_listen = args.route_listen.clone().or_else(|| env(ROUTE_LISTEN_ENV));
    Source {
        path,
        flags: Flags {
            engines,
            route_listen,
        },
    }
}

/// The configuration, and every problem with it and with `--listen`.
fn load(args: &Args, source: &Source) -> (Option<Config>, Vec<String>) {
    let mut problems = Vec::new();
    if let Some(listen) = &args.listen {
        if let Err(why) = config::validate_listen(listen) {
            problems.push(format!("--listen: {why}"));
        }
    }
    match source.load() {
        Ok(config) => (Some(config), problems),
        Err(err) => {
            problems.extend(err.problems);
            (None, problems)
        }
    }
}

/// Asks every engine with `discover` at once, on a runtime of the check's own (an engine may
/// take `Limits::whole` to fail); a disagreement with the file is printed as a warning.
fn ask_engines(config: &Config) -> std::io::Result<(Discoveries, Vec<DiscoverError>)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = std::sync::Arc::new(Client::new(Limits::default()));
    let mut answers = runtime.block_on(async {
        let mut asking = tokio::task::JoinSet::new();
        for (at, engine) in config.engines.iter().enumerate() {
            let Some(discover) = engine.discover().cloned() else {
                continue;
            };
            let (client, name) = (client.clone(), engine.name.clone());
            asking.spawn(async move {
                let answer = client.discover(&discover.api, None).await;
                if let Ok(discovery) = &answer {
                    for disagreement in discovery.disagreements(&discover.file) {
                        eprintln!(
                            "warning: engine {name}: {}; the engine wins",
                            disagreement.detail
                        );
                    }
                }
                (at, name, answer)
            });
        }
        asking.join_all().await
    });
    // The file's order, whichever engine answered first.
    answers.sort_by_key(|(at, _, _)| *at);
    let mut discovered = Discoveries::new();
    let mut failed = Vec::new();
    for (_, engine, answer) in answers {
        match answer {
            Ok(discovery) => {
                discovered.insert(engine, discovery);
            }
            Err(error) => failed.push(error),
        }
    }
    Ok((discovered, failed))
}

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}
