//! The `[route]` table: the OpenAI-compatible front end (docs.md "Routing"), off when absent.
//!
//! Owns its keys, their defaults and ranges, and the rule that the route listener differs from
//! the API's. Never: decides where a request goes (`route` does) or reads a token file's text
//! before the service starts (`Route::read_token` does, then).

use serde::Deserialize;
use toml::de::DeValue;
use toml::Spanned;

use super::diagnostics::Problems;
use super::keys::{as_table, read_table, Int, SectionChecker};
use super::read_token_file;
use super::validate_listen;

const SECTION: &str = "[route]";
/// Requests the front end forwards at once; one more is answered 429.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 4_096;
/// The most `max_concurrent_requests` may be: each open request holds two descriptors (the
/// client's and the engine's connection) and its buffers.
pub const MAX_CONCURRENT_REQUESTS: usize = 1_000_000;
/// How long an engine may take to send the first byte of its answer: a long prompt's prefill
/// on a loaded engine takes minutes, not ten.
pub const DEFAULT_FIRST_BYTE_TIMEOUT_S: u32 = 600;
/// How long a streamed answer may pause between two chunks.
pub const DEFAULT_IDLE_TIMEOUT_S: u32 = 60;
/// How long connecting to an engine may take: a reachable engine accepts in milliseconds.
pub const DEFAULT_CONNECT_TIMEOUT_S: u32 = 2;
/// The longest any of the timeouts may be: a day.
pub const MAX_TIMEOUT_S: u32 = 86_400;
/// How often each engine server's `GET /health` is asked: a server that dies is out within
/// `unhealthy_threshold` of these, one that comes back is in within `healthy_threshold`.
pub const DEFAULT_HEALTH_INTERVAL_S: u32 = 5;
/// How long a health check may take: a server up answers `/health` in milliseconds.
pub const DEFAULT_HEALTH_TIMEOUT_S: u32 = 2;
/// Failed checks in a row that take a server out: one lost check is not an outage.
pub const DEFAULT_UNHEALTHY_THRESHOLD: u32 = 2;
/// Passing checks in a row that bring it back.
pub const DEFAULT_HEALTHY_THRESHOLD: u32 = 1;
/// The most checks in a row a threshold may ask.
pub const MAX_THRESHOLD: u32 = 100;
/// How long a stop lets open requests and streams finish before it cuts them: a chat answer
/// of a few hundred tokens ends within it.
pub const DEFAULT_DRAIN_S: u32 = 30;
/// The `/v1/responses` ids whose engine the front end remembers, for `previous_response_id`:
/// an id is 40 bytes or so, and 100,000 of them a few MiB.
pub const DEFAULT_RESPONSES_REMEMBERED: usize = 100_000;
/// The most `responses_remembered` may be.
pub const MAX_RESPONSES_REMEMBERED: usize = 10_000_000;

/// How long the front end waits for an engine's `POST /tokenize` when no tokenizer of a model
/// is local: vLLM answers in a few milliseconds, and every routed request of that model waits
/// this long at worst before it is routed by load alone.
pub const DEFAULT_ENGINE_TOKENIZE_TIMEOUT_MS: u32 = 500;
/// The longest `engine_tokenize_timeout_ms` may be: the prompt waits for it before routing.
pub const MAX_ENGINE_TOKENIZE_TIMEOUT_MS: u32 = 60_000;

/// The `[route]` table, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The front end's address, `IP:port` or `hostname:port`.
    pub listen: String,
    /// The file holding the token clients must send (`Authorization: Bearer`), separate from
    /// the admin token; none: the front end is open.
    pub auth_token_file: Option<String>,
    pub max_concurrent_requests: usize,
    pub first_byte_timeout_s: u32,
    pub idle_timeout_s: u32,
    pub connect_timeout_s: u32,
    /// Seconds between two health checks of each engine server; 0 turns them off.
    pub health_interval_s: u32,
    pub health_timeout_s: u32,
    pub unhealthy_threshold: u32,
    pub healthy_threshold: u32,
    /// At a stop, how long open requests and streams may take to finish (0: cut at once).
    pub drain_s: u32,
    /// `/v1/responses` ids remembered with the engine that created them (least recently used
    /// forgotten first); 0 remembers none.
    pub responses_remembered: usize,
    /// How long an engine's `POST /tokenize` may take (0: engines are never asked).
    pub engine_tokenize_timeout_ms: u32,
}

