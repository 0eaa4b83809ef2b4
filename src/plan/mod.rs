//! Expansion of the validated configuration, and of what discovered engines answered, into one
//! listener spec per data-parallel rank.
//!
//! Owns the listener specs: for a fixed engine one per global data-parallel rank r
//! (`dp_rank_start..dp_rank_start + dp_size`, for one deployment spread over several nodes), its
//! URLs on `config::rank_port` (the one place "rank r lives on port + r" is written); for a
//! discovered engine one per rank of its last good answer (endpoint, replay and topic from the
//! engine, recover port and model from the file, the model else from the engine's answer).
//! Owns how a spec and its key read in messages and in the `--check` table. It never opens a socket nor asks an engine: it only computes what
//! the registry should be running, from the file and the answers it is given.

use std::collections::BTreeMap;
use std::fmt;

use crate::config::{rank_port, Config, EngineConfig, Ranks};
use crate::discover::{DiscoveredRank, Discovery};
use crate::endpoint::Endpoint;

/// Identity of one listener: the worker (engine name, global dp_rank).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerKey {
    pub engine: String,
    pub dp_rank: u32,
}

/// Everything a listener needs to subscribe to one rank. Two specs that compare equal describe
/// the same subscription: reload keeps such a listener running untouched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerSpec {
    pub key: WorkerKey,
    /// `tcp://host:zmq_port+r`.
    pub endpoint: Endpoint,
    /// `tcp://host:replay_port+r`, when the engine has a replay socket.
    pub replay: Option<Endpoint>,
    /// `http://host:recover_port+r/kv_recover`, when the engine serves snapshots.
    pub recover: Option<String>,
    /// ZMQ subscription prefix ("" = everything).
    pub topic: String,
    /// Model served by the engine, for `/query` filtering.
    pub model: Option<String>,
    /// The engine's id in the Dynamo API (`EngineConfig::instance_id`).
    pub instance_id: u64,
    /// Added through the Dynamo API's `POST /register`, not by the file: it survives a reload
    /// and is gone after a restart.
    pub registered_at_runtime: bool,
    /// The engine announces the blocks a request reuses again (`kv_cache_report_mode`).
    pub reports_reused: bool,
    /// `false` for the one rank of an engine that publishes no KV events
    /// (`discover::NO_EVENTS`): its listener subscribes to nothing (`endpoint` is the engine's
    /// host on port 0, never connected to), it holds no block, and the route front end weighs
    /// it by load alone.
    pub publishes_events: bool,
}

impl fmt::Display for WorkerKey {
    /// `engine/rank`, the name `/workers`, `/reload` and the logs give a listener.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.engine, self.dp_rank)
    }
}

impl ListenerSpec {
    /// Whether the rank may take a request for `model`: any rank when the request names none,
    /// else one whose engine names that model or names none.
    pub fn serves(&self, model: Option<&str>) -> bool {
        match (model, self.model.as_deref()) {
            (Some(wanted), Some(served)) => wanted == served,
            _ => true,
        }
    }

    /// The rank `engine/dp_rank` subscribed at `endpoint` and nothing more: no replay, no
    /// snapshot, every topic, no model, instance id 0 (what tests and benchmarks start from:
    /// `ListenerSpec { replay: .., ..ListenerSpec::subscribing(..) }` for the rest).
    pub fn subscribing(engine: &str, dp_rank: u32, endpoint: Endpoint) -> ListenerSpec {
        ListenerSpec {
            key: WorkerKey {
                engine: engine.to_owned(),
                dp_rank,
            },
            endpoint,
            replay: None,
            recover: None,
            topic: String::new(),
            model: None,
            instance_id: 0,
            registered_at_runtime: false,
            reports_reused: false,
            publishes_events: true,
        }
    }

    /// `engine E rank R (ENDPOINT)`: how errors and logs name the listener of one rank.
    pub fn describe(&self) -> String {
        format!(
            "engine {} rank {} ({})",
            self.key.engine, self.key.dp_rank, self.endpoint
        )
    }
}

/// The last good answer of each discovered engine, by engine name: `plan`'s input beside the
/// file.
pub type Discoveries = BTreeMap<String, Discovery>;

/// The plan the file alone gives: a discovered engine has no ranks until it has answered.
pub fn expand(config: &Config) -> Vec<ListenerSpec> {
    expand_with(config, &Discoveries::new())
}

/// One spec per rank of every engine, in config order then rank order; a discovered engine's
/// ranks are those of its entry in `discovered` (none without one).
pub fn expand_with(config: &Config, discovered: &Discoveries) -> Vec<ListenerSpec> {
    config
        .engines
        .iter()
        .flat_map(|engine| expand_engine(engine, discovered.get(&engine.name)))
        .collect()
}

