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

use serde::de::DeserializeOwned;
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
    /// Rank 0's port, the base the engine was given; rank r publishes on `zmq_port + r`.
    pub zmq_port: u16,
    /// The first global data-parallel rank this engine runs (vLLM's
    /// `--data-parallel-start-rank`): its listeners are ranks `dp_rank_start..dp_rank_start +
    /// dp_size`. 0 unless one deployment spans several nodes.
    pub dp_rank_start: u32,
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
pub const DEFAULT_DP_RANK_START: u32 = 0;
/// Global data-parallel ranks are below this: it bounds `dp_size` and `dp_rank_start + dp_size`.
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
            None => Engines {
                valid: Vec::new(),
                placed: Vec::new(),
            },
        };
        check_port_overlaps(engines.placed, &mut problems);
        match top {
            Some(top) if problems.list.is_empty() => Ok(Config {
                listen: top.listen,
                block_size: top.block_size,
                shards: top.shards,
                engines: engines.valid,
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
        return Err(format!(
            "{addr:?}: {host:?} is neither an IP nor a hostname; {expected}"
        ));
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

    /// A serde error inside `table`, naming the key whose key or value span holds the error;
    /// returns that key.
    fn add_serde(
        &mut self,
        err: toml::de::Error,
        table: &DeTable<'_>,
        section: &str,
    ) -> Option<String> {
        let message = err
            .message()
            .trim_end()
            .replace("unknown field", "unknown key");
        let key = err.span().and_then(|span| {
            table.iter().find_map(|(key, value)| {
                let holds = |range: Range<usize>| range.contains(&span.start);
                (holds(key.span()) || holds(value.span())).then(|| key.get_ref().to_string())
            })
        });
        match &key {
            Some(key) if !message.contains(&format!("`{key}`")) => {
                self.add(err.span(), section, format!("`{key}`: {message}"))
            }
            _ => self.add(err.span(), section, message),
        }
        key
    }

    fn into_error(self) -> ConfigError {
        ConfigError {
            problems: self.list,
        }
    }
}

/// Reads `table` into `T` with serde. A key serde rejects (unknown, or of the wrong type) is
/// reported and dropped, and the rest is read again, so that every bad key is reported; the
/// dropped keys are returned with the value.
fn read_table<T: DeserializeOwned>(
    table: &Spanned<DeTable<'_>>,
    section: &str,
    problems: &mut Problems<'_>,
) -> Option<(T, Vec<String>)> {
    let mut remaining = table.get_ref().clone();
    let mut dropped = Vec::new();
    loop {
        let value = Spanned::new(table.span(), DeValue::Table(remaining.clone()));
        match T::deserialize(ValueDeserializer::from(value)) {
            Ok(read) => return Some((read, dropped)),
            Err(err) => {
                let key = problems.add_serde(err, &remaining, section)?;
                remaining.remove(key.as_str());
                dropped.push(key);
            }
        }
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
    dp_rank_start: Option<Spanned<Int>>,
    dp_size: Option<Spanned<Int>>,
    replay_port: Option<Spanned<Int>>,
    recover_port: Option<Spanned<Int>>,
    model: Option<Spanned<String>>,
    topic: Option<Spanned<String>>,
}

/// A key after its own checks.
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

    /// The value, or `default` when absent; nothing when rejected.
    fn or_default_to(self, default: T) -> Option<T> {
        match self {
            Checked::Valid(value) => Some(value),
            Checked::Absent => Some(default),
            Checked::Rejected => None,
        }
    }

    /// For an optional key: `Some(None)` when absent; nothing when rejected.
    fn optional(self) -> Option<Option<T>> {
        match self {
            Checked::Valid(value) => Some(Some(value)),
            Checked::Absent => Some(None),
            Checked::Rejected => None,
        }
    }
}

/// Checks the keys of one section that serde read; `dropped` keys were already reported.
struct SectionChecker<'p, 'a> {
    section: &'p str,
    dropped: &'p [String],
    problems: &'p mut Problems<'a>,
}

impl SectionChecker<'_, '_> {
    /// An integer key: valid when `convert` accepts it, else reported with `expected`.
    fn int<T>(
        &mut self,
        key: &str,
        value: Option<Spanned<Int>>,
        expected: &str,
        convert: impl Fn(i64) -> Option<T>,
    ) -> Checked<T> {
        if self.dropped.iter().any(|dropped| dropped == key) {
            return Checked::Rejected;
        }
        let Some(value) = value else {
            return Checked::Absent;
        };
        match convert(value.get_ref().0) {
            Some(converted) => Checked::Valid(converted),
            None => {
                let why = format!("`{key}` must be {expected}, found {}", value.get_ref().0);
                self.problems.add(Some(value.span()), self.section, why);
                Checked::Rejected
            }
        }
    }

    fn port(&mut self, key: &str, value: Option<Spanned<Int>>) -> Checked<u16> {
        let convert = |n| u16::try_from(n).ok().filter(|&port| port > 0);
        self.int(key, value, "a port 1..=65535", convert)
    }

    /// A string key; `check` returns why a value is wrong.
    fn text(
        &mut self,
        key: &str,
        value: Option<Spanned<String>>,
        check: impl Fn(&str) -> Option<String>,
    ) -> Checked<String> {
        if self.dropped.iter().any(|dropped| dropped == key) {
            return Checked::Rejected;
        }
        let Some(value) = value else {
            return Checked::Absent;
        };
        match check(value.get_ref()) {
            None => Checked::Valid(value.into_inner()),
            Some(why) => {
                let why = format!("`{key}` {why}");
                self.problems.add(Some(value.span()), self.section, why);
                Checked::Rejected
            }
        }
    }
}

struct Top {
    listen: String,
    block_size: u32,
    shards: usize,
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
    let block_size = checker.int("block_size", raw.block_size, "1..=4294967295", |n| {
        u32::try_from(n).ok().filter(|&size| size > 0)
    });
    let shards = checker.int(
        "shards",
        raw.shards,
        &format!("a power of two 1..={MAX_SHARDS}"),
        |n| {
            usize::try_from(n)
                .ok()
                .filter(|&n| n.is_power_of_two() && n <= MAX_SHARDS)
        },
    );
    Some(Top {
        listen: listen.or_default_to(DEFAULT_LISTEN.to_string())?,
        block_size: block_size.or_default_to(DEFAULT_BLOCK_SIZE)?,
        shards: shards.or_default_to(DEFAULT_SHARDS)?,
    })
}

/// The per-engine keys, after their own checks; `[defaults]` leaves `name` and `host` absent.
#[derive(Clone, Debug, Default)]
struct EngineFields {
    name: Checked<String>,
    host: Checked<String>,
    zmq_port: Checked<u16>,
    dp_rank_start: Checked<u32>,
    dp_size: Checked<u32>,
    replay_port: Checked<u16>,
    recover_port: Checked<u16>,
    model: Checked<String>,
    topic: Checked<String>,
}

impl EngineFields {
    fn check(
        raw: RawEngine,
        dropped: &[String],
        section: &str,
        problems: &mut Problems<'_>,
    ) -> Self {
        let mut checker = SectionChecker {
            section,
            dropped,
            problems,
        };
        let name = checker.text("name", raw.name, |name| {
            name.is_empty().then(|| "is empty".to_string())
        });
        let host = checker.text("host", raw.host, |host| {
            if host.trim().is_empty() {
                Some("is empty".to_string())
            } else if host.starts_with('[') {
                Some("must be written without brackets, also for IPv6 (\"::1\")".to_string())
            } else {
                None
            }
        });
        let dp_size = checker.int("dp_size", raw.dp_size, "1..=1024", |n| {
            u32::try_from(n)
                .ok()
                .filter(|size| (1..=MAX_DP_SIZE).contains(size))
        });
        let last_rank = MAX_DP_SIZE - 1;
        let dp_rank_start = checker.int(
            "dp_rank_start",
            raw.dp_rank_start,
            &format!("0..={last_rank}"),
            |n| u32::try_from(n).ok().filter(|&start| start <= last_rank),
        );
        EngineFields {
            name,
            host,
            zmq_port: checker.port("zmq_port", raw.zmq_port),
            dp_rank_start,
            dp_size,
            replay_port: checker.port("replay_port", raw.replay_port),
            recover_port: checker.port("recover_port", raw.recover_port),
            model: checker.text("model", raw.model, |_| None),
            topic: checker.text("topic", raw.topic, |_| None),
        }
    }

    /// These fields where set, else the `[defaults]` ones.
    fn or(&self, defaults: &EngineFields) -> EngineFields {
        EngineFields {
            name: self.name.clone(),
            host: self.host.clone(),
            zmq_port: self.zmq_port.or(&defaults.zmq_port),
            dp_rank_start: self.dp_rank_start.or(&defaults.dp_rank_start),
            dp_size: self.dp_size.or(&defaults.dp_size),
            replay_port: self.replay_port.or(&defaults.replay_port),
            recover_port: self.recover_port.or(&defaults.recover_port),
            model: self.model.or(&defaults.model),
            topic: self.topic.or(&defaults.topic),
        }
    }
}

/// A section that must be a table: reported when it is not.
fn as_table<'i>(
    value: &Spanned<DeValue<'i>>,
    section: &str,
    problems: &mut Problems<'_>,
) -> Option<Spanned<DeTable<'i>>> {
    match value.get_ref() {
        DeValue::Table(table) => Some(Spanned::new(value.span(), table.clone())),
        other => {
            let why = format!("expected a table, found {}", other.type_str());
            problems.add(Some(value.span()), section, why);
            None
        }
    }
}