impl Route {
    /// The front end on `listen` with every other key at its default (`--route-listen`
    /// without a `[route]` table).
    pub fn listening_on(listen: String) -> Route {
        Route {
            listen,
            auth_token_file: None,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
            first_byte_timeout_s: DEFAULT_FIRST_BYTE_TIMEOUT_S,
            idle_timeout_s: DEFAULT_IDLE_TIMEOUT_S,
            connect_timeout_s: DEFAULT_CONNECT_TIMEOUT_S,
            health_interval_s: DEFAULT_HEALTH_INTERVAL_S,
            health_timeout_s: DEFAULT_HEALTH_TIMEOUT_S,
            unhealthy_threshold: DEFAULT_UNHEALTHY_THRESHOLD,
            healthy_threshold: DEFAULT_HEALTHY_THRESHOLD,
            drain_s: DEFAULT_DRAIN_S,
            responses_remembered: DEFAULT_RESPONSES_REMEMBERED,
            engine_tokenize_timeout_ms: DEFAULT_ENGINE_TOKENIZE_TIMEOUT_MS,
        }
    }
}

/// What a reload from `old` to `new` changes of the front end's reloadable settings, each as
/// `"key: from -> to"` (the secrets' files are named, never their text).
pub fn route_changes(old: &super::Config, new: &super::Config) -> Vec<String> {
    let mut changes = Vec::new();
    let mut compare = |key: String, from: String, to: String| {
        if from != to {
            changes.push(format!("{key}: {from} -> {to}"));
        }
    };
    if let (Some(old), Some(new)) = (&old.route, &new.route) {
        let none = || "(none)".to_string();
        compare(
            "[route] auth_token_file".into(),
            old.auth_token_file.clone().unwrap_or_else(none),
            new.auth_token_file.clone().unwrap_or_else(none),
        );
        type Read = fn(&Route) -> u32;
        let numbers: [(&str, Read); 10] = [
            ("first_byte_timeout_s", |r| r.first_byte_timeout_s),
            ("idle_timeout_s", |r| r.idle_timeout_s),
            ("connect_timeout_s", |r| r.connect_timeout_s),
            ("health_interval_s", |r| r.health_interval_s),
            ("health_timeout_s", |r| r.health_timeout_s),
            ("unhealthy_threshold", |r| r.unhealthy_threshold),
            ("healthy_threshold", |r| r.healthy_threshold),
            ("drain_s", |r| r.drain_s),
            ("responses_remembered", |r| {
                u32::try_from(r.responses_remembered).unwrap_or(u32::MAX)
            }),
            ("engine_tokenize_timeout_ms", |r| {
                r.engine_tokenize_timeout_ms
            }),
        ];
        for (key, value) in numbers {
            compare(
                format!("[route] {key}"),
                value(old).to_string(),
                value(new).to_string(),
            );
        }
    }
    for engine in &new.engines {
        let Some(before) = old.engines.iter().find(|e| e.name == engine.name) else {
            continue;
        };
        let url = |e: &super::EngineConfig| {
            e.openai_url
                .as_ref()
                .map_or_else(|| "(none)".to_string(), |url| url.base.clone())
        };
        compare(
            format!("engine {:?} openai_url", engine.name),
            url(before),
            url(engine),
        );
        let key_file = |e: &super::EngineConfig| {
            e.api_key_file
                .clone()
                .unwrap_or_else(|| "(none)".to_string())
        };
        compare(
            format!("engine {:?} api_key_file", engine.name),
            key_file(before),
            key_file(engine),
        );
    }
    changes
}

