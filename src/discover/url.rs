//! The `discover` base URL of an engine's HTTP server (the `tcp://` endpoints its ranks report
//! are `crate::endpoint::Endpoint`s).
//!
//! Owns: what a `discover` URL may be (plain `http://`, no credentials, query or fragment) and
//! the engine host it implies (read by `Host::parse`, the host grammar endpoints use). Never:
//! resolves a name or opens a connection.

use std::net::IpAddr;

use thiserror::Error;

use crate::endpoint::{Host, HostError};

/// What every refusal of a `discover` URL ends with.
const ACCEPTED: &str = "expected http://HOST[:PORT][/PATH], the engine's HTTP server";

/// Why a `discover` URL is refused: each message quotes it and says what would be accepted.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum UrlError {
    #[error("{0:?}: https is not supported (kv-indexer has no TLS); {ACCEPTED}")]
    Https(String),
    #[error("{0:?}: {ACCEPTED}")]
    NotHttp(String),
    #[error("{0:?}: a query, fragment, credentials or spaces have no place here; {ACCEPTED}")]
    Extras(String),
    #[error("{text:?}: no host in {authority:?}; {ACCEPTED}")]
    NoHost { text: String, authority: String },
    #[error("{text:?}: {source}; {ACCEPTED}")]
    Host { text: String, source: HostError },
    #[error("{0:?}: an IPv6 host goes in brackets, and nothing else does; {ACCEPTED}")]
    Brackets(String),
    #[error("{text:?}: port {port:?} is not 1..=65535")]
    Port { text: String, port: String },
}

/// An engine's HTTP server as `discover` names it: `base` without a trailing `/` (routes are
/// appended to it), `host` as written in the URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseUrl {
    pub base: String,
    pub host: Host,
}

impl BaseUrl {
    /// Checks `text` is `http://HOST[:PORT][/PATH]`; the error says what would be accepted.
    pub fn parse(text: &str) -> Result<BaseUrl, UrlError> {
        let owned = || text.to_string();
        let Some(rest) = text.strip_prefix("http://") else {
            return Err(if text.starts_with("https://") {
                UrlError::Https(owned())
            } else {
                UrlError::NotHttp(owned())
            });
        };
        if rest.contains(['?', '#', '@']) || rest.chars().any(char::is_whitespace) {
            return Err(UrlError::Extras(owned()));
        }
        let authority = rest.split('/').next().unwrap_or_default();
        let (host, port, bracketed) =
            split_host_port(authority).ok_or_else(|| UrlError::NoHost {
                text: owned(),
                authority: authority.to_string(),
            })?;
        let host = Host::parse(host).map_err(|source| UrlError::Host {
            text: owned(),
            source,
        })?;
        if bracketed != matches!(host, Host::Ip(IpAddr::V6(_))) {
            return Err(UrlError::Brackets(owned()));
        }
        if let Some(port) = port {
            match port.parse::<u16>() {
                Ok(1..) => {}
                _ => {
                    return Err(UrlError::Port {
                        text: owned(),
                        port: port.to_string(),
                    })
                }
            }
        }
        Ok(BaseUrl {
            base: text.trim_end_matches('/').to_string(),
            host,
        })
    }

    /// The URL of `route` (which starts with `/`) on this server.
    pub fn join(&self, route: &str) -> String {
        format!("{}{route}", self.base)
    }
}

/// `host[:port]` or `[v6][:port]` into the host (no brackets), the port text if any, and
/// whether the host was in brackets.
fn split_host_port(authority: &str) -> Option<(&str, Option<&str>, bool)> {
    let (host, port, bracketed) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        match after {
            "" => (host, None, true),
            _ => (host, Some(after.strip_prefix(':')?), true),
        }
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port), false),
            None => (authority, None, false),
        }
    };
    (!host.is_empty()).then_some((host, port, bracketed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_keep_their_path_and_give_the_host_without_brackets() {
        let url = BaseUrl::parse("http://10.0.0.5:8000/").expect("valid");
        assert_eq!(
            url.join("/kv_event_sources"),
            "http://10.0.0.5:8000/kv_event_sources"
        );
        assert_eq!(url.host.to_string(), "10.0.0.5");
        let url = BaseUrl::parse("http://[fd00::5]:8000/vllm-a").expect("valid");
        assert_eq!(url.host.to_string(), "fd00::5");
        assert_eq!(
            url.join("/server_info"),
            "http://[fd00::5]:8000/vllm-a/server_info"
        );
        assert_eq!(
            BaseUrl::parse("http://gpu-1").expect("valid").host,
            Host::Name("gpu-1".into())
        );
    }

    #[test]
    fn base_urls_that_cannot_work_are_refused_with_what_would_be_accepted() {
        for bad in [
            "https://10.0.0.5:8000",
            "10.0.0.5:8000",
            "http://:8000",
            "http://host:0",
            "http://host:99999",
            "http://host:80?x=1",
            "http://user:pw@host:80",
            "http://[::1",
            "http://[gpu-1]:80",
            "http://bad_host!:80",
            "http://*:80",
        ] {
            let err = BaseUrl::parse(bad).expect_err(bad).to_string();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
        let err = BaseUrl::parse("https://h").expect_err("https");
        assert!(err.to_string().contains("no TLS"), "{err}");
    }
}