fn check_defaults(value: &Spanned<DeValue<'_>>, problems: &mut Problems<'_>) -> EngineFields {
    let section = "[defaults]";
    let Some((raw, dropped)) = as_table(value, section, problems)
        .and_then(|table| read_table::<RawEngine>(&table, section, problems))
    else {
        return EngineFields::default();
    };
    for (key, present) in [("name", &raw.name), ("host", &raw.host)] {
        if let Some(present) = present {
            let why = format!("`{key}` is not allowed here: each [[engine]] sets its own");
            problems.add(Some(present.span()), section, why);
        }
    }
    let mut fields = EngineFields::check(raw, &dropped, section, problems);
    fields.name = Checked::Absent;
    fields.host = Checked::Absent;
    fields
}

/// The checked engines, and the port ranges of every engine whose host and ranges are valid
/// (even when another key of it is not), for the overlap check.
struct Engines {
    valid: Vec<EngineConfig>,
    placed: Vec<Placed>,
}

fn check_engines(
    value: &Spanned<DeValue<'_>>,
    defaults: &EngineFields,
    problems: &mut Problems<'_>,
) -> Engines {
    let mut engines = Engines {
        valid: Vec::new(),
        placed: Vec::new(),
    };
    let DeValue::Array(tables) = value.get_ref() else {
        let why = format!(
            "expected [[engine]] tables (an array of tables), found {}",
            value.get_ref().type_str()
        );
        problems.add(Some(value.span()), "`engine`", why);
        return engines;
    };
    let mut first_line_of_name: HashMap<String, usize> = HashMap::new();
    for (position, value) in tables.iter().enumerate() {
        let written_name = value
            .get_ref()
            .as_table()
            .and_then(|table| table.get("name"))
            .and_then(|name| name.get_ref().as_str())
            .filter(|name| !name.is_empty());
        let section = match written_name {
            Some(name) => format!("engine {name:?}"),
            None => format!("engine #{}", position + 1),
        };
        let Some((raw, dropped)) = as_table(value, &section, problems)
            .and_then(|table| read_table::<RawEngine>(&table, &section, problems))
        else {
            continue;
        };
        let span = value.span();
        for (key, present) in [("name", raw.name.is_some()), ("host", raw.host.is_some())] {
            if !present && !dropped.iter().any(|dropped| dropped == key) {
                problems.add(Some(span.clone()), &section, format!("missing `{key}`"));
            }
        }
        if let Some(name) = &raw.name {
            let line = problems.line(name.span().start);
            match first_line_of_name.get(name.get_ref()) {
                Some(first) if !name.get_ref().is_empty() => {
                    let why = format!("duplicate `name` (first used on line {first})");
                    problems.add(Some(name.span()), &section, why);
                }
                _ => {
                    first_line_of_name.insert(name.get_ref().clone(), line);
                }
            }
        }
        let fields = EngineFields::check(raw, &dropped, &section, problems).or(defaults);
        let (Checked::Valid(host), Some(dp_size), Some(dp_rank_start)) = (
            fields.host.clone(),
            fields.dp_size.clone().or_default_to(DEFAULT_DP_SIZE),
            fields
                .dp_rank_start
                .clone()
                .or_default_to(DEFAULT_DP_RANK_START),
        ) else {
            continue;
        };
        let ranks = RankRange {
            start: dp_rank_start,
            size: dp_size,
        };
        if ranks.end() > MAX_DP_SIZE {
            let why = format!(
                "global ranks {}..{} run past {} (`dp_rank_start` {dp_rank_start} + `dp_size` {dp_size} must be at most {MAX_DP_SIZE})",
                ranks.start,
                ranks.end() - 1,
                MAX_DP_SIZE - 1
            );
            problems.add(Some(span.clone()), &section, why);
            continue;
        }
        let ports = [
            (
                SocketKind::Zmq,
                "zmq_port",
                fields.zmq_port.clone().or_default_to(DEFAULT_ZMQ_PORT),
            ),
            (
                SocketKind::Replay,
                "replay_port",
                fields.replay_port.clone().optional().flatten(),
            ),
            (
                SocketKind::Recover,
                "recover_port",
                fields.recover_port.clone().optional().flatten(),
            ),
        ];
        let mut ranges_fit = true;
        for (kind, key, port) in ports {
            let Some(port) = port else { continue };
            let range = PortRange::of_ranks(kind, port, ranks);
            if range.last > u32::from(u16::MAX) {
                let why = format!(
                    "{} run past 65535 (`{key}` {port} + {})",
                    range.describe(),
                    ranks.describe_last()
                );
                problems.add(Some(span.clone()), &section, why);
                ranges_fit = false;
                continue;
            }
            engines.placed.push(Placed {
                host: host.to_lowercase(),
                written_host: host.clone(),
                engine: position,
                label: section.clone(),
                span: span.clone(),
                range,
            });
        }
        if !ranges_fit {
            continue;
        }
        let config = (|| {
            Some(EngineConfig {
                name: fields.name.optional()??,
                host,
                zmq_port: fields.zmq_port.or_default_to(DEFAULT_ZMQ_PORT)?,
                dp_rank_start,
                dp_size,
                replay_port: fields.replay_port.optional()?,
                recover_port: fields.recover_port.optional()?,
                model: fields.model.optional()?,
                topic: fields.topic.or_default_to(String::new())?,
            })
        })();
        engines.valid.extend(config);
    }
    engines
}

