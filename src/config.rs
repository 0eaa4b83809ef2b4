//! indexer.toml: parsing, defaults and validation (SPEC.md "indexer.toml").
//!
//! Owns the file format and every rule a file must satisfy before anything runs. It reports every
//! problem it finds, each naming the file, the line, the engine and the key, so one edit fixes a
//! broken file. It never opens a socket and never expands ranks (that is `plan`).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;

use serde::de::{IgnoredAny, Visitor};
use serde::{Deserialize, Deserializer};
use toml::de::{DeTable, DeValue, ValueDeserializer};
use toml::Spanned;

/// A validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// HTTP API address, `IP:port` or `hostname:port`.
    pub listen: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Lock shards of the index (a power of two).
    pub shards: usize,
    /// `[[engine]]` tables with `[defaults]` applied.
    pub engines: Vec<EngineConfig>,
}

/// One `[[engine]]` with defaults applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub name: String,
    pub host: String,
    pub zmq_port: u16,
    pub dp_size: u32,
    pub replay_port: Option<u16>,
    pub recover_port: Option<u16>,
    pub model: Option<String>,
    pub topic: String,
}

/// Every problem found in a configuration file; each names the file, the engine and the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub problems: Vec<String>,
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8090";
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
pub const DEFAULT_SHARDS: usize = 64;
pub const DEFAULT_ZMQ_PORT: u16 = 5557;
pub const DEFAULT_DP_SIZE: u32 = 1;
pub const MAX_DP_SIZE: u32 = 1024;
/// More shards than this buys no concurrency on any real machine and costs memory.
pub const MAX_SHARDS: usize = 1 << 16;

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError {
            problems: vec![format!("{origin}: cannot read the file: {err}")],
        })?;
        Config::parse(&text, &origin)
    }

    /// Validates `text`; `origin` (the file name) prefixes every problem.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let mut problems = Problems {
            origin,
            text,
            list: Vec::new(),
        };
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
            None => Vec::new(),
        };
        check_port_overlaps(&engines, &mut problems);
        match top {
            Some(top) if problems.list.is_empty() => Ok(Config {
                listen: top.listen,
                block_size: top.block_size,
                shards: top.shards,
                engines: engines.into_iter().map(|engine| engine.config).collect(),
            }),
            _ => Err(problems.into_error()),
        }
    }
}

/// Checks an HTTP listen address: `IP:port` (IPv6 in brackets) or `hostname:port`.
pub fn validate_listen(addr: &str) -> Result<(), String> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let expected = "expected IP:port or hostname:port (IPv6 in brackets: [::1]:8090)";
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("{addr:?}: no port; {expected}"));
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("{addr:?}: port {port:?} is not a number 0..=65535"));
    }
    let is_label = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    };
    if host.len() > 253 || !host.split('.').all(is_label) {
        return Err(format!("{addr:?}: {host:?} is neither an IP nor a hostname; {expected}"));
    }
    Ok(())
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.problems.join("\n"))
    }
}

impl std::error::Error for ConfigError {}

/// Collects problems, each prefixed with `origin:line:` and the section it belongs to.
struct Problems<'a> {
    origin: &'a str,
    text: &'a str,
    list: Vec<String>,
}

impl Problems<'_> {
    fn add(&mut self, span: Option<Range<usize>>, section: &str, what: impl fmt::Display) {
        let mut problem = match span {
            Some(span) => format!("{}:{}: ", self.origin, self.line(span.start)),
            None => format!("{}: ", self.origin),
        };
        if !section.is_empty() {
            problem.push_str(section);
            problem.push_str(": ");
        }
        problem.push_str(&what.to_string());
        self.list.push(problem);
    }

    /// 1-based line of a byte offset.
    fn line(&self, offset: usize) -> usize {
        let before = self.text.get(..offset).unwrap_or(self.text);
        before.bytes().filter(|&b| b == b'\n').count() + 1
    }

    /// A serde error inside `table`: names the key whose key or value span holds the error.
    fn add_serde(&mut self, err: toml::de::Error, table: &DeTable<'_>, section: &str) {
        let message = err.message().trim_end().replace("unknown field", "unknown key");
        let key = err.span().and_then(|span| {
            table.iter().find_map(|(key, value)| {
                let holds = |range: Range<usize>| range.contains(&span.start);
                (holds(key.span()) || holds(value.span())).then(|| key.get_ref().to_string())
            })
        });
        match key {
            Some(key) if !message.contains(&format!("`{key}`")) => {
                self.add(err.span(), section, format!("`{key}`: {message}"))
            }
            _ => self.add(err.span(), section, message),
        }
    }

    fn into_error(self) -> ConfigError {
        ConfigError { problems: self.list }
    }
}

