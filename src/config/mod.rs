//! indexer.toml: its types, defaults and loading (docs.md "Configuration reference").
//!
//! Owns the file format and every rule a file must satisfy before anything runs, and the
//! top-level keys. It reports every problem it finds, each naming the file, the line, the engine
//! and the key, so one edit fixes a broken file. It never opens a socket and never expands ranks
//! into listeners (that is `plan`). The rules live beside what they check:
//!
//! - `diagnostics`: the `FILE:LINE: section: problem` list;
//! - `keys`: reading one section's keys, each bad key reported and dropped;
//! - `listen`: an HTTP listen address (`listen`, `dynamo_listen`, a peer's);
//! - `engine`: `[defaults]` and the per-engine rules;
//! - `discovered`: the keys of an engine whose ranks come from its own HTTP server;
//! - `instance`: the engines' ids in the Dynamo API;
//! - `ports`: which port rank r of an engine uses, and which port ranges collide;
//! - `replicas`: `peers`, `serve_snapshots` and `auth_token_file`;
//! - `restart_only`: the top-level keys only a restart changes, listed once;
//! - `select`: the `[select]` knobs of `POST /select`;
//! - `route`: the `[route]` table of the OpenAI-compatible front end;
//! - `flags`: the engines and route listener of the command line, and a configuration's source.

mod diagnostics;
mod discovered;
mod engine;
mod flags;
mod instance;
mod keys;
mod listen;
mod ports;
mod replicas;
mod restart_only;
mod route;
mod select;

use std::fmt;
use std::path::Path;

use anyhow::Context as _;
use serde::de::IgnoredAny;
use serde::Deserialize;
use toml::de::DeTable;
use toml::Spanned;

pub use crate::discover::MAX_DP_SIZE;
use crate::discover::{BaseUrl, EngineApi, FileLayout};
use crate::endpoint::Host;
use diagnostics::Problems;
use engine::{check_defaults, check_engines, EngineFields, Engines};
pub use flags::{derived_name, Flags, Source};
pub use instance::derived_instance_id;
use keys::{read_table, Checked, Int, SectionChecker};
pub use listen::{validate_listen, ListenError};
use ports::check_port_overlaps;
pub use ports::rank_port;
use replicas::check_replicas;
pub use replicas::{is_loopback_listen, Replicas};
pub use restart_only::{keep_restart_only, RestartOnlyKey, RestartPending, RESTART_ONLY};
use route::check_route;
pub use route::{route_changes, Route, DEFAULT_DRAIN_S};
use select::check_select;
pub use select::{Select, MAX_TTL_S};

/// A validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// HTTP API address, `IP:port` or `hostname:port`.
    pub listen: String,
    /// Where the Dynamo / Mooncake indexer API is served (docs.md, "Dynamo / Mooncake indexer
    /// API"); not served when absent.
    pub dynamo_listen: Option<String>,
    /// Ranks `POST /register` of the Dynamo API may add, at most (read at start).
    pub max_runtime_ranks: usize,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Blocks (engine hashes, every tier) one rank may hold in the index; its stores past it
    /// are counted, not indexed, and the rank is `degraded`.
    pub max_blocks_per_rank: u64,
    /// `[[engine]]` tables with `[defaults]` applied.
    pub engines: Vec<EngineConfig>,
    /// Other indexers to recover from, and what this one serves them.
    pub replicas: Replicas,
    /// The knobs of `POST /select` (`[select]`); reloadable.
    pub select: Select,
    /// The OpenAI-compatible front end (`[route]`), when the file has the table.
    pub route: Option<Route>,
    /// Where and how often the index is saved (`state_dir`, `state_interval_s`).
    pub state: StateSettings,
}

/// Saving every rank's state to disk, so that a restart of this indexer loses nothing
/// (docs.md "Restarts").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSettings {
    /// `state_dir`: off when absent.
    pub dir: Option<std::path::PathBuf>,
    /// Seconds between two saves (and one more at a stop).
    pub interval_s: u32,
}