/// The sockets of one rank, in the order the file lists their ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum SocketKind {
    Zmq,
    Replay,
    Recover,
}

impl SocketKind {
    fn name(self) -> &'static str {
        match self {
            SocketKind::Zmq => "zmq",
            SocketKind::Replay => "replay",
            SocketKind::Recover => "recover",
        }
    }
}

/// The global data-parallel ranks of one engine: `start..start + size`, `size` at least 1.
#[derive(Clone, Copy)]
struct RankRange {
    start: u32,
    size: u32,
}

impl RankRange {
    /// One past the last rank.
    fn end(self) -> u32 {
        self.start + self.size
    }

    /// How the last rank's offset is computed, for messages; the start only when it is set.
    fn describe_last(self) -> String {
        match self.start {
            0 => format!("dp_size {} - 1", self.size),
            start => format!("dp_rank_start {start} + dp_size {} - 1", self.size),
        }
    }
}

/// The ports one socket kind of an engine occupies: `port + rank` for every global rank.
struct PortRange {
    kind: SocketKind,
    first: u32,
    last: u32,
}

impl PortRange {
    fn of_ranks(kind: SocketKind, port: u16, ranks: RankRange) -> PortRange {
        let first = u32::from(port) + ranks.start;
        PortRange {
            kind,
            first,
            last: first + ranks.size - 1,
        }
    }