/// A TOML integer; its own type so that a wrong type reads "expected an integer".
struct Int(i64);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Int, D::Error> {
        struct IntVisitor;
        impl Visitor<'_> for IntVisitor {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Int, E> {
                Ok(Int(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Int, E> {
                i64::try_from(v)
                    .map(Int)
                    .map_err(|_| E::custom(format!("integer {v} is too large")))
            }
        }
        deserializer.deserialize_i64(IntVisitor)
    }
}

/// The top-level keys; `[defaults]` and `[[engine]]` are read section by section so that a
/// problem in one section does not hide the problems of the others.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTop {
    listen: Option<Spanned<String>>,
    block_size: Option<Spanned<Int>>,
    shards: Option<Spanned<Int>>,
    #[serde(rename = "defaults")]
    _defaults: Option<IgnoredAny>,
    #[serde(rename = "engine")]
    _engine: Option<IgnoredAny>,
}

/// One `[[engine]]` or `[defaults]` table as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEngine {
    name: Option<Spanned<String>>,
    host: Option<Spanned<String>>,
    zmq_port: Option<Spanned<Int>>,
    dp_size: Option<Spanned<Int>>,
    replay_port: Option<Spanned<Int>>,
    recover_port: Option<Spanned<Int>>,
    model: Option<Spanned<String>>,
    topic: Option<Spanned<String>>,
}

struct Top {
    listen: String,
    block_size: u32,
    shards: usize,
}

fn check_top(root: &Spanned<DeTable<'_>>, problems: &mut Problems<'_>) -> Option<Top> {
    let table = root.get_ref();
    let whole = Spanned::new(root.span(), DeValue::Table(table.clone()));
    let raw = match RawTop::deserialize(ValueDeserializer::from(whole)) {
        Ok(raw) => raw,
        Err(err) => {
            problems.add_serde(err, table, "");
            return None;
        }
    };
    let listen = match raw.listen {
        Some(listen) => match validate_listen(listen.get_ref()) {
            Ok(()) => Some(listen.into_inner()),
            Err(why) => {
                problems.add(Some(listen.span()), "`listen`", why);
                None
            }
        },
        None => Some(DEFAULT_LISTEN.to_string()),
    };
    let block_size = match raw.block_size {
        Some(value) => match u32::try_from(value.get_ref().0) {
            Ok(size) if size > 0 => Some(size),
            _ => {
                let found = value.get_ref().0;
                let why = format!("must be 1..={}, found {found}", u32::MAX);
                problems.add(Some(value.span()), "`block_size`", why);
                None
            }
        },
        None => Some(DEFAULT_BLOCK_SIZE),
    };
    let shards = match raw.shards {
        Some(value) => match usize::try_from(value.get_ref().0) {
            Ok(n) if n.is_power_of_two() && n <= MAX_SHARDS => Some(n),
            _ => {
                let found = value.get_ref().0;
                let why = format!("must be a power of two 1..={MAX_SHARDS}, found {found}");
                problems.add(Some(value.span()), "`shards`", why);
                None
            }
        },
        None => Some(DEFAULT_SHARDS),
    };
    Some(Top {
        listen: listen?,
        block_size: block_size?,
        shards: shards?,
    })
}

/// A per-engine key after its own checks.
#[derive(Clone, Debug, Default)]
enum Checked<T> {
    #[default]
    Absent,
    /// Present but wrong; already reported.
    Rejected,
    Valid(T),
}

impl<T: Clone> Checked<T> {
    /// This engine's value, else the `[defaults]` one.
    fn or(&self, fallback: &Checked<T>) -> Checked<T> {
        match self {
            Checked::Absent => fallback.clone(),
            own => own.clone(),
        }
    }
}

/// The keys `[defaults]` may set, after their own checks.
#[derive(Clone, Debug, Default)]
struct EngineFields {
    zmq_port: Checked<u16>,
    dp_size: Checked<u32>,
    replay_port: Checked<u16>,
    recover_port: Checked<u16>,
    model: Checked<String>,
    topic: Checked<String>,
}

