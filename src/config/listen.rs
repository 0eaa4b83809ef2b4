//! An HTTP listen address, as `listen`, `dynamo_listen`, `[route] listen`, `--listen` and a
//! peer's URL write it: `IP:port` (IPv6 in brackets) or `hostname:port`.
//!
//! Owns: that grammar and the words of its refusals. Never: resolves a name or binds.

use std::net::{IpAddr, SocketAddr};

use crate::endpoint::Host;

/// What every refusal of an HTTP listen address ends with.
const LISTEN_EXPECTED: &str = "expected IP:port or hostname:port (IPv6 in brackets: [::1]:8090)";

/// Why an HTTP listen address is refused; each message quotes it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ListenError {
    #[error("{0:?}: no port; {LISTEN_EXPECTED}")]
    NoPort(String),
    #[error("{addr:?}: port {port:?} is not a number 0..=65535")]
    Port { addr: String, port: String },
    #[error("{addr:?}: {host:?} is neither an IP nor a hostname; {LISTEN_EXPECTED}")]
    Host { addr: String, host: String },
}

/// Checks an HTTP listen address: `IP:port` (IPv6 in brackets) or `hostname:port`.
pub fn validate_listen(addr: &str) -> Result<(), ListenError> {
    listen_host_port(addr).map(|_| ())
}

/// An HTTP listen address (`listen`, `dynamo_listen`, a peer's authority) as its host and
/// port: `IP:port` with IPv6 in brackets, or `hostname:port`, the host read by `Host::parse`
/// (the grammar of endpoints). Not an `Endpoint`: no scheme, and port 0 binds a free port.
pub(super) fn listen_host_port(addr: &str) -> Result<(Host, u16), ListenError> {
    if let Ok(socket) = addr.parse::<SocketAddr>() {
        return Ok((Host::Ip(socket.ip()), socket.port()));
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(ListenError::NoPort(addr.to_string()));
    };
    let Ok(port) = port.parse::<u16>() else {
        return Err(ListenError::Port {
            addr: addr.to_string(),
            port: port.to_string(),
        });
    };
    match Host::parse(host) {
        Ok(Host::Ip(IpAddr::V6(_))) | Err(_) => Err(ListenError::Host {
            addr: addr.to_string(),
            host: host.to_string(),
        }),
        Ok(host) => Ok((host, port)),
    }
}

#[cfg(test)]
mod tests {
    use super::validate_listen;
    use crate::config::test_support::{find, problems};

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
}