    fn describe(&self) -> String {
        format!("{} ports {}..{}", self.kind.name(), self.first, self.last)
    }
}

/// One engine's port range on its host.
struct Placed {
    /// Lowercased: hosts are compared as written, case-insensitively.
    host: String,
    written_host: String,
    /// Position in the file.
    engine: usize,
    label: String,
    span: Range<usize>,
    range: PortRange,
}

/// Every pair of port ranges on one host that share a port, reported on the one written later.
fn check_port_overlaps(mut placed: Vec<Placed>, problems: &mut Problems<'_>) {
    // Sorted by host then first port, every range overlapping `a` follows it until one starts
    // after `a` ends.
    placed.sort_by(|a, b| (&a.host, a.range.first).cmp(&(&b.host, b.range.first)));
    let mut overlaps: Vec<(&Placed, &Placed)> = Vec::new();
    for (i, a) in placed.iter().enumerate() {
        for b in &placed[i + 1..] {
            if b.host != a.host || b.range.first > a.range.last {
                break;
            }
            let in_file_order = (a.engine, a.range.kind) <= (b.engine, b.range.kind);
            overlaps.push(if in_file_order { (a, b) } else { (b, a) });
        }
    }
    overlaps.sort_by_key(|(earlier, later)| (later.engine, later.range.first, earlier.engine));
    for (earlier, later) in overlaps {
        let why = format!(
            "{} overlap {} ports of {} ({}..{}) on host {}",
            later.range.describe(),
            earlier.range.kind.name(),
            earlier.label,
            earlier.range.first,
            earlier.range.last,
            later.written_host
        );
        problems.add(Some(later.span.clone()), &later.label, why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(text: &str) -> Vec<String> {
        match Config::parse(text, "indexer.toml") {
            Ok(config) => panic!("expected problems, got {config:?}"),
            Err(err) => err.problems,
        }
    }

    /// Asserts that exactly one problem contains every word, and returns it.
    fn find<'a>(problems: &'a [String], words: &[&str]) -> &'a str {
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

    const ENGINE_A: &str = "[[engine]]\nname = \"a\"\nhost = \"h\"\n";

    #[test]
    fn absent_keys_take_the_spec_defaults() {
        let config = Config::parse("[[engine]]\nname = \"local\"\nhost = \"127.0.0.1\"\n", "f")
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(
            config,
            Config {
                listen: "127.0.0.1:8090".into(),
                block_size: 16,
                shards: 64,
                engines: vec![EngineConfig {
                    name: "local".into(),
                    host: "127.0.0.1".into(),
                    zmq_port: 5557,
                    dp_rank_start: 0,
                    dp_size: 1,
                    replay_port: None,
                    recover_port: None,
                    model: None,
                    topic: String::new(),
                }],
            }
        );
    }

    #[test]
    fn an_empty_file_is_a_valid_config_without_engines() {
        let config = Config::parse("", "f").unwrap_or_else(|err| panic!("{err}"));
        assert!(config.engines.is_empty());
    }

    #[test]
    fn defaults_section_fills_what_an_engine_leaves_out_and_engines_override_it() {
        let text = r#"
listen = "0.0.0.0:9000"
block_size = 32
shards = 8
[defaults]
zmq_port = 6000
dp_size = 2
replay_port = 6100
recover_port = 6200
model = "m"
topic = "kv"
[[engine]]
name = "inherits"
host = "h1"
[[engine]]
name = "overrides"
host = "h2"
zmq_port = 7000
dp_size = 4
replay_port = 7100
recover_port = 7200
model = "other"
topic = ""
"#;
        let config = Config::parse(text, "f").unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(
            (config.listen.as_str(), config.block_size, config.shards),
            ("0.0.0.0:9000", 32, 8)
        );
        let inherits = &config.engines[0];
        assert_eq!(
            (
                inherits.zmq_port,
                inherits.dp_size,
                inherits.replay_port,
                inherits.recover_port
            ),
            (6000, 2, Some(6100), Some(6200))
        );
        assert_eq!(
            (inherits.model.as_deref(), inherits.topic.as_str()),
            (Some("m"), "kv")
        );
        let overrides = &config.engines[1];
        assert_eq!(
            (
                overrides.zmq_port,
                overrides.dp_size,
                overrides.replay_port,
                overrides.recover_port
            ),
            (7000, 4, Some(7100), Some(7200))
        );
        assert_eq!(
            (overrides.model.as_deref(), overrides.topic.as_str()),
            (Some("other"), "")
        );
    }

    #[test]
    fn unknown_keys_are_reported_with_line_section_and_key() {
        let text = format!("bogus = 1\n[defaults]\nport = 1\n{ENGINE_A}typo = 3\ntypo2 = 4\n");
        let found = problems(&text);
        find(&found, &["indexer.toml:1:", "unknown key", "`bogus`"]);
        find(
            &found,
            &["indexer.toml:3:", "[defaults]", "unknown key", "`port`"],
        );
        find(
            &found,
            &["indexer.toml:7:", "engine \"a\"", "unknown key", "`typo`"],
        );
        find(
            &found,
            &["indexer.toml:8:", "engine \"a\"", "unknown key", "`typo2`"],
        );
        assert_eq!(found.len(), 4, "{found:#?}");
    }

    #[test]
    fn wrong_types_name_the_key_not_a_serde_dump() {
        let text = format!(
            "listen = 8090\nblock_size = \"16\"\n{ENGINE_A}zmq_port = \"abc\"\ndp_size = 1.5\n"
        );
        let found = problems(&text);
        find(
            &found,
            &["indexer.toml:1:", "`listen`", "expected a string"],
        );
        find(
            &found,
            &["indexer.toml:2:", "`block_size`", "expected an integer"],
        );
        find(
            &found,
            &[
                "indexer.toml:6:",
                "engine \"a\"",
                "`zmq_port`",
                "expected an integer",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:7:",
                "engine \"a\"",
                "`dp_size`",
                "expected an integer",
            ],
        );
        assert_eq!(found.len(), 4, "{found:#?}");
    }

    #[test]
    fn ports_outside_1_to_65535_are_rejected() {
        let text = format!("{ENGINE_A}zmq_port = 70000\nreplay_port = 0\nrecover_port = -1\n");
        let found = problems(&text);
        find(
            &found,
            &["indexer.toml:4:", "engine \"a\"", "`zmq_port`", "70000"],
        );
        find(
            &found,
            &[
                "indexer.toml:5:",
                "engine \"a\"",
                "`replay_port`",
                "found 0",
            ],
        );
        find(
            &found,
            &["indexer.toml:6:", "engine \"a\"", "`recover_port`", "-1"],
        );
        assert_eq!(found.len(), 3, "{found:#?}");
    }

    #[test]
    fn missing_empty_and_duplicate_names_and_hosts() {
        let text = r#"
[[engine]]
host = "h"
[[engine]]
name = ""
host = "h2"
[[engine]]
name = "twice"
[[engine]]
name = "twice"
host = " "
zmq_port = 6000
[[engine]]
name = "bracketed"
host = "[::1]"
"#;
        let found = problems(text);
        find(&found, &["indexer.toml:2:", "engine #1", "missing `name`"]);
        find(&found, &["indexer.toml:5:", "engine #2", "`name` is empty"]);
        find(
            &found,
            &["indexer.toml:7:", "engine \"twice\"", "missing `host`"],
        );
        find(
            &found,
            &[
                "indexer.toml:10:",
                "engine \"twice\"",
                "duplicate `name`",
                "line 8",
            ],
        );
        find(
            &found,
            &["indexer.toml:11:", "engine \"twice\"", "`host` is empty"],
        );
        find(
            &found,
            &[
                "indexer.toml:15:",
                "engine \"bracketed\"",
                "`host`",
                "without brackets",
            ],
        );
        assert_eq!(found.len(), 6, "{found:#?}");
    }

    #[test]
    fn dp_size_block_size_and_shards_out_of_range() {
        let text = format!(
            "block_size = 0\nshards = 48\n[defaults]\ndp_size = 0\n{ENGINE_A}dp_size = 1025\n"
        );
        let found = problems(&text);
        find(&found, &["indexer.toml:1:", "`block_size`", "found 0"]);
        find(
            &found,
            &["indexer.toml:2:", "`shards`", "power of two", "found 48"],
        );
        find(
            &found,
            &["indexer.toml:4:", "[defaults]", "`dp_size`", "found 0"],
        );
        find(
            &found,
            &["indexer.toml:8:", "engine \"a\"", "`dp_size`", "found 1025"],
        );
        assert_eq!(found.len(), 4, "{found:#?}");
        for shards in [0, 3, 1 << 17] {
            let found = problems(&format!("shards = {shards}\n"));
            find(&found, &["`shards`", "power of two"]);
        }
    }

    #[test]
    fn a_rejected_default_is_reported_once_not_per_engine() {
        let text = "[defaults]\ndp_size = 0\n[[engine]]\nname = \"a\"\nhost = \"h\"\n[[engine]]\nname = \"b\"\nhost = \"h\"\n";
        assert_eq!(problems(text).len(), 1);
    }

    #[test]
    fn port_ranges_past_65535_are_rejected_for_every_socket_kind() {
        let text = r#"
[[engine]]
name = "a"
host = "h"
zmq_port = 65534
dp_size = 3
[[engine]]
name = "b"
host = "h2"
replay_port = 65535
dp_size = 2
[[engine]]
name = "c"
host = "h3"
recover_port = 65000
dp_size = 1024
"#;
        let found = problems(text);
        let zmq = [
            "indexer.toml:2:",
            "engine \"a\"",
            "zmq ports 65534..65536 run past 65535",
        ];
        find(&found, &zmq);
        find(
            &found,
            &[
                "indexer.toml:7:",
                "engine \"b\"",
                "replay ports 65535..65536",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:12:",
                "engine \"c\"",
                "recover ports 65000..66023",
            ],
        );
        assert_eq!(found.len(), 3, "{found:#?}");
    }

    #[test]
    fn overlapping_port_ranges_on_one_host_are_reported_on_the_later_engine() {
        let text = r#"
[[engine]]
name = "vllm-a"
host = "10.0.0.5"
zmq_port = 5600
dp_size = 2
replay_port = 5558
[[engine]]
name = "vllm-b"
host = "10.0.0.5"
zmq_port = 5557
dp_size = 2
[[engine]]
name = "elsewhere"
host = "10.0.0.6"
zmq_port = 5557
dp_size = 2
[[engine]]
name = "same-engine"
host = "gpu-1"
zmq_port = 7000
dp_size = 4
recover_port = 7003
[[engine]]
name = "case"
host = "GPU-1"
replay_port = 7001
"#;
        let found = problems(text);
        assert!(found.contains(&"indexer.toml:8: engine \"vllm-b\": zmq ports 5557..5558 overlap replay ports of engine \"vllm-a\" (5558..5559) on host 10.0.0.5".to_string()), "{found:#?}");
        find(
            &found,
            &[
                "indexer.toml:18:",
                "engine \"same-engine\"",
                "recover ports 7003..7006 overlap zmq ports of engine \"same-engine\" (7000..7003)",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:24:",
                "engine \"case\"",
                "replay ports 7001..7001 overlap zmq ports of engine \"same-engine\"",
                "on host GPU-1",
            ],
        );
        assert_eq!(found.len(), 3, "{found:#?}");
    }

    #[test]
    fn dp_rank_start_comes_from_the_engine_else_defaults_else_0() {
        let text = r#"
[defaults]
dp_rank_start = 4
[[engine]]
name = "inherits"
host = "h1"
[[engine]]
name = "node-b"
host = "h2"
dp_rank_start = 2
dp_size = 2
"#;
        let config = Config::parse(text, "f").unwrap_or_else(|err| panic!("{err}"));
        let starts: Vec<(u32, u32)> = config
            .engines
            .iter()
            .map(|engine| (engine.dp_rank_start, engine.dp_size))
            .collect();
        assert_eq!(starts, vec![(4, 1), (2, 2)]);
        let plain = Config::parse(ENGINE_A, "f").unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(plain.engines[0].dp_rank_start, 0);
    }

    #[test]
    fn dp_rank_start_and_the_last_global_rank_stay_below_1024() {
        let text = r#"
[defaults]
dp_rank_start = -1
[[engine]]
name = "a"
host = "h"
dp_rank_start = 1024
[[engine]]
name = "b"
host = "h2"
dp_rank_start = 1000
dp_size = 25
[[engine]]
name = "c"
host = "h3"
dp_rank_start = 1000
dp_size = 24
[[engine]]
name = "d"
host = "h4"
dp_rank_start = "2"
"#;
        let found = problems(text);
        find(
            &found,
            &[
                "indexer.toml:3:",
                "[defaults]",
                "`dp_rank_start`",
                "0..=1023, found -1",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:7:",
                "engine \"a\"",
                "`dp_rank_start`",
                "found 1024",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:8:",
                "engine \"b\"",
                "global ranks 1000..1024 run past 1023",
                "`dp_rank_start` 1000 + `dp_size` 25",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:21:",
                "engine \"d\"",
                "`dp_rank_start`",
                "expected an integer",
            ],
        );
        assert_eq!(found.len(), 4, "{found:#?}");
    }

    #[test]
    fn port_ranges_with_dp_rank_start_are_checked_where_the_ranks_really_are() {
        // Node B of a 2-node deployment: ranks 2 and 3 on 5559 and 5560, 5557 and 5558 free.
        let text = r#"
[[engine]]
name = "node-b"
host = "h"
zmq_port = 5557
dp_rank_start = 2
dp_size = 2
[[engine]]
name = "below"
host = "h"
zmq_port = 5557
dp_size = 2
[[engine]]
name = "into-node-b"
host = "h"
zmq_port = 6000
replay_port = 5560
[[engine]]
name = "past-65535"
host = "h2"
zmq_port = 65534
dp_rank_start = 1
dp_size = 2
"#;
        let found = problems(text);
        find(
            &found,
            &[
                "indexer.toml:13:",
                "engine \"into-node-b\"",
                "replay ports 5560..5560 overlap zmq ports of engine \"node-b\" (5559..5560)",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:18:",
                "engine \"past-65535\"",
                "zmq ports 65535..65536 run past 65535 (`zmq_port` 65534 + dp_rank_start 1 + dp_size 2 - 1)",
            ],
        );
        assert_eq!(found.len(), 2, "{found:#?}");
    }

    #[test]
    fn listen_must_parse_as_ip_port_or_hostname_port() {
        for good in [
            "127.0.0.1:8090",
            "[::1]:8090",
            "localhost:0",
            "indexer.example.com:80",
        ] {
            assert_eq!(validate_listen(good), Ok(()), "{good}");
        }
        for bad in [
            "nonsense",
            "::1:8090",
            "host:99999",
            ":8090",
            "bad host:80",
            "-x:80",
        ] {
            assert!(validate_listen(bad).is_err(), "{bad}");
        }
        let found = problems("listen = \"::1:8090\"\n");
        find(&found, &["indexer.toml:1:", "`listen`", "IP:port"]);
    }

    #[test]
    fn every_problem_of_a_broken_file_is_reported_at_once() {
        let text = r#"
listen = "nowhere"
shards = 3
[[engine]]
name = "a"
host = ""
dp_size = 0
[[engine]]
name = "a"
host = "h"
zmq_port = "5557"
"#;
        let found = problems(text);
        for words in [
            &["`listen`"][..],
            &["`shards`"],
            &["`host` is empty"],
            &["`dp_size`"],
            &["duplicate"],
            &["`zmq_port`"],
        ] {
            find(&found, words);
        }
        assert_eq!(found.len(), 6, "{found:#?}");
    }

    #[test]
    fn syntax_errors_and_misshapen_sections_are_reported_with_a_line() {
        find(&problems("a = 1\nx = [\n"), &["indexer.toml:2:"]);
        find(
            &problems("[engine]\nname = \"a\"\n"),
            &["indexer.toml:1:", "`engine`", "[[engine]]"],
        );
        find(
            &problems("defaults = 3\n"),
            &["indexer.toml:1:", "[defaults]", "expected a table"],
        );
    }

    #[test]
    fn load_names_the_path_and_the_os_error() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
        let path = dir.path().join("absent.toml");
        let err = Config::load(&path).unwrap_err();
        assert_eq!(err.problems.len(), 1);
        assert!(
            err.problems[0].contains(&path.display().to_string()),
            "{err}"
        );
        assert!(err.problems[0].contains("No such file"), "{err}");
    }

    #[test]
    fn load_reads_and_validates_the_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
        let path = dir.path().join("indexer.toml");
        std::fs::write(&path, "shards = 3\n").unwrap_or_else(|err| panic!("{err}"));
        let err = Config::load(&path).unwrap_err();
        find(
            &err.problems,
            &[&format!("{}:1:", path.display()), "`shards`"],
        );
    }
}
