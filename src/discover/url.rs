//! The two kinds of address discovery handles: the `discover` base URL of an engine's HTTP
//! server, and the `tcp://host:port` endpoints an engine reports for its ranks.
//!
//! Owns: what a `discover` URL may be (plain `http://`, no credentials, query or fragment), the
//! engine host it implies, and the wildcard-host rule (`*`, `0.0.0.0`, `::`, `[::]` mean "the
//! engine's node"). Never: resolves a name or opens a connection.

/// An engine's HTTP server as `discover` names it: `base` without a trailing `/` (routes are
/// appended to it), `host` as written in the URL, IPv6 literals without brackets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseUrl {
    pub base: String,
    pub host: String,
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
        let (host, port) = split_host_port(authority)
            .ok_or_else(|| format!("{text:?}: no host in {authority:?}; {accepted}"))?;
        if let Some(port) = port {
            match port.parse::<u16>() {
                Ok(1..) => {}
                _ => return Err(format!("{text:?}: port {port:?} is not 1..=65535")),
            }
        }
        Ok(BaseUrl {
            base: text.trim_end_matches('/').to_string(),
            host: host.to_string(),
        })
    }

    /// The URL of `route` (which starts with `/`) on this server.
    pub fn join(&self, route: &str) -> String {
        format!("{}{route}", self.base)
    }
}

/// `host[:port]` or `[v6][:port]` into the host (no brackets) and the port text, if any.
fn split_host_port(authority: &str) -> Option<(&str, Option<&str>)> {
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':')?)),
        }
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    (!host.is_empty()).then_some((host, port))
}

/// A rank's ZMQ endpoint as the engine reports it, split: `host` without brackets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpEndpoint {
    pub host: String,
    pub port: u16,
}

impl TcpEndpoint {
    /// Reads `tcp://host:port`; port 0 is kept (each engine decides what it means).
    pub fn parse(text: &str) -> Result<TcpEndpoint, String> {
        let Some(rest) = text.strip_prefix("tcp://") else {
            return Err(format!(
                "endpoint {text:?} is not tcp://HOST:PORT (ipc:// and inproc:// cannot be \
                 reached from another process on another node)"
            ));
        };
        // ZMQ also takes an unbracketed IPv6 host (`tcp://:::5557`): the port follows the last
        // colon.
        let split = match rest.matches(':').count() {
            2.. if !rest.starts_with('[') => rest.rsplit_once(':').map(|(h, p)| (h, Some(p))),
            _ => split_host_port(rest),
        };
        let (host, port) = match split {
            Some((host, Some(port))) if !host.is_empty() => (host, port),
            _ => return Err(format!("endpoint {text:?} has no HOST:PORT")),
        };
        let port = port
            .parse::<u16>()
            .map_err(|_| format!("endpoint {text:?}: port {port:?} is not 0..=65535"))?;
        Ok(TcpEndpoint {
            host: host.to_string(),
            port,
        })
    }

    /// True when the host means "every interface of the engine's node".
    pub fn has_wildcard_host(&self) -> bool {
        matches!(self.host.as_str(), "*" | "0.0.0.0" | "::")
    }

    /// `tcp://host:port` to connect to: a wildcard host becomes `engine_host`, the port is
    /// `port + offset` (None past 65535).
    pub fn connect_address(&self, engine_host: &str, offset: u32) -> Option<String> {
        let port = u16::try_from(u32::from(self.port) + offset).ok()?;
        let host = if self.has_wildcard_host() {
            engine_host
        } else {
            &self.host
        };
        Some(if host.contains(':') {
            format!("tcp://[{host}]:{port}")
        } else {
            format!("tcp://{host}:{port}")
        })
    }
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
        assert_eq!(url.host, "10.0.0.5");
        let url = BaseUrl::parse("http://[fd00::5]:8000/vllm-a").expect("valid");
        assert_eq!(url.host, "fd00::5");
        assert_eq!(
            url.join("/server_info"),
            "http://[fd00::5]:8000/vllm-a/server_info"
        );
        assert_eq!(BaseUrl::parse("http://gpu-1").expect("valid").host, "gpu-1");
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
        ] {
            let err = BaseUrl::parse(bad).expect_err(bad);
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
        assert!(BaseUrl::parse("https://h").unwrap_err().contains("no TLS"));
    }

    #[test]
    fn wildcard_hosts_become_the_engine_host_and_others_stay() {
        for wildcard in [
            "tcp://*:5557",
            "tcp://0.0.0.0:5557",
            "tcp://[::]:5557",
            "tcp://:::5557",
        ] {
            let endpoint = TcpEndpoint::parse(wildcard).expect(wildcard);
            assert!(endpoint.has_wildcard_host(), "{wildcard}");
            assert_eq!(
                endpoint.connect_address("10.0.0.5", 1).as_deref(),
                Some("tcp://10.0.0.5:5558")
            );
            assert_eq!(
                endpoint.connect_address("fd00::5", 0).as_deref(),
                Some("tcp://[fd00::5]:5557")
            );
        }
        let fixed = TcpEndpoint::parse("tcp://10.0.0.9:41234").expect("valid");
        assert_eq!(
            fixed.connect_address("10.0.0.5", 0).as_deref(),
            Some("tcp://10.0.0.9:41234")
        );
        assert_eq!(fixed.connect_address("h", 30_000), None);
    }

    #[test]
    fn endpoints_that_are_not_tcp_host_port_are_refused() {
        for bad in [
            "ipc:///tmp/kv",
            "inproc://kv",
            "tcp://host",
            "tcp://host:x",
            "tcp://:5557",
        ] {
            assert!(TcpEndpoint::parse(bad).is_err(), "{bad}");
        }
    }
}