impl Route {
    /// The text of `auth_token_file`, when set; the error names the file, never its content.
    pub fn read_token(&self) -> anyhow::Result<Option<String>> {
        read_token_file(
            self.auth_token_file.as_deref(),
            "[route] auth_token_file",
            "the clients' token",
        )
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    listen: Option<Spanned<String>>,
    auth_token_file: Option<Spanned<String>>,
    max_concurrent_requests: Option<Spanned<Int>>,
    first_byte_timeout_s: Option<Spanned<Int>>,
    idle_timeout_s: Option<Spanned<Int>>,
    connect_timeout_s: Option<Spanned<Int>>,
    health_interval_s: Option<Spanned<Int>>,
    health_timeout_s: Option<Spanned<Int>>,
    unhealthy_threshold: Option<Spanned<Int>>,
    healthy_threshold: Option<Spanned<Int>>,
    drain_s: Option<Spanned<Int>>,
    responses_remembered: Option<Spanned<Int>>,
    engine_tokenize_timeout_ms: Option<Spanned<Int>>,
}

/// Reads `[route]`; `None` when a key is wrong or `listen` is missing (each reported).
/// `api_listens` are the other servers' addresses, which `listen` must differ from.
pub(super) fn check_route(
    value: &Spanned<DeValue<'_>>,
    api_listens: &[&str],
    problems: &mut Problems<'_>,
) -> Option<Route> {
    let table = as_table(value, SECTION, problems)?;
    let (raw, dropped) = read_table::<RawRoute>(&table, SECTION, problems)?;
    let mut checker = SectionChecker {
        section: SECTION,
        dropped: &dropped,
        problems,
    };
    let listen = checker.text("listen", raw.listen, |addr| match validate_listen(addr) {
        Err(why) => Some(format!("is invalid: {why}")),
        Ok(()) if api_listens.contains(&addr) => {
            Some(format!("must differ from the API's address ({addr})"))
        }
        Ok(()) => None,
    });
    let auth_token_file = checker.text("auth_token_file", raw.auth_token_file, |path| {
        path.trim().is_empty().then(|| "is empty".to_string())
    });
    let max_concurrent_requests = checker.int(
        "max_concurrent_requests",
        raw.max_concurrent_requests,
        &format!("1..={MAX_CONCURRENT_REQUESTS}"),
        |n| {
            usize::try_from(n)
                .ok()
                .filter(|n| (1..=MAX_CONCURRENT_REQUESTS).contains(n))
        },
    );
    let seconds = format!("1..={MAX_TIMEOUT_S} (seconds)");
    let timeout = |n: i64| {
        u32::try_from(n)
            .ok()
            .filter(|s| (1..=MAX_TIMEOUT_S).contains(s))
    };
    let first_byte_timeout_s = checker.int(
        "first_byte_timeout_s",
        raw.first_byte_timeout_s,
        &seconds,
        timeout,
    );
    let idle_timeout_s = checker.int("idle_timeout_s", raw.idle_timeout_s, &seconds, timeout);
    let connect_timeout_s = checker.int(
        "connect_timeout_s",
        raw.connect_timeout_s,
        &seconds,
        timeout,
    );
    let health_interval_s = checker.int(
        "health_interval_s",
        raw.health_interval_s,
        &format!("0..={MAX_TIMEOUT_S} (seconds; 0 turns the checks off)"),
        |n| u32::try_from(n).ok().filter(|s| *s <= MAX_TIMEOUT_S),
    );
    let health_timeout_s = checker.int("health_timeout_s", raw.health_timeout_s, &seconds, timeout);
    let checks = format!("1..={MAX_THRESHOLD} (checks in a row)");
    let threshold = |n: i64| {
        u32::try_from(n)
            .ok()
            .filter(|n| (1..=MAX_THRESHOLD).contains(n))
    };
    let unhealthy_threshold = checker.int(
        "unhealthy_threshold",
        raw.unhealthy_threshold,
        &checks,
        threshold,
    );
    let healthy_threshold = checker.int(
        "healthy_threshold",
        raw.healthy_threshold,
        &checks,
        threshold,
    );
    let drain_s = checker.int(
        "drain_s",
        raw.drain_s,
        &format!("0..={MAX_TIMEOUT_S} (seconds)"),
        |n| u32::try_from(n).ok().filter(|s| *s <= MAX_TIMEOUT_S),
    );
    let responses_remembered = checker.int(
        "responses_remembered",
        raw.responses_remembered,
        &format!("0..={MAX_RESPONSES_REMEMBERED} (response ids)"),
        |n| {
            usize::try_from(n)
                .ok()
                .filter(|n| *n <= MAX_RESPONSES_REMEMBERED)
        },
    );
    let engine_tokenize_timeout_ms = checker.int(
        "engine_tokenize_timeout_ms",
        raw.engine_tokenize_timeout_ms,
        &format!("0..={MAX_ENGINE_TOKENIZE_TIMEOUT_MS} (milliseconds; 0: engines are never asked)"),
        |n| {
            u32::try_from(n)
                .ok()
                .filter(|ms| *ms <= MAX_ENGINE_TOKENIZE_TIMEOUT_MS)
        },
    );
    let listen = match listen.optional()? {
        Some(listen) => listen,
        None => {
            let why = "`listen` is missing: the front end's address, e.g. \"127.0.0.1:8080\"";
            problems.add(Some(value.span()), SECTION, why);
            return None;
        }
    };
    Some(Route {
        listen,
        auth_token_file: auth_token_file.optional()?,
        max_concurrent_requests: max_concurrent_requests
            .or_default_to(DEFAULT_MAX_CONCURRENT_REQUESTS)?,
        first_byte_timeout_s: first_byte_timeout_s.or_default_to(DEFAULT_FIRST_BYTE_TIMEOUT_S)?,
        idle_timeout_s: idle_timeout_s.or_default_to(DEFAULT_IDLE_TIMEOUT_S)?,
        connect_timeout_s: connect_timeout_s.or_default_to(DEFAULT_CONNECT_TIMEOUT_S)?,
        health_interval_s: health_interval_s.or_default_to(DEFAULT_HEALTH_INTERVAL_S)?,
        health_timeout_s: health_timeout_s.or_default_to(DEFAULT_HEALTH_TIMEOUT_S)?,
        unhealthy_threshold: unhealthy_threshold.or_default_to(DEFAULT_UNHEALTHY_THRESHOLD)?,
        healthy_threshold: healthy_threshold.or_default_to(DEFAULT_HEALTHY_THRESHOLD)?,
        drain_s: drain_s.or_default_to(DEFAULT_DRAIN_S)?,
        responses_remembered: responses_remembered.or_default_to(DEFAULT_RESPONSES_REMEMBERED)?,
        engine_tokenize_timeout_ms: engine_tokenize_timeout_ms
            .or_default_to(DEFAULT_ENGINE_TOKENIZE_TIMEOUT_MS)?,
    })
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    /// The `[route]` table of a file whose `[route]` also has `keys`, or the rejection.
    fn route(keys: &str) -> Result<super::Route, String> {
        let text = format!(
            "[[engine]]\nname = \"a\"\nhost = \"127.0.0.1\"\nzmq_port = 5557\n\n[route]\n\
             listen = \"127.0.0.1:8080\"\n{keys}"
        );
        Config::parse(&text, "indexer.toml")
            .map(|config| config.route.expect("[route]"))
            .map_err(|rejected| format!("{rejected:#}"))
    }

    #[test]
    fn responses_remembered_defaults_to_100000_and_takes_0_to_10_million() {
        let remembered = |keys: &str| route(keys).map(|route| route.responses_remembered);
        assert_eq!(remembered(""), Ok(super::DEFAULT_RESPONSES_REMEMBERED));
        assert_eq!(remembered("responses_remembered = 0"), Ok(0));
        let rejected = remembered("responses_remembered = 10000001").expect_err("too many");
        assert!(rejected.contains("responses_remembered"), "{rejected}");
    }

    fn drain_s(keys: &str) -> Result<u32, String> {
        route(keys).map(|route| route.drain_s)
    }

    #[test]
    fn engine_tokenize_timeout_ms_defaults_to_500_and_takes_0_to_a_minute() {
        let timeout = |keys: &str| route(keys).map(|route| route.engine_tokenize_timeout_ms);
        assert_eq!(timeout(""), Ok(super::DEFAULT_ENGINE_TOKENIZE_TIMEOUT_MS));
        assert_eq!(timeout("engine_tokenize_timeout_ms = 0"), Ok(0));
        assert_eq!(timeout("engine_tokenize_timeout_ms = 60000"), Ok(60_000));
        for refused in [
            "engine_tokenize_timeout_ms = -1",
            "engine_tokenize_timeout_ms = 60001",
        ] {
            let rejected = timeout(refused).expect_err(refused);
            assert!(
                rejected.contains("engine_tokenize_timeout_ms"),
                "{rejected}"
            );
        }
    }

    #[test]
    fn drain_s_defaults_to_30_and_takes_0_to_a_day() {
        assert_eq!(drain_s("").ok(), Some(super::DEFAULT_DRAIN_S));
        assert_eq!(drain_s("drain_s = 0").ok(), Some(0));
        assert_eq!(drain_s("drain_s = 86400").ok(), Some(86_400));
        for refused in ["drain_s = -1", "drain_s = 86401"] {
            let rejected = drain_s(refused).expect_err(refused).to_string();
            assert!(rejected.contains("drain_s"), "{rejected}");
        }
    }
}