/// One spec per rank of `engine`. Fixed: global rank `r` (from `dp_rank_start`) is on
/// `port + r` for every socket kind. Discovered: the ranks of `discovery` (ignored for a fixed
/// engine), each on the endpoints the engine reported.
pub fn expand_engine(engine: &EngineConfig, discovery: Option<&Discovery>) -> Vec<ListenerSpec> {
    // `rank_port` is wider than a port: a validated engine never passes 65535, and the recover
    // URL of an unvalidated one fails to fetch rather than panics.
    let host = engine.host.in_url();
    let spec = |dp_rank: u32, endpoint, replay, topic: &str| ListenerSpec {
        key: WorkerKey {
            engine: engine.name.clone(),
            dp_rank,
        },
        endpoint,
        replay,
        recover: engine
            .recover_port
            .map(|port| format!("http://{host}:{}/kv_recover", rank_port(port, dp_rank))),
        topic: topic.to_string(),
        // The file's, else the one the engine said it serves: a route picks servers by it.
        model: engine
            .model
            .clone()
            .or_else(|| discovery.and_then(|discovery| discovery.model.clone())),
        instance_id: engine.instance_id,
        registered_at_runtime: false,
        reports_reused: engine.reports_reused,
        publishes_events: true,
    };
    match &engine.ranks {
        Ranks::Fixed(fixed) => {
            let first = fixed.dp_rank_start;
            // A validated engine's ranks all have ports (`config::ports`); an unvalidated one
            // ends at its last rank that has.
            let on_rank = |base: u16, rank: u32| {
                let port = u16::try_from(rank_port(base, rank)).ok()?;
                Some(Endpoint::new(engine.host.clone(), port))
            };
            (first..first.saturating_add(fixed.dp_size))
                .map_while(|rank| {
                    let endpoint = on_rank(fixed.zmq_port, rank)?;
                    let replay = match fixed.replay_port {
                        Some(base) => Some(on_rank(base, rank)?),
                        None => None,
                    };
                    Some(spec(rank, endpoint, replay, &engine.topic))
                })
                .collect()
        }
        Ranks::Discovered(_) if discovery.is_some_and(|d| !d.publishes_events) => {
            vec![ListenerSpec {
                publishes_events: false,
                ..spec(0, Endpoint::new(engine.host.clone(), 0), None, "")
            }]
        }
        Ranks::Discovered(_) => discovery
            .map_or(&[][..], |discovery| &discovery.ranks)
            .iter()
            .map(|rank: &DiscoveredRank| {
                spec(
                    rank.dp_rank,
                    rank.endpoint.clone(),
                    rank.replay.clone(),
                    &rank.topic,
                )
            })
            .collect(),
    }
}

/// A column of the `--check` table is at most this wide: a longer value (a hostname may have 253
/// characters, a model name any number) is printed whole and shifts only the rest of its own row,
/// rather than padding every row to its length (and past the 65,535 a format width can be). 80 is
/// a terminal's width and holds every URL with an IP host: the longest, `http://[` + a
/// 39-character IPv6 + `]:65535/kv_recover`, has 65.
const MAX_COLUMN_WIDTH: usize = 80;

/// The plan as a text table, one row per global rank, columns aligned; absent values are `-`.
/// With `discovered` answers a last column, SOURCE, marks each row: the engine kind that
/// reported the rank (its endpoint, replay and topic are the engine's), `file`, or `no-events`
/// for the one rank, without an endpoint, of an engine that publishes none.
pub fn render_table(specs: &[ListenerSpec], discovered: &Discoveries) -> String {
    const HEADER: [&str; 9] = [
        "ENGINE",
        "RANK",
        "ENDPOINT",
        "REPLAY",
        "RECOVER",
        "TOPIC",
        "INSTANCE_ID",
        "MODEL",
        "SOURCE",
    ];
    let columns = if discovered.is_empty() { 8 } else { 9 };
    let rows: Vec<[String; 9]> = specs
        .iter()
        .map(|spec| {
            let from_engine = |discovery: &&Discovery| {
                let reported = |rank: &DiscoveredRank| {
                    rank.dp_rank == spec.key.dp_rank && rank.endpoint == spec.endpoint
                };
                discovery.ranks.iter().any(reported)
            };
            let source = match spec.publishes_events {
                true => discovered
                    .get(&spec.key.engine)
                    .filter(from_engine)
                    .map_or("file", |discovery| discovery.kind.label()),
                false => "no-events",
            };
            [
                spec.key.engine.clone(),
                spec.key.dp_rank.to_string(),
                match spec.publishes_events {
                    true => spec.endpoint.to_string(),
                    false => "-".to_string(),
                },
                spec.replay
                    .as_ref()
                    .map_or_else(|| "-".into(), ToString::to_string),
                spec.recover.clone().unwrap_or_else(|| "-".into()),
                format!("{:?}", spec.topic),
                spec.instance_id.to_string(),
                spec.model.clone().unwrap_or_else(|| "-".into()),
                source.to_string(),
            ]
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count().min(MAX_COLUMN_WIDTH));
        }
    }
    let header = HEADER.map(String::from);
    let mut table = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .take(columns)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        table.push_str(cells.join("  ").trim_end());
        table.push('\n');
    }
    table
}

#[cfg(test)]
mod tests;
