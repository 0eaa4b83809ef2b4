//! `[defaults]` and `[[engine]]`: the per-engine rules, each a named check.
//!
//! Owns what makes one engine valid (a unique non-empty name, a host or a `discover` URL, ranks
//! below 1024, port ranges below 65536) and how `[defaults]` fills what an engine leaves out
//! (`discovered` says which keys a discovered engine takes from where). It reports every
//! problem of every engine and goes on to the next; it never decides where a rank's ports are
//! (`ports` does) and never compares two engines' ports (`ports::check_port_overlaps`).

use std::collections::HashMap;
use std::ops::Range;

use serde::Deserialize;
use toml::de::{DeArray, DeValue};
use toml::Spanned;

use crate::discover::BaseUrl;

use super::diagnostics::Problems;
use super::discovered::{self, check_discover_url};
use super::instance::{check_unique_instance, derived_instance_id};
use super::keys::{as_table, read_table, Checked, Int, SectionChecker};
use super::ports::{check_port_ranges, Placed, PortRange, RankRange, SocketKind};
use super::{
    EngineConfig, FixedRanks, Ranks, DEFAULT_DP_RANK_START, DEFAULT_DP_SIZE, DEFAULT_ZMQ_PORT,
    MAX_DISCOVER_INTERVAL_S, MAX_DP_SIZE, MAX_INSTANCE_ID,
};
use crate::endpoint::Host;

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
    discover: Option<Spanned<String>>,
    discover_interval_s: Option<Spanned<Int>>,
    instance_id: Option<Spanned<Int>>,
    tokenizer: Option<Spanned<String>>,
    openai_url: Option<Spanned<String>>,
    metrics_url: Option<Spanned<String>>,
    api_key_file: Option<Spanned<String>>,
    kv_cache_report_mode: Option<Spanned<String>>,
}