impl Default for StateSettings {
    fn default() -> StateSettings {
        StateSettings {
            dir: None,
            interval_s: DEFAULT_STATE_INTERVAL_S,
        }
    }
}

/// One `[[engine]]` with defaults applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub name: String,
    /// The engine's node: where fixed ranks publish, and what replaces a wildcard host in the
    /// endpoints a discovered engine reports (the `discover` URL's host unless written).
    pub host: Host,
    /// Where the ranks come from: the file, or the engine itself.
    pub ranks: Ranks,
    pub recover_port: Option<u16>,
    pub model: Option<String>,
    /// The subscription prefix of fixed ranks (a discovered rank has its own).
    pub topic: String,
    /// The engine's id in the Dynamo API: `instance_id` as written, else
    /// `derived_instance_id(name)`.
    pub instance_id: u64,
    /// The directory of the model's Hugging Face tokenizer (`tokenizer.json`,
    /// `tokenizer_config.json`, `chat_template.jinja`), for prompts sent as text or messages.
    pub tokenizer: Option<String>,
    /// The engine's OpenAI-compatible server, where the front end (`[route]`) sends requests:
    /// `openai_url` as written, else the `discover` URL.
    pub openai_url: Option<BaseUrl>,
    /// Where the engine's load is scraped (Prometheus text: running and waiting requests, KV
    /// usage, per rank): `metrics_url` as written, else `openai_url` + `/metrics`; `None` when
    /// written `""` or when the engine has no server (docs.md "Engine load").
    pub metrics_url: Option<BaseUrl>,
    /// The file holding the key the engine's server was started with (vLLM's `--api-key`),
    /// sent as `Authorization: Bearer` with every routed request; re-read on SIGHUP.
    pub api_key_file: Option<String>,
    /// `kv_cache_report_mode = "full"`: the engine announces the blocks a request reuses again,
    /// which a rank then takes for announcements, not copies (docs.md "Restarts").
    pub reports_reused: bool,
}

impl EngineConfig {
    /// The text of `api_key_file`, when set; the error names the engine and the file, never
    /// the key.
    pub fn read_api_key(&self) -> anyhow::Result<Option<String>> {
        read_token_file(
            self.api_key_file.as_deref(),
            &format!("engine {:?}: api_key_file", self.name),
            "the key the engine's server was started with (vLLM's --api-key)",
        )
    }
}

/// Where an engine's ranks come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ranks {
    /// Written in the file: rank r on `zmq_port + r`.
    Fixed(FixedRanks),
    /// Asked of the engine's HTTP server (`discover`).
    Discovered(DiscoverConfig),
}

/// Ranks written in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedRanks {
    /// Rank 0's port, the base the engine was given; rank r publishes on `zmq_port + r`.
    pub zmq_port: u16,
    /// The first global data-parallel rank this engine runs (vLLM's
    /// `--data-parallel-start-rank`): its listeners are ranks `dp_rank_start..dp_rank_start +
    /// dp_size`. 0 unless one deployment spans several nodes.
    pub dp_rank_start: u32,
    pub dp_size: u32,
    pub replay_port: Option<u16>,
}

/// An engine whose ranks come from its HTTP server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoverConfig {
    /// The engine's HTTP server (`discover`, checked by `discover::BaseUrl::parse`) and the
    /// host that replaces a wildcard in its endpoints (the engine's `host`).
    pub api: EngineApi,
    /// Seconds between two questions while the engine answers.
    pub interval_s: u32,
    /// The rank keys the engine's own table wrote: compared with the engine's answer, never
    /// used to place a rank (the engine wins).
    pub file: FileLayout,
}