impl EngineFields {
    fn check(raw: RawEngine, section: &str, problems: &mut Problems<'_>) -> EngineFields {
        let mut port = |value: Option<Spanned<Int>>, key: &str| match value {
            None => Checked::Absent,
            Some(value) => match u16::try_from(value.get_ref().0) {
                Ok(port) if port > 0 => Checked::Valid(port),
                _ => {
                    let why = format!("`{key}` must be a port 1..=65535, found {}", value.get_ref().0);
                    problems.add(Some(value.span()), section, why);
                    Checked::Rejected
                }
            },
        };
        let zmq_port = port(raw.zmq_port, "zmq_port");
        let replay_port = port(raw.replay_port, "replay_port");
        let recover_port = port(raw.recover_port, "recover_port");
        let dp_size = match raw.dp_size {
            None => Checked::Absent,
            Some(value) => match u32::try_from(value.get_ref().0) {
                Ok(size) if (1..=MAX_DP_SIZE).contains(&size) => Checked::Valid(size),
                _ => {
                    let found = value.get_ref().0;
                    let why = format!("`dp_size` must be 1..={MAX_DP_SIZE}, found {found}");
                    problems.add(Some(value.span()), section, why);
                    Checked::Rejected
                }
            },
        };
        let text = |value: Option<Spanned<String>>| match value {
            None => Checked::Absent,
            Some(value) => Checked::Valid(value.into_inner()),
        };
        EngineFields {
            zmq_port,
            dp_size,
            replay_port,
            recover_port,
            model: text(raw.model),
            topic: text(raw.topic),
        }
    }
}

/// Reads one section (`[defaults]` or an `[[engine]]`) with serde; a serde problem is reported
/// and the section skipped.
fn read_section(
    value: &Spanned<DeValue<'_>>,
    section: &str,
    problems: &mut Problems<'_>,
) -> Option<RawEngine> {
    let DeValue::Table(table) = value.get_ref() else {
        let why = format!("expected a table, found {}", value.get_ref().type_str());
        problems.add(Some(value.span()), section, why);
        return None;
    };
    match RawEngine::deserialize(ValueDeserializer::from(value.clone())) {
        Ok(raw) => Some(raw),
        Err(err) => {
            problems.add_serde(err, table, section);
            None
        }
    }
}

fn check_defaults(value: &Spanned<DeValue<'_>>, problems: &mut Problems<'_>) -> EngineFields {
    let section = "[defaults]";
    let Some(raw) = read_section(value, section, problems) else {
        return EngineFields::default();
    };
    for (key, present) in [("name", &raw.name), ("host", &raw.host)] {
        if let Some(present) = present {
            let why = format!("`{key}` is not allowed here: each [[engine]] sets its own");
            problems.add(Some(present.span()), section, why);
        }
    }
    EngineFields::check(raw, section, problems)
}

/// A valid engine and where it was written, for the checks across engines.
struct CheckedEngine {
    config: EngineConfig,
    span: Range<usize>,
}

fn check_engines(
    value: &Spanned<DeValue<'_>>,
    defaults: &EngineFields,
    problems: &mut Problems<'_>,
) -> Vec<CheckedEngine> {
    let DeValue::Array(tables) = value.get_ref() else {
        let why = format!(
            "expected [[engine]] tables (an array of tables), found {}",
            value.get_ref().type_str()
        );
        problems.add(Some(value.span()), "`engine`", why);
        return Vec::new();
    };
    let mut engines = Vec::new();
    let mut first_line_of_name: HashMap<String, usize> = HashMap::new();
    for (position, table) in tables.iter().enumerate() {
        let named = table
            .get_ref()
            .as_table()
            .and_then(|t| t.get("name"))
            .and_then(|name| name.get_ref().as_str())
            .filter(|name| !name.is_empty());
        let section = match named {
            Some(name) => format!("engine {name:?}"),
            None => format!("engine #{}", position + 1),
        };
        let Some(raw) = read_section(table, &section, problems) else {
            continue;
        };
        let name = match &raw.name {
            None => {
                problems.add(Some(table.span()), &section, "missing `name`");
                None
            }
            Some(name) if name.get_ref().is_empty() => {
                problems.add(Some(name.span()), &section, "`name` is empty");
                None
            }
            Some(name) => {
                let line = problems.line(name.span().start);
                match first_line_of_name.get(name.get_ref()) {
                    Some(first) => {
                        let why = format!("duplicate `name` (first used on line {first})");
                        problems.add(Some(name.span()), &section, why);
                    }
                    None => {
                        first_line_of_name.insert(name.get_ref().clone(), line);
                    }
                }
                Some(name.get_ref().clone())
            }
        };
        let host = match &raw.host {
            None => {
                problems.add(Some(table.span()), &section, "missing `host`");
                None
            }
            Some(host) if host.get_ref().trim().is_empty() => {
                problems.add(Some(host.span()), &section, "`host` is empty");
                None
            }
            Some(host) if host.get_ref().starts_with('[') => {
                let why = "`host`: write an IPv6 literal without brackets (\"::1\")";
                problems.add(Some(host.span()), &section, why);
                None
            }
            Some(host) => Some(host.get_ref().clone()),
        };
        let own = EngineFields::check(raw, &section, problems);
        let fields = EngineFields {
            zmq_port: own.zmq_port.or(&defaults.zmq_port),
            dp_size: own.dp_size.or(&defaults.dp_size),
            replay_port: own.replay_port.or(&defaults.replay_port),
            recover_port: own.recover_port.or(&defaults.recover_port),
            model: own.model.or(&defaults.model),
            topic: own.topic.or(&defaults.topic),
        };
        let config = (|| {
            Some(EngineConfig {
                name: name?,
                host: host?,
                zmq_port: resolve(fields.zmq_port, Some(DEFAULT_ZMQ_PORT))?,
                dp_size: resolve(fields.dp_size, Some(DEFAULT_DP_SIZE))?,
                replay_port: optional(fields.replay_port)?,
                recover_port: optional(fields.recover_port)?,
                model: optional(fields.model)?,
                topic: resolve(fields.topic, Some(String::new()))?,
            })
        })();
        let Some(config) = config else { continue };
        let span = table.span();
        let mut ranges_fit = true;
        for range in port_ranges(&config) {
            if range.last > u32::from(u16::MAX) {
                let why = format!(
                    "{} run past 65535 (`{}` {} + dp_size {} - 1)",
                    range.describe(),
                    range.key,
                    range.first,
                    config.dp_size
                );
                problems.add(Some(span.clone()), &section, why);
                ranges_fit = false;
            }
        }
        if ranges_fit {
            engines.push(CheckedEngine { config, span });
        }
    }
    engines
}