/// The per-engine keys, after their own checks; `[defaults]` leaves `name` and `host` absent.
#[derive(Clone, Debug, Default)]
pub(super) struct EngineFields {
    pub(super) name: Checked<String>,
    pub(super) host: Checked<Host>,
    pub(super) zmq_port: Checked<u16>,
    pub(super) dp_rank_start: Checked<u32>,
    pub(super) dp_size: Checked<u32>,
    pub(super) replay_port: Checked<u16>,
    pub(super) recover_port: Checked<u16>,
    pub(super) model: Checked<String>,
    pub(super) topic: Checked<String>,
    pub(super) discover: Checked<String>,
    pub(super) discover_interval_s: Checked<u32>,
    pub(super) instance_id: Checked<u64>,
    pub(super) tokenizer: Checked<String>,
    pub(super) openai_url: Checked<String>,
    /// Where the engine's Prometheus gauges are scraped; `""` turns the scrape off.
    pub(super) metrics_url: Checked<String>,
    pub(super) api_key_file: Checked<String>,
    /// `kv_cache_report_mode = "full"`: the engine announces the blocks it reuses again.
    pub(super) reports_reused: Checked<bool>,
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
        let host = checker.parsed("host", raw.host, |host| {
            if host.trim().is_empty() {
                Err("is empty".to_string())
            } else if host.starts_with('[') {
                Err("must be written without brackets, also for IPv6 (\"::1\")".to_string())
            } else {
                Host::parse(host).map_err(|why| format!("is invalid: {why}"))
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
            discover: checker.text("discover", raw.discover, check_discover_url),
            discover_interval_s: checker.int(
                "discover_interval_s",
                raw.discover_interval_s,
                &format!("1..={MAX_DISCOVER_INTERVAL_S} (seconds)"),
                |n| {
                    u32::try_from(n)
                        .ok()
                        .filter(|s| (1..=MAX_DISCOVER_INTERVAL_S).contains(s))
                },
            ),
            // TOML integers are i64: ids above 2^63 - 1 cannot be written.
            instance_id: checker.int(
                "instance_id",
                raw.instance_id,
                &format!("an integer 0..={MAX_INSTANCE_ID}"),
                |n| u64::try_from(n).ok(),
            ),
            tokenizer: checker.text("tokenizer", raw.tokenizer, |dir| {
                dir.trim().is_empty().then(|| "is empty".to_string())
            }),
            openai_url: checker.text("openai_url", raw.openai_url, |url| {
                BaseUrl::parse(url)
                    .err()
                    .map(|why| format!("is invalid: {why}"))
            }),
            metrics_url: checker.text("metrics_url", raw.metrics_url, |url| match url {
                "" => None,
                url => BaseUrl::parse(url)
                    .err()
                    .map(|why| format!("is invalid: {why} (\"\" turns the scrape off)")),
            }),
            api_key_file: checker.text("api_key_file", raw.api_key_file, |path| {
                path.trim().is_empty().then(|| "is empty".to_string())
            }),
            reports_reused: checker.parsed(
                "kv_cache_report_mode",
                raw.kv_cache_report_mode,
                |mode| match mode {
                    "new" => Ok(false),
                    "full" => Ok(true),
                    other => Err(format!(
                        "is {other:?}: expected \"new\" (the engine announces a block when it \
                         caches it, vLLM's default) or \"full\" (it also announces the blocks \
                         a request reuses)"
                    )),
                },
            ),
        }
    }

    /// These fields where set, else the `[defaults]` ones; a discovered engine takes no rank
    /// key from `[defaults]` (see `discovered`).
    fn or(&self, defaults: &EngineFields) -> EngineFields {
        let none = EngineFields::default();
        let rank_defaults = if self.is_discovered() {
            &none
        } else {
            defaults
        };
        EngineFields {
            name: self.name.clone(),
            host: self.host.clone(),
            zmq_port: self.zmq_port.or(&rank_defaults.zmq_port),
            dp_rank_start: self.dp_rank_start.or(&rank_defaults.dp_rank_start),
            dp_size: self.dp_size.or(&rank_defaults.dp_size),
            replay_port: self.replay_port.or(&rank_defaults.replay_port),
            recover_port: self.recover_port.or(&defaults.recover_port),
            model: self.model.or(&defaults.model),
            topic: self.topic.or(&defaults.topic),
            discover: self.discover.clone(),
            discover_interval_s: self.discover_interval_s.or(&defaults.discover_interval_s),
            instance_id: self.instance_id.clone(),
            tokenizer: self.tokenizer.or(&defaults.tokenizer),
            // Each engine's own server: a default would send every engine's requests to one.
            openai_url: self.openai_url.clone(),
            // A default may only turn every scrape off (`check_defaults`): a URL is one server's.
            metrics_url: self.metrics_url.or(&defaults.metrics_url),
            api_key_file: self.api_key_file.or(&defaults.api_key_file),
            reports_reused: self.reports_reused.or(&defaults.reports_reused),
        }
    }

    /// Whether the engine's ranks come from `discover` (also when its URL was rejected, so
    /// that a bad URL does not add a "missing `host`" of its own).
    pub(super) fn is_discovered(&self) -> bool {
        !matches!(self.discover, Checked::Absent)
    }
}

pub(super) fn check_defaults(
    value: &Spanned<DeValue<'_>>,
    problems: &mut Problems<'_>,
) -> EngineFields {
    let section = "[defaults]";
    let Some((raw, dropped)) = as_table(value, section, problems)
        .and_then(|table| read_table::<RawEngine>(&table, section, problems))
    else {
        return EngineFields::default();
    };
    let own_keys = [
        ("name", raw.name.as_ref().map(Spanned::span)),
        ("host", raw.host.as_ref().map(Spanned::span)),
        ("discover", raw.discover.as_ref().map(Spanned::span)),
        ("instance_id", raw.instance_id.as_ref().map(Spanned::span)),
    ];
    for (key, span) in own_keys {
        if let Some(span) = span {
            let why = format!("`{key}` is not allowed here: each [[engine]] sets its own");
            problems.add(Some(span), section, why);
        }
    }
    if let Some(url) = raw
        .metrics_url
        .as_ref()
        .filter(|url| !url.get_ref().is_empty())
    {
        let why = "`metrics_url` may only be \"\" here (no engine's load is scraped): each \
                   [[engine]] sets its own URL";
        problems.add(Some(url.span()), section, why.to_string());
    }
    let mut fields = EngineFields::check(raw, &dropped, section, problems);
    fields.name = Checked::Absent;
    fields.host = Checked::Absent;
    fields.discover = Checked::Absent;
    fields.instance_id = Checked::Absent;
    fields
}

/// The checked engines, and for the overlap check every port range below 65536 of every engine
/// with a valid host (even when another key of it is not).
#[derive(Default)]
pub(super) struct Engines {
    pub(super) valid: Vec<EngineConfig>,
    pub(super) placed: Vec<Placed>,
}

/// Where one `[[engine]]` is written, for its problems.
struct EngineAt {
    /// Position in the file.
    position: usize,
    /// `engine "name"`, or `engine #n` while it has no usable name.
    label: String,
    /// The whole table: problems of more than one key point at its first line.
    span: Range<usize>,
}

/// Every `[[engine]]` in file order, each through the rules below; a problem in one key or one
/// engine never stops the checks of the others.
pub(super) fn check_engines(
    value: &Spanned<DeValue<'_>>,
    defaults: &EngineFields,
    problems: &mut Problems<'_>,
) -> Engines {
    let mut engines = Engines::default();
    let Some(tables) = engine_tables(value, problems) else {
        return engines;
    };
    let mut first_line_of_name: HashMap<String, usize> = HashMap::new();
    let mut first_line_of_instance: HashMap<u64, usize> = HashMap::new();
    for (position, value) in tables.iter().enumerate() {
        let at = EngineAt {
            position,
            label: engine_label(value, position),
            span: value.span(),
        };
        let Some((raw, dropped)) = as_table(value, &at.label, problems)
            .and_then(|table| read_table::<RawEngine>(&table, &at.label, problems))
        else {
            continue;
        };
        check_required_keys(&raw, &dropped, &at, problems);
        check_unique_name(raw.name.as_ref(), &mut first_line_of_name, &at, problems);
        let interval_span = raw.discover_interval_s.as_ref().map(Spanned::span);
        let own = EngineFields::check(raw, &dropped, &at.label, problems);
        discovered::check_interval_needs_discover(&own, interval_span, &at.label, problems);
        let fields = own.or(defaults);
        // Every check below runs whatever the others found: a missing host or too many ranks
        // must not hide a port range past 65535 (one edit fixes every problem, not one a run).
        let Some(ranks) = check_ranks(&fields, &at, problems) else {
            continue;
        };
        let (fitting, all_fit) =
            check_port_ranges(port_bases(&fields), ranks, &at.label, &at.span, problems);
        if let Some(host) = discovered::node_host(&fields) {
            engines
                .placed
                .extend(fitting.into_iter().map(|range| placed(&host, &at, range)));
        }
        if all_fit && ranks.below_max() {
            let engine = engine_config(fields, ranks);
            if let Some(engine) = &engine {
                let (label, span) = (&at.label, at.span.clone());
                check_unique_instance(engine, &mut first_line_of_instance, label, span, problems);
            }
            engines.valid.extend(engine);
        }
    }
    engines
}

/// `engine` must be an array of tables (`[[engine]]`).
fn engine_tables<'v, 'i>(
    value: &'v Spanned<DeValue<'i>>,
    problems: &mut Problems<'_>,
) -> Option<&'v DeArray<'i>> {
    match value.get_ref() {
        DeValue::Array(tables) => Some(tables),
        other => {
            let why = format!(
                "expected [[engine]] tables (an array of tables), found {}",
                other.type_str()
            );
            problems.add(Some(value.span()), "`engine`", why);
            None
        }
    }
}

/// The engine's name as written when it is a non-empty string, else its position (from 1).
fn engine_label(value: &Spanned<DeValue<'_>>, position: usize) -> String {
    let written_name = value
        .get_ref()
        .as_table()
        .and_then(|table| table.get("name"))
        .and_then(|name| name.get_ref().as_str())
        .filter(|name| !name.is_empty());
    match written_name {
        Some(name) => format!("engine {name:?}"),
        None => format!("engine #{}", position + 1),
    }
}

/// `name` and `host` have no default (`host` defaults to the `discover` URL's host); one that
/// was written but dropped is already reported.
fn check_required_keys(
    raw: &RawEngine,
    dropped: &[String],
    at: &EngineAt,
    problems: &mut Problems<'_>,
) {
    let has_discover = raw.discover.is_some() || dropped.iter().any(|key| key == "discover");
    let host_present = raw.host.is_some() || has_discover;
    for (key, present) in [("name", raw.name.is_some()), ("host", host_present)] {
        if !present && !dropped.iter().any(|dropped| dropped == key) {
            problems.add(Some(at.span.clone()), &at.label, format!("missing `{key}`"));
        }
    }
}

/// A name used before is reported on its later use, with the line of its first.
fn check_unique_name(
    name: Option<&Spanned<String>>,
    first_line_of_name: &mut HashMap<String, usize>,
    at: &EngineAt,
    problems: &mut Problems<'_>,
) {
    let Some(name) = name else { return };
    let line = problems.line(name.span().start);
    match first_line_of_name.get(name.get_ref()) {
        Some(first) if !name.get_ref().is_empty() => {
            let why = format!("duplicate `name` (first used on line {first})");
            problems.add(Some(name.span()), &at.label, why);
        }
        _ => {
            first_line_of_name.insert(name.get_ref().clone(), line);
        }
    }
}

/// The engine's global ranks as written, when `dp_rank_start` and `dp_size` are valid; ranks
/// that run past `MAX_DP_SIZE` are reported and still returned, for the port checks.
fn check_ranks(
    fields: &EngineFields,
    at: &EngineAt,
    problems: &mut Problems<'_>,
) -> Option<RankRange> {
    let ranks = RankRange {
        start: fields
            .dp_rank_start
            .clone()
            .or_default_to(DEFAULT_DP_RANK_START)?,
        size: fields.dp_size.clone().or_default_to(DEFAULT_DP_SIZE)?,
    };
    if !ranks.below_max() {
        let why = format!(
            "global ranks {}..{} run past {} (`dp_rank_start` {} + `dp_size` {} must be at most {MAX_DP_SIZE})",
            ranks.start,
            ranks.end() - 1,
            MAX_DP_SIZE - 1,
            ranks.start,
            ranks.size,
        );
        problems.add(Some(at.span.clone()), &at.label, why);
    }
    Some(ranks)
}

/// Rank 0's port of each socket the engine has; a rejected port is left out (already reported),
/// and so is a port a discovered engine's file does not name (the engine has it).
fn port_bases(fields: &EngineFields) -> [(SocketKind, Option<u16>); 3] {
    let zmq_port = match fields.is_discovered() {
        true => fields.zmq_port.clone().optional().flatten(),
        false => fields.zmq_port.clone().or_default_to(DEFAULT_ZMQ_PORT),
    };
    [
        (SocketKind::Zmq, zmq_port),
        (
            SocketKind::Replay,
            fields.replay_port.clone().optional().flatten(),
        ),
        (
            SocketKind::Recover,
            fields.recover_port.clone().optional().flatten(),
        ),
    ]
}

fn placed(host: &Host, at: &EngineAt, range: PortRange) -> Placed {
    Placed {
        host: host.to_string().to_lowercase(),
        written_host: host.to_string(),
        engine: at.position,
        label: at.label.clone(),
        span: at.span.clone(),
        range,
    }
}

/// Where vLLM's and SGLang's OpenAI servers serve their Prometheus gauges.
const METRICS_PATH: &str = "/metrics";

/// An `openai_url` as the server's base: one written as the API's base (`http://h:8000/v1`, what
/// an OpenAI client is given) loses its `/v1`, which every routed path begins with.
fn openai_base(url: &str) -> &str {
    let url = url.trim_end_matches('/');
    url.strip_suffix("/v1").unwrap_or(url)
}

/// The engine with defaults applied, when every key of it is valid.
fn engine_config(fields: EngineFields, ranks: RankRange) -> Option<EngineConfig> {
    let host = discovered::node_host(&fields)?;
    let source = match fields.is_discovered() {
        true => Ranks::Discovered(discovered::discover_config(&fields)?),
        false => Ranks::Fixed(FixedRanks {
            zmq_port: fields.zmq_port.or_default_to(DEFAULT_ZMQ_PORT)?,
            dp_rank_start: ranks.start,
            dp_size: ranks.size,
            replay_port: fields.replay_port.optional()?,
        }),
    };
    let openai_url = match (fields.openai_url.optional()?, &source) {
        (Some(url), _) => BaseUrl::parse(openai_base(&url)).ok(),
        (None, Ranks::Discovered(discover)) => Some(discover.api.url.clone()),
        (None, Ranks::Fixed(_)) => None,
    };
    let metrics_url = match (fields.metrics_url.optional()?, &openai_url) {
        (Some(url), _) if url.is_empty() => None,
        (Some(url), _) => BaseUrl::parse(&url).ok(),
        (None, Some(openai)) => BaseUrl::parse(&openai.join(METRICS_PATH)).ok(),
        (None, None) => None,
    };
    let name: String = fields.name.optional()??;
    let instance_id = fields
        .instance_id
        .optional()?
        .unwrap_or_else(|| derived_instance_id(&name));
    Some(EngineConfig {
        instance_id,
        name,
        host,
        ranks: source,
        recover_port: fields.recover_port.optional()?,
        model: fields.model.optional()?,
        topic: fields.topic.or_default_to(String::new())?,
        tokenizer: fields.tokenizer.optional()?,
        openai_url,
        metrics_url,
        api_key_file: fields.api_key_file.optional()?,
        reports_reused: fields.reports_reused.or_default_to(false)?,
    })
}

#[cfg(test)]
mod tests;