impl EngineConfig {
    /// The fixed ranks, when the file places them.
    pub fn fixed(&self) -> Option<&FixedRanks> {
        match &self.ranks {
            Ranks::Fixed(fixed) => Some(fixed),
            Ranks::Discovered(_) => None,
        }
    }

    /// The `discover` settings, when the engine is asked for its ranks.
    pub fn discover(&self) -> Option<&DiscoverConfig> {
        match &self.ranks {
            Ranks::Fixed(_) => None,
            Ranks::Discovered(discover) => Some(discover),
        }
    }

    /// The model a prompt names to use this engine's tokenizer: `model`, else the engine's name.
    pub fn tokenizer_model(&self) -> &str {
        self.model.as_deref().unwrap_or(&self.name)
    }
}

/// Every problem found in a configuration file; each names the file, the engine and the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub problems: Vec<String>,
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8090";
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// 16 Mi blocks (2^24), far above any real rank: a B200's 192 GB of HBM holds ~16 M tokens at
/// the 12 KiB a token of a 0.5B model (the bound of a snapshot's size too), ~1 M blocks at 16
/// tokens a block; with 2 TB of host RAM for CPU offload, ~11 M blocks in all. What one rank at
/// the cap costs the index: docs/performance.md "The rank cap as memory: bench_index cap"
/// measures it (docs.md quotes it).
pub const DEFAULT_MAX_BLOCKS_PER_RANK: u64 = 1 << 24;
/// Seconds between two saves of the index: what a crash (not a stop, which saves) loses is at
/// most this much history, which the engine's replay (10,000 batches, minutes of traffic) then
/// gives back.
pub const DEFAULT_STATE_INTERVAL_S: u32 = 30;
pub const MAX_STATE_INTERVAL_S: u32 = 86_400;
pub const DEFAULT_ZMQ_PORT: u16 = 5557;
pub const DEFAULT_DP_SIZE: u32 = 1;
pub const DEFAULT_DP_RANK_START: u32 = 0;
/// Seconds between two discoveries of an engine: its ranks change only when an operator scales
/// it, and each question costs the engine's API server one small JSON answer.
pub const DEFAULT_DISCOVER_INTERVAL_S: u32 = 30;
/// A day: a longer interval would leave a scaled engine unindexed for longer than any operator
/// would wait before asking why.
pub const MAX_DISCOVER_INTERVAL_S: u32 = 86_400;
/// The largest `instance_id` a file can write (TOML integers are i64), and so the largest the
/// Dynamo API's `POST /register` takes: every registered id is one a file could take over.
pub const MAX_INSTANCE_ID: u64 = i64::MAX as u64;
/// Ranks `POST /register` may add when the file does not say (`max_runtime_ranks`): each holds
/// `listener::FDS_PER_LISTENER` descriptors, so 1,024 of them hold ~7,000, far from the
/// descriptor limit the service raises itself to, and more than a few hundred Dynamo workers'
/// data-parallel ranks.
pub const DEFAULT_MAX_RUNTIME_RANKS: usize = 1_024;
/// The most `max_runtime_ranks` may be: as many ranks as 1,000 engines of 64 ranks.
pub const MAX_RUNTIME_RANKS: usize = 64_000;

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError {
            problems: vec![format!("{origin}: cannot read the file: {err}")],
        })?;
        Config::parse(&text, &origin)
    }

    /// Each engine's tokenizer directory, with the model that chooses it.
    pub fn tokenizers(&self) -> impl Iterator<Item = (&str, &Path)> {
        self.engines.iter().filter_map(|engine| {
            let dir = engine.tokenizer.as_deref()?;
            Some((engine.tokenizer_model(), Path::new(dir)))
        })
    }

    /// Validates `text`; `origin` (the file name) prefixes every problem.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let mut problems = Problems::new(origin, text);
        let root = match DeTable::parse(text) {
            Ok(root) => root,
            Err(err) => {
                problems.add(err.span(), "", err.message().trim_end());
                return Err(problems.into_error());
            }
        };
        let top = check_top(&root, &mut problems);
        let defaults = match root.get_ref().get("defaults") {
            Some(value) => check_defaults(value, &mut problems),
            None => EngineFields::default(),
        };
        let engines = match root.get_ref().get("engine") {
            Some(value) => check_engines(value, &defaults, &mut problems),
            None => Engines::default(),
        };
        check_port_overlaps(engines.placed, &mut problems);
        let select = match root.get_ref().get("select") {
            Some(value) => check_select(value, &mut problems),
            None => Some(Select::default()),
        };
        let route = match root.get_ref().get("route") {
            Some(value) => {
                let apis: Vec<&str> = top
                    .iter()
                    .flat_map(|top| std::iter::once(&top.listen).chain(&top.dynamo_listen))
                    .map(String::as_str)
                    .collect();
                check_route(value, &apis, &mut problems).map(Some)
            }
            None => Some(None),
        };
        match (top, select, route) {
            (Some(top), Some(select), Some(route)) if problems.is_empty() => Ok(Config {
                listen: top.listen,
                dynamo_listen: top.dynamo_listen,
                max_runtime_ranks: top.max_runtime_ranks,
                block_size: top.block_size,
                max_blocks_per_rank: top.max_blocks_per_rank,
                engines: engines.valid,
                replicas: top.replicas,
                select,
                route,
                state: top.state,
            }),
            _ => Err(problems.into_error()),
        }
    }
}

