//! The `kv-indexer` command: reads the command line, sets up logging, loads and validates the
//! configuration, then either prints the expanded plan (`--check`, offline; with `--discover`
//! after asking every discovered engine) or hands everything to `service::run`. It never serves
//! anything itself, and starts nothing from a broken file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kv_indexer::config::{self, Config};
use kv_indexer::discover::{Client, DiscoverError, Limits};
use kv_indexer::plan::{self, Discoveries};
use kv_indexer::preflight;
use kv_indexer::route::RouteFront;
use kv_indexer::service;
use kv_indexer::tokenize::hf_cache;

/// A standalone KV-cache indexer for LLM serving.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// The configuration file.
    #[arg(long, value_name = "PATH", default_value = "indexer.toml")]
    config: PathBuf,
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
    for ((engine, server), engine_config) in
        RouteFront::plan(config).into_iter().zip(&config.engines)
    {
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
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();

    let (config, problems) = load(&args);
    let Some(config) = config.filter(|_| problems.is_empty()) else {
        for problem in &problems {
            eprintln!("{problem}");
        }
        eprintln!(
            "{}: {} found; nothing started",
            args.config.display(),
            count(problems.len(), "problem", "problems")
        );
        return ExitCode::FAILURE;
    };

    if args.check {
        let (discovered, failed) = match args.discover {
            true => ask_engines(&config),
            false => (Discoveries::new(), Vec::new()),
        };
        let specs = plan::expand_with(&config, &discovered);
        print!("{}", plan::render_table(&specs, &discovered));
        println!(
            "{}, {}; listen {}, block_size {}, shards {}",
            count(config.engines.len(), "engine", "engines"),
            count(specs.len(), "listener", "listeners"),
            args.listen.as_deref().unwrap_or(&config.listen),
            config.block_size,
            config.shards
        );
        if let Some(route) = &config.route {
            print!("{}", route_plan(&config, route));
        }
        let origin = args.config.display().to_string();
        let text = std::fs::read_to_string(&args.config).unwrap_or_default();
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
            args.config.display(),
            count(failed.len(), "engine", "engines")
        );
        return ExitCode::FAILURE;
    }

    match service::run(&args.config, config, args.listen) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kv-indexer: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The configuration, and every problem with it and with `--listen`.
fn load(args: &Args) -> (Option<Config>, Vec<String>) {
    let mut problems = Vec::new();
    if let Some(listen) = &args.listen {
        if let Err(why) = config::validate_listen(listen) {
            problems.push(format!("--listen: {why}"));
        }
    }
    match Config::load(&args.config) {
        Ok(config) => (Some(config), problems),
        Err(err) => {
            problems.extend(err.problems);
            (None, problems)
        }
    }
}

/// Asks every engine with `discover` at once, one thread each (an engine may take
/// `Limits::whole` to fail); a disagreement with the file is printed as a warning.
fn ask_engines(config: &Config) -> (Discoveries, Vec<DiscoverError>) {
    let client = Client::new(Limits::default());
    let answers: Vec<(String, Result<_, DiscoverError>)> = std::thread::scope(|scope| {
        let asking: Vec<_> = config
            .engines
            .iter()
            .filter_map(|engine| Some((engine, engine.discover()?)))
            .map(|(engine, discover)| {
                let client = &client;
                scope.spawn(move || {
                    let answer = client.discover(&discover.api, None);
                    if let Ok(discovery) = &answer {
                        for disagreement in discovery.disagreements(&discover.file) {
                            eprintln!(
                                "warning: engine {}: {}; the engine wins",
                                engine.name, disagreement.detail
                            );
                        }
                    }
                    (engine.name.clone(), answer)
                })
            })
            .collect();
        asking
            .into_iter()
            .filter_map(|thread| thread.join().ok())
            .collect()
    });
    let mut discovered = Discoveries::new();
    let mut failed = Vec::new();
    for (engine, answer) in answers {
        match answer {
            Ok(discovery) => {
                discovered.insert(engine, discovery);
            }
            Err(error) => failed.push(error),
        }
    }
    (discovered, failed)
}

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}
