//! The `kv-indexer` command: reads the command line, sets up logging, loads and validates the
//! configuration, then either prints the expanded plan (`--check`) or hands everything to
//! `service::run`. It never serves anything itself, and starts nothing from a broken file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kv_indexer::config::{self, Config};
use kv_indexer::{plan, service};

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
    /// Validate the file, print the expanded per-rank plan, and exit: 0 when valid, else 1.
    #[arg(long)]
    check: bool,
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
        let specs = plan::expand(&config);
        print!("{}", plan::render_table(&specs));
        println!(
            "{}, {}; listen {}, block_size {}, shards {}",
            count(config.engines.len(), "engine", "engines"),
            count(specs.len(), "listener", "listeners"),
            args.listen.as_deref().unwrap_or(&config.listen),
            config.block_size,
            config.shards
        );
        return ExitCode::SUCCESS;
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

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}