/// The text of a token file `path` (`key` names it in errors, `what` says what to write in it),
/// when one is set: never an empty one, and the error names the file, never its content.
fn read_token_file(path: Option<&str>, key: &str, what: &str) -> anyhow::Result<Option<String>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {key} {path}"))?;
    anyhow::ensure!(
        !text.trim().is_empty(),
        "{key} {path} is empty: write {what} in it"
    );
    Ok(Some(text))
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.problems.join("\n"))
    }
}

impl std::error::Error for ConfigError {}

/// The top-level keys; `[defaults]` and `[[engine]]` are read section by section so that a
/// problem in one section does not hide the problems of the others.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTop {
    listen: Option<Spanned<String>>,
    dynamo_listen: Option<Spanned<String>>,
    max_runtime_ranks: Option<Spanned<Int>>,
    block_size: Option<Spanned<Int>>,
    /// No longer read: refused with the line to delete (`index::SHARDS` is fixed).
    shards: Option<Spanned<IgnoredAny>>,
    max_blocks_per_rank: Option<Spanned<Int>>,
    peers: Option<Spanned<Vec<Spanned<String>>>>,
    serve_snapshots: Option<Spanned<bool>>,
    auth_token_file: Option<Spanned<String>>,
    state_dir: Option<Spanned<String>>,
    state_interval_s: Option<Spanned<Int>>,
    #[serde(rename = "defaults")]
    _defaults: Option<IgnoredAny>,
    #[serde(rename = "engine")]
    _engine: Option<IgnoredAny>,
    #[serde(rename = "select")]
    _select: Option<IgnoredAny>,
    #[serde(rename = "route")]
    _route: Option<IgnoredAny>,
}

struct Top {
    listen: String,
    dynamo_listen: Option<String>,
    max_runtime_ranks: usize,
    block_size: u32,
    max_blocks_per_rank: u64,
    replicas: Replicas,
    state: StateSettings,
}