/// A required key: the value, the default when absent, nothing when rejected.
fn resolve<T>(value: Checked<T>, default: Option<T>) -> Option<T> {
    match value {
        Checked::Valid(value) => Some(value),
        Checked::Absent => default,
        Checked::Rejected => None,
    }
}

/// An optional key: `Some(None)` when absent, `None` when rejected.
fn optional<T>(value: Checked<T>) -> Option<Option<T>> {
    match value {
        Checked::Valid(value) => Some(Some(value)),
        Checked::Absent => Some(None),
        Checked::Rejected => None,
    }
}

/// The ports one socket kind of an engine occupies: `first + rank` for every rank.
struct PortRange {
    kind: &'static str,
    key: &'static str,
    first: u32,
    last: u32,
}

impl PortRange {
    fn describe(&self) -> String {
        format!("{} ports {}..{}", self.kind, self.first, self.last)
    }
}

fn port_ranges(engine: &EngineConfig) -> Vec<PortRange> {
    let kinds = [
        ("zmq", "zmq_port", Some(engine.zmq_port)),
        ("replay", "replay_port", engine.replay_port),
        ("recover", "recover_port", engine.recover_port),
    ];
    kinds
        .into_iter()
        .filter_map(|(kind, key, port)| {
            let first = u32::from(port?);
            Some(PortRange {
                kind,
                key,
                first,
                last: first + engine.dp_size - 1,
            })
        })
        .collect()
}

/// Every pair of port ranges on one host (as written, case-insensitive) that share a port,
/// reported on the engine written later.
fn check_port_overlaps(engines: &[CheckedEngine], problems: &mut Problems<'_>) {
    struct Placed {
        host: String,
        engine: usize,
        range: PortRange,
    }
    let mut placed: Vec<Placed> = engines
        .iter()
        .enumerate()
        .flat_map(|(engine, checked)| {
            let host = checked.config.host.to_lowercase();
            port_ranges(&checked.config)
                .into_iter()
                .map(move |range| Placed {
                    host: host.clone(),
                    engine,
                    range,
                })
        })
        .collect();
    // Sorted by host then first port, every range overlapping `a` follows it until one starts
    // after `a` ends.
    placed.sort_by(|a, b| (&a.host, a.range.first).cmp(&(&b.host, b.range.first)));
    let mut overlaps: Vec<(&Placed, &Placed)> = Vec::new();
    for (i, a) in placed.iter().enumerate() {
        for b in &placed[i + 1..] {
            if b.host != a.host || b.range.first > a.range.last {
                break;
            }
            let in_file_order = (a.engine, a.range.key) <= (b.engine, b.range.key);
            overlaps.push(if in_file_order { (a, b) } else { (b, a) });
        }
    }
    overlaps.sort_by_key(|(earlier, later)| (later.engine, later.range.first, earlier.engine));
    for (earlier, later) in overlaps {
        let later_engine = &engines[later.engine];
        let why = format!(
            "{} overlap {} ports of engine {:?} ({}..{}) on host {}",
            later.range.describe(),
            earlier.range.kind,
            engines[earlier.engine].config.name,
            earlier.range.first,
            earlier.range.last,
            later_engine.config.host
        );
        let section = format!("engine {:?}", later_engine.config.name);
        problems.add(Some(later_engine.span.clone()), &section, why);
    }
}
