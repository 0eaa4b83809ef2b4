//! The keys of an engine whose ranks come from its own HTTP server (`discover`).
//!
//! Owns: the `discover` URL check (`discover::BaseUrl::parse`, so the file and discovery accept
//! the same URLs), `host` defaulting to the URL's host, `discover_interval_s`, and which rank
//! keys such an engine keeps: only those its own `[[engine]]` writes (`zmq_port`,
//! `dp_rank_start`, `dp_size`, `replay_port`), never `[defaults]`' — they are there to be
//! compared with the engine's answer, and a default written for the fixed engines of a fleet is
//! no statement about this one. Never: asks an engine anything (that is `discover`).

use std::ops::Range;

use super::diagnostics::Problems;
use super::engine::EngineFields;
use super::keys::Checked;
use super::{DiscoverConfig, DEFAULT_DISCOVER_INTERVAL_S};
use crate::discover::{BaseUrl, EngineApi, FileLayout};
use crate::endpoint::Host;

/// Why a `discover` value is refused, for `SectionChecker::text`.
pub(super) fn check_discover_url(url: &str) -> Option<String> {
    BaseUrl::parse(url)
        .err()
        .map(|why| format!("is invalid: {why}"))
}

/// `discover_interval_s` in an `[[engine]]` without `discover` would silently do nothing.
pub(super) fn check_interval_needs_discover(
    own: &EngineFields,
    interval_span: Option<Range<usize>>,
    section: &str,
    problems: &mut Problems<'_>,
) {
    if own.is_discovered() {
        return;
    }
    if let Some(span) = interval_span {
        let why = "`discover_interval_s` has no effect without `discover`: set `discover = \
                   \"http://HOST:PORT\"` (the engine's HTTP server) or remove it";
        problems.add(Some(span), section, why);
    }
}

/// The engine's node: `host` as written, else the `discover` URL's host.
pub(super) fn node_host(fields: &EngineFields) -> Option<Host> {
    match (&fields.host, &fields.discover) {
        (Checked::Valid(host), _) => Some(host.clone()),
        (Checked::Absent, Checked::Valid(url)) => BaseUrl::parse(url).ok().map(|url| url.host),
        _ => None,
    }
}

/// The `discover` settings of a valid discovered engine.
pub(super) fn discover_config(fields: &EngineFields) -> Option<DiscoverConfig> {
    let (Checked::Valid(name), Checked::Valid(url)) = (&fields.name, &fields.discover) else {
        return None;
    };
    let host = fields.host.clone().optional()?;
    Some(DiscoverConfig {
        api: EngineApi::new(name, url, host).ok()?,
        interval_s: fields
            .discover_interval_s
            .clone()
            .or_default_to(DEFAULT_DISCOVER_INTERVAL_S)?,
        file: FileLayout {
            zmq_port: fields.zmq_port.clone().optional()?,
            dp_rank_start: fields.dp_rank_start.clone().optional()?,
            dp_size: fields.dp_size.clone().optional()?,
            replay_port: fields.replay_port.clone().optional()?,
        },
    })
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{find, problems};
    use crate::config::{Config, DiscoverConfig, Ranks};
    use crate::discover::{EngineApi, FileLayout};

    fn parse(text: &str) -> Config {
        Config::parse(text, "indexer.toml").unwrap_or_else(|err| panic!("{err}"))
    }

    #[test]
    fn discover_alone_is_an_engine_on_the_urls_host_asked_every_30_s() {
        let config = parse("[[engine]]\nname = \"a\"\ndiscover = \"http://10.0.0.5:8000\"\n");
        let engine = &config.engines[0];
        assert_eq!(engine.host.to_string(), "10.0.0.5");
        assert_eq!(
            engine.ranks,
            Ranks::Discovered(DiscoverConfig {
                api: EngineApi::new("a", "http://10.0.0.5:8000", None).expect("valid"),
                interval_s: 30,
                file: FileLayout::default(),
            })
        );
    }

    #[test]
    fn written_host_interval_and_rank_keys_are_kept_and_defaults_rank_keys_are_not() {
        let text = r#"
[defaults]
zmq_port = 6000
dp_size = 4
replay_port = 6100
recover_port = 8200
discover_interval_s = 5
[[engine]]
name = "a"
host = "gpu-1"
discover = "http://[fd00::5]:8000/vllm"
dp_size = 2
zmq_port = 5557
discover_interval_s = 2
[[engine]]
name = "b"
discover = "http://[fd00::6]:8000"
"#;
        let config = parse(text);
        let (a, b) = (&config.engines[0], &config.engines[1]);
        assert_eq!(a.host.to_string(), "gpu-1");
        let discover = a.discover().expect("discovered");
        assert_eq!(
            (
                discover.api.url.base.as_str(),
                &*discover.api.host.to_string()
            ),
            ("http://[fd00::5]:8000/vllm", "gpu-1")
        );
        assert_eq!(discover.interval_s, 2);
        assert_eq!(
            discover.file,
            FileLayout {
                zmq_port: Some(5557),
                dp_rank_start: None,
                dp_size: Some(2),
                replay_port: None,
            }
        );
        assert_eq!(b.host.to_string(), "fd00::6");
        let discover = b.discover().expect("discovered");
        assert_eq!(
            (discover.interval_s, discover.file),
            (5, FileLayout::default())
        );
        assert_eq!(
            b.recover_port,
            Some(8200),
            "recover_port is still the file's"
        );
    }

    #[test]
    fn bad_urls_intervals_and_misplaced_keys_are_reported_with_their_line() {
        let text = r#"
[defaults]
discover = "http://h:8000"
discover_interval_s = 0
[[engine]]
name = "a"
discover = "https://10.0.0.5:8000"
[[engine]]
name = "b"
host = "h"
discover_interval_s = 10
[[engine]]
name = "c"
discover = "http://h2:8000"
discover_interval_s = 86401
"#;
        let found = problems(text);
        find(
            &found,
            &[
                "indexer.toml:3:",
                "[defaults]",
                "`discover` is not allowed here",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:4:",
                "[defaults]",
                "`discover_interval_s`",
                "found 0",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:7:",
                "engine \"a\"",
                "`discover` is invalid",
                "no TLS",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:11:",
                "engine \"b\"",
                "no effect without `discover`",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:15:",
                "engine \"c\"",
                "`discover_interval_s`",
                "86401",
            ],
        );
        assert_eq!(found.len(), 5, "{found:#?}");
    }

    #[test]
    fn port_overlaps_count_only_the_ports_a_discovered_engine_writes() {
        // The discovered engine names no zmq_port: the fixed engine's 5557 collides with
        // nothing. Its written replay_port does collide.
        let text = r#"
[[engine]]
name = "fixed"
host = "10.0.0.5"
[[engine]]
name = "asked"
discover = "http://10.0.0.5:8000"
[[engine]]
name = "asked-with-replay"
discover = "http://10.0.0.5:8001"
replay_port = 5557
"#;
        let found = problems(text);
        find(
            &found,
            &[
                "indexer.toml:8:",
                "engine \"asked-with-replay\"",
                "replay ports 5557..5557 overlap zmq ports of engine \"fixed\"",
            ],
        );
        assert_eq!(found.len(), 1, "{found:#?}");
    }
}