fn check_top(root: &Spanned<DeTable<'_>>, problems: &mut Problems<'_>) -> Option<Top> {
    let (raw, dropped) = read_table::<RawTop>(root, "", problems)?;
    let mut checker = SectionChecker {
        section: "",
        dropped: &dropped,
        problems,
    };
    let listen = checker.text("listen", raw.listen, |addr| {
        validate_listen(addr)
            .err()
            .map(|why| format!("is invalid: {why}"))
    });
    let listen_in_effect = match &listen {
        Checked::Valid(listen) => listen.clone(),
        _ => DEFAULT_LISTEN.to_string(),
    };
    let dynamo_listen = checker.text("dynamo_listen", raw.dynamo_listen, |addr| {
        let listen = listen_in_effect.as_str();
        match validate_listen(addr) {
            Err(why) => Some(format!("is invalid: {why}")),
            // Two servers on one address: the second bind would fail at start-up.
            Ok(()) if addr == listen => Some(format!("must differ from `listen` ({listen})")),
            Ok(()) => None,
        }
    });
    let max_runtime_ranks = checker.int(
        "max_runtime_ranks",
        raw.max_runtime_ranks,
        &format!("0..={MAX_RUNTIME_RANKS}"),
        |n| usize::try_from(n).ok().filter(|&n| n <= MAX_RUNTIME_RANKS),
    );
    let block_size = checker.int("block_size", raw.block_size, "1..=4294967295", |n| {
        u32::try_from(n).ok().filter(|&size| size > 0)
    });
    let max_blocks_per_rank = checker.int(
        "max_blocks_per_rank",
        raw.max_blocks_per_rank,
        "1..=9223372036854775807",
        |n| u64::try_from(n).ok().filter(|&n| n > 0),
    );
    let state_dir = checker.text("state_dir", raw.state_dir, |dir| {
        dir.trim()
            .is_empty()
            .then(|| "is empty: write the directory the index is saved in".to_string())
    });
    let state_interval_s = checker.int(
        "state_interval_s",
        raw.state_interval_s,
        &format!("1..={MAX_STATE_INTERVAL_S}"),
        |n| {
            u32::try_from(n)
                .ok()
                .filter(|&n| (1..=MAX_STATE_INTERVAL_S).contains(&n))
        },
    );
    if let Some(shards) = raw.shards {
        let why = format!(
            "`shards` is no longer read (the index always has {} lock shards): delete the line",
            crate::index::SHARDS
        );
        problems.add(Some(shards.span()), "", why);
    }
    let replicas = check_replicas(
        raw.peers,
        raw.serve_snapshots,
        raw.auth_token_file,
        &dropped,
        problems,
    );
    Some(Top {
        listen: listen.or_default_to(DEFAULT_LISTEN.to_string())?,
        dynamo_listen: dynamo_listen.optional()?,
        max_runtime_ranks: max_runtime_ranks.or_default_to(DEFAULT_MAX_RUNTIME_RANKS)?,
        block_size: block_size.or_default_to(DEFAULT_BLOCK_SIZE)?,
        max_blocks_per_rank: max_blocks_per_rank.or_default_to(DEFAULT_MAX_BLOCKS_PER_RANK)?,
        replicas: replicas?,
        state: StateSettings {
            dir: state_dir.optional()?.map(std::path::PathBuf::from),
            interval_s: state_interval_s.or_default_to(DEFAULT_STATE_INTERVAL_S)?,
        },
    })
}

#[cfg(test)]
mod test_support {
    use super::Config;

    /// The problems of `text`, which must be rejected.
    pub(super) fn problems(text: &str) -> Vec<String> {
        match Config::parse(text, "indexer.toml") {
            Ok(config) => panic!("expected problems, got {config:?}"),
            Err(err) => err.problems,
        }
    }

    /// Asserts that exactly one problem contains every word, and returns it.
    pub(super) fn find<'a>(problems: &'a [String], words: &[&str]) -> &'a str {
        let found: Vec<&String> = problems
            .iter()
            .filter(|problem| words.iter().all(|word| problem.contains(word)))
            .collect();
        assert_eq!(
            found.len(),
            1,
            "one problem with {words:?} in {problems:#?}"
        );
        found[0]
    }

    pub(super) const ENGINE_A: &str = "[[engine]]\nname = \"a\"\nhost = \"h\"\n";
}

#[cfg(test)]
mod tests;
