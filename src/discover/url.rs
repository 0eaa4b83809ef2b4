//! The `discover` base URL of an engine's HTTP server (the `tcp://` endpoints its ranks report
//! are `crate::endpoint::Endpoint`s).
//!
//! Owns: what a `discover` URL may be (plain `http://`, no credentials, query or fragment) and
//! the engine host it implies (read by `Host::parse`, the host grammar endpoints use). Never:
//! resolves a name or opens a connection.

use std::net::IpAddr;

use crate::endpoint::Host;

/// An engine's HTTP server as `discover` names it: `base` without a trailing `/` (routes are
/// appended to it), `host` as written in the URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseUrl {
    pub base: String,
    pub host: Host,
}

impl BaseUrl {
    /// Checks `text` is `http://HOST[:PORT][/PATH]`; the error says what would be accepted.
    pub fn parse(text: &str) -> Result<BaseUrl, String> {
        let accepted = "expected http://HOST[:PORT][/PATH], the engine's HTTP server";
        let Some(rest) = text.strip_prefix("http://") else {
            return Err(if text.starts_with("https://") {
                format!("{text:?}: https is not supported (kv-indexer has no TLS); {accepted}")
            } else {
                format!("{text:?}: {accepted}")
            });
        };
        if rest.contains(['?', '#', '@']) || rest.chars().any(char::is_whitespace) {
            return Err(format!(
                "{text:?}: a query, fragment, credentials or spaces have no place here; {accepted}"
            ));
        }
        let authority = rest.split('/').next().unwrap_or_default();
        let (host, port, bracketed) = split_host_port(authority)
            .ok_or_else(|| format!("{text:?}: no host in {authority:?}; {accepted}"))?;
        let host = Host::parse(host).map_err(|why| format!("{text:?}: {why}; {accepted}"))?;
        if bracketed != matches!(host, Host::Ip(IpAddr::V6(_))) {
            return Err(format!(
                "{text:?}: an IPv6 host goes in brackets, and nothing else does; {accepted}"
            ));
        }
        if let Some(port) = port {
            match port.parse::<u16>() {
                Ok(1..) => {}
                _ => return Err(format!("{text:?}: port {port:?} is not 1..=65535")),
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
            let err = BaseUrl::parse(bad).expect_err(bad);
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
        assert!(BaseUrl::parse("https://h").unwrap_err().contains("no TLS"));
    }
}
