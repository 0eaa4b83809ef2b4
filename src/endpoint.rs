//! A rank's ZMQ endpoint, `tcp://host:port`, and the host it names: parsed once where the text
//! enters (the file's `host`, a discovery answer, a `POST /register`) and carried typed from
//! there, so code that needs the port or the host reads a field.
//!
//! Owns: the one grammar of a host (an IPv4 or IPv6 address, a name of letter, digit, `-` and
//! `_` labels, or the wildcard `*` a publisher binds) and of a `tcp://` endpoint (an IPv6 host in
//! brackets, or ZMQ's unbracketed `tcp://:::5557`), every refusal naming the text and what is
//! wrong with it, the wildcard rule (`*`, `0.0.0.0`, `::` mean "every interface of the node"),
//! and a `Display` that parses back to the same value. Never: resolves a name, decides which
//! endpoints a socket may be aimed at (that is `discover::endpoint_policy`), or opens a socket.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;

use serde::{Serialize, Serializer};
use thiserror::Error;

/// The longest host name DNS carries, in bytes, without a trailing dot.
const MAX_NAME_BYTES: usize = 253;
/// The longest label of a host name, in bytes.
const MAX_LABEL_BYTES: usize = 63;

/// Why a host's text is refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum HostError {
    #[error("{0:?} is the wildcard host: name the host or its IP address")]
    Wildcard(String),
    #[error("the host is empty")]
    Empty,
    #[error(
        "host {0:?} is neither an IP address nor a host name (labels of letters, digits, - and \
         _, joined by dots)"
    )]
    NotAHost(String),
}

/// Why an endpoint's text is refused: each message quotes the text and says what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum EndpointError {
    #[error(
        "{0:?} is not tcp://host:port (ipc:// and inproc:// cannot be reached from another \
         process on another node)"
    )]
    LocalScheme(String),
    #[error("{0:?} is not tcp://host:port")]
    NotTcp(String),
    #[error("{0:?}: no ] closes the IPv6 host")]
    UnclosedBracket(String),
    #[error("{text:?}: [{inside}] is not an IPv6 address (only one goes in brackets)")]
    BracketedNotV6 { text: String, inside: String },
    #[error("{text:?}: no :port after [{inside}]")]
    NoPortAfterBracket { text: String, inside: String },
    #[error("{0:?}: no port (tcp://host:port)")]
    NoPort(String),
    #[error(
        "{text:?}: {host:?} is not an IPv6 address; an IPv6 host goes in brackets, \
         tcp://[::1]:5557"
    )]
    UnbracketedNotV6 { text: String, host: String },
    #[error("{0:?}: no host before the port")]
    NoHost(String),
    #[error("{text:?}: {source}")]
    Host { text: String, source: HostError },
    #[error("{0:?}: no port after the host's colon")]
    EmptyPort(String),
    #[error("{text:?}: port {port:?} is not a number 0..=65535")]
    BadPort { text: String, port: String },
}

/// A host as a connect or a bind names it. Displays bare (IPv6 without brackets, as the file's
/// `host` is written); `in_url` gives the form inside a URL or endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Host {
    /// `*`: every interface, as a publisher binds; only an endpoint may have it.
    Any,
    Ip(IpAddr),
    /// A name as written: `127.1` and `0x7f.0.0.1` are names here (std reads neither), which
    /// `discover::endpoint_policy` reads as `inet_aton` does.
    Name(String),
}

impl Host {
    /// A host as the file's `host` or a URL's authority writes it: an IP address (IPv6 without
    /// brackets) or a name. The wildcard `*` is refused: nothing can be reached at it.
    pub fn parse(text: &str) -> Result<Host, HostError> {
        match parse_host(text)? {
            Host::Any => Err(HostError::Wildcard(text.to_string())),
            host => Ok(host),
        }
    }

    /// True when the host means "every interface of the node": `*`, `0.0.0.0` or `::`.
    pub fn is_wildcard(&self) -> bool {
        match self {
            Host::Any => true,
            Host::Ip(ip) => ip.is_unspecified(),
            Host::Name(_) => false,
        }
    }

    /// True for a loopback address and for `localhost`: only this host connects there.
    pub fn is_loopback(&self) -> bool {
        match self {
            Host::Ip(ip) => ip.is_loopback(),
            Host::Name(name) => name.eq_ignore_ascii_case("localhost"),
            Host::Any => false,
        }
    }

    /// The host as it goes into a URL or an endpoint: an IPv6 address in brackets.
    pub fn in_url(&self) -> impl fmt::Display + '_ {
        UrlHost(self)
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Any => f.write_str("*"),
            Host::Ip(ip) => write!(f, "{ip}"),
            Host::Name(name) => f.write_str(name),
        }
    }
}

impl FromStr for Host {
    type Err = HostError;

    fn from_str(text: &str) -> Result<Host, HostError> {
        Host::parse(text)
    }
}

/// `Host::in_url`'s form.
struct UrlHost<'a>(&'a Host);

impl fmt::Display for UrlHost<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Host::Ip(IpAddr::V6(v6)) => write!(f, "[{v6}]"),
            host => write!(f, "{host}"),
        }
    }
}

/// A ZMQ TCP endpoint: what a rank's PUB or replay ROUTER binds, or what a SUB or DEALER
/// connects to. Displays as `tcp://host:port` (IPv6 in brackets), which parses back to it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub host: Host,
    /// 0 only in what a publisher binds (the OS picks its port): never connected to.
    pub port: u16,
}

impl Endpoint {
    pub fn new(host: Host, port: u16) -> Endpoint {
        Endpoint { host, port }
    }

    /// Reads `tcp://host:port`: the host an IPv4 address, an IPv6 address in brackets (or
    /// bare, as ZMQ also takes it: `tcp://:::5557`, the port after the last colon), a name, or
    /// `*`; the port decimal, 0 included. The error quotes `text` and says what is wrong.
    pub fn parse(text: &str) -> Result<Endpoint, EndpointError> {
        let owned = || text.to_string();
        let Some(authority) = text.strip_prefix("tcp://") else {
            let local = ["ipc://", "inproc://"]
                .iter()
                .any(|scheme| text.starts_with(scheme));
            return Err(if local {
                EndpointError::LocalScheme(owned())
            } else {
                EndpointError::NotTcp(owned())
            });
        };
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            let Some((inside, after)) = bracketed.split_once(']') else {
                return Err(EndpointError::UnclosedBracket(owned()));
            };
            let v6 = inside
                .parse::<Ipv6Addr>()
                .map_err(|_| EndpointError::BracketedNotV6 {
                    text: owned(),
                    inside: inside.to_string(),
                })?;
            let Some(port) = after.strip_prefix(':') else {
                return Err(EndpointError::NoPortAfterBracket {
                    text: owned(),
                    inside: inside.to_string(),
                });
            };
            (Host::Ip(IpAddr::V6(v6)), port)
        } else {
            let Some((host, port)) = authority.rsplit_once(':') else {
                return Err(EndpointError::NoPort(owned()));
            };
            if host.contains(':') {
                let v6 = host
                    .parse::<Ipv6Addr>()
                    .map_err(|_| EndpointError::UnbracketedNotV6 {
                        text: owned(),
                        host: host.to_string(),
                    })?;
                (Host::Ip(IpAddr::V6(v6)), port)
            } else if host.is_empty() {
                return Err(EndpointError::NoHost(owned()));
            } else {
                let host = parse_host(host).map_err(|source| EndpointError::Host {
                    text: owned(),
                    source,
                })?;
                (host, port)
            }
        };
        Ok(Endpoint {
            host,
            port: parse_port(text, port)?,
        })
    }

    /// True when the host means "every interface of the node" (`Host::is_wildcard`).
    pub fn is_wildcard(&self) -> bool {
        self.host.is_wildcard()
    }

    /// This endpoint as reached from another node: a wildcard host becomes `node`, the port is
    /// `port + offset`. `None` past 65535.
    pub fn on_node(&self, node: &Host, offset: u32) -> Option<Endpoint> {
        let port = u16::try_from(u32::from(self.port) + offset).ok()?;
        let host = if self.is_wildcard() {
            node.clone()
        } else {
            self.host.clone()
        };
        Some(Endpoint { host, port })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tcp://{}:{}", self.host.in_url(), self.port)
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(text: &str) -> Result<Endpoint, EndpointError> {
        Endpoint::parse(text)
    }
}

/// As its `Display`: `/workers` shows `tcp://host:port`.
impl Serialize for Endpoint {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// A host without brackets: `*`, an IP address, or a name.
fn parse_host(text: &str) -> Result<Host, HostError> {
    if text == "*" {
        return Ok(Host::Any);
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(Host::Ip(ip));
    }
    // One trailing dot is a fully qualified name, the same host.
    let name = text.strip_suffix('.').unwrap_or(text);
    let is_label = |label: &str| {
        (1..=MAX_LABEL_BYTES).contains(&label.len())
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    };
    if text.is_empty() {
        Err(HostError::Empty)
    } else if name.len() > MAX_NAME_BYTES || !name.split('.').all(is_label) {
        Err(HostError::NotAHost(text.to_string()))
    } else {
        Ok(Host::Name(text.to_string()))
    }
}

/// `port`, the decimal port of `endpoint`, 0 included (std would also take `+5557`).
fn parse_port(endpoint: &str, port: &str) -> Result<u16, EndpointError> {
    if port.is_empty() {
        return Err(EndpointError::EmptyPort(endpoint.to_string()));
    }
    port.bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| port.parse::<u16>().ok())
        .flatten()
        .ok_or_else(|| EndpointError::BadPort {
            text: endpoint.to_string(),
            port: port.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn parsed(text: &str) -> Endpoint {
        Endpoint::parse(text).unwrap_or_else(|why| panic!("{why}"))
    }

    #[test]
    fn every_host_form_parses_to_its_field_and_displays_back() {
        let v6 = |text: &str| Host::Ip(text.parse().expect("IPv6"));
        for (text, host, port, shown) in [
            (
                "tcp://10.0.0.5:5557",
                Host::Ip(Ipv4Addr::new(10, 0, 0, 5).into()),
                5557,
                "tcp://10.0.0.5:5557",
            ),
            (
                "tcp://[fd00::5]:5558",
                v6("fd00::5"),
                5558,
                "tcp://[fd00::5]:5558",
            ),
            ("tcp://[FD00:0::5]:1", v6("fd00::5"), 1, "tcp://[fd00::5]:1"),
            ("tcp://:::5557", v6("::"), 5557, "tcp://[::]:5557"),
            ("tcp://fd00::7:80", v6("fd00::7"), 80, "tcp://[fd00::7]:80"),
            (
                "tcp://[::ffff:127.0.0.1]:9",
                v6("::ffff:127.0.0.1"),
                9,
                "tcp://[::ffff:127.0.0.1]:9",
            ),
            (
                "tcp://gpu-1:5557",
                Host::Name("gpu-1".into()),
                5557,
                "tcp://gpu-1:5557",
            ),
            (
                "tcp://GPU_1.lan.:5557",
                Host::Name("GPU_1.lan.".into()),
                5557,
                "tcp://GPU_1.lan.:5557",
            ),
            (
                "tcp://127.1:5558",
                Host::Name("127.1".into()),
                5558,
                "tcp://127.1:5558",
            ),
            (
                "tcp://0x7f.0.0.1:1",
                Host::Name("0x7f.0.0.1".into()),
                1,
                "tcp://0x7f.0.0.1:1",
            ),
            ("tcp://*:0", Host::Any, 0, "tcp://*:0"),
            ("tcp://*:65535", Host::Any, 65535, "tcp://*:65535"),
        ] {
            let endpoint = parsed(text);
            assert_eq!((&endpoint.host, endpoint.port), (&host, port), "{text}");
            assert_eq!(endpoint.to_string(), shown, "{text}");
            assert_eq!(parsed(shown), endpoint, "{shown} parses back");
            assert_eq!(text.parse::<Endpoint>(), Ok(endpoint), "FromStr is parse");
        }
    }

    #[test]
    fn each_refusal_quotes_the_text_and_says_what_is_wrong() {
        for (text, says) in [
            ("127.0.0.1:1", "\"127.0.0.1:1\" is not tcp://host:port"),
            ("ipc:///tmp/kv", "ipc:// and inproc:// cannot be reached"),
            ("inproc://kv", "ipc:// and inproc:// cannot be reached"),
            ("TCP://h:1", "is not tcp://host:port"),
            ("tcp://host", "\"tcp://host\": no port (tcp://host:port)"),
            ("tcp://host:", "no port after the host's colon"),
            ("tcp://host:x", "port \"x\" is not a number 0..=65535"),
            ("tcp://host:+5", "port \"+5\" is not a number"),
            (
                "tcp://host:70000",
                "port \"70000\" is not a number 0..=65535",
            ),
            ("tcp://:5557", "no host before the port"),
            (
                "tcp://bad host:1",
                "host \"bad host\" is neither an IP address nor a host name",
            ),
            ("tcp://-x:1", "neither an IP address nor a host name"),
            ("tcp://a..b:1", "neither an IP address nor a host name"),
            (
                "tcp://a:b:1",
                "\"a:b\" is not an IPv6 address; an IPv6 host goes in brackets",
            ),
            ("tcp://[::1:5557", "no ] closes the IPv6 host"),
            ("tcp://[gpu]:1", "[gpu] is not an IPv6 address"),
            ("tcp://[10.0.0.5]:1", "[10.0.0.5] is not an IPv6 address"),
            ("tcp://[::1]", "no :port after [::1]"),
            ("tcp://[::1]5557", "no :port after [::1]"),
            ("tcp://[fe80::1%eth0]:1", "is not an IPv6 address"),
        ] {
            let why = Endpoint::parse(text).expect_err(text).to_string();
            assert!(why.contains(says), "{text}: {why}");
            assert!(why.contains(&format!("{text:?}")), "{text}: {why}");
        }
        let long = format!("tcp://{}:1", "a".repeat(64));
        assert!(Endpoint::parse(&long).is_err(), "a label of 64 bytes");
        let name = vec!["a".repeat(63); 4].join(".");
        assert!(
            Endpoint::parse(&format!("tcp://{name}:1")).is_err(),
            "255 bytes"
        );
    }

    #[test]
    fn a_host_is_an_address_or_a_name_and_never_the_wildcard() {
        assert_eq!(
            Host::parse("fd00::6"),
            Ok(Host::Ip("fd00::6".parse().expect("v6")))
        );
        assert_eq!(Host::parse("gpu-1"), Ok(Host::Name("gpu-1".into())));
        assert_eq!(
            "10.0.0.5".parse::<Host>().map(|h| h.to_string()),
            Ok("10.0.0.5".into())
        );
        for (text, says) in [
            ("*", "the wildcard host"),
            ("", "the host is empty"),
            ("[::1]", "neither an IP address nor a host name"),
            ("h:1", "neither an IP address nor a host name"),
        ] {
            let why = Host::parse(text).expect_err(text).to_string();
            assert!(why.contains(says), "{text:?}: {why}");
        }
    }

    #[test]
    fn wildcard_hosts_become_the_node_and_others_stay() {
        let node = Host::Name("gpu-1".into());
        let v6_node = Host::Ip("fd00::5".parse().expect("v6"));
        for wildcard in [
            "tcp://*:5557",
            "tcp://0.0.0.0:5557",
            "tcp://[::]:5557",
            "tcp://:::5557",
        ] {
            let endpoint = parsed(wildcard);
            assert!(endpoint.is_wildcard(), "{wildcard}");
            assert_eq!(endpoint.on_node(&node, 1), Some(parsed("tcp://gpu-1:5558")));
            assert_eq!(
                endpoint
                    .on_node(&v6_node, 0)
                    .map(|e| e.to_string())
                    .as_deref(),
                Some("tcp://[fd00::5]:5557")
            );
        }
        let fixed = parsed("tcp://10.0.0.9:41234");
        assert!(!fixed.is_wildcard());
        assert_eq!(fixed.on_node(&node, 0), Some(fixed.clone()));
        assert_eq!(fixed.on_node(&node, 30_000), None, "past 65535");
    }

    #[test]
    fn loopback_hosts_are_the_loopback_addresses_and_localhost() {
        for host in ["127.0.0.1", "::1", "localhost", "LocalHost"] {
            assert!(Host::parse(host).expect(host).is_loopback(), "{host}");
        }
        for host in ["10.0.0.5", "0.0.0.0", "gpu-1", "127.1"] {
            assert!(!Host::parse(host).expect(host).is_loopback(), "{host}");
        }
    }

    #[test]
    fn an_endpoint_serializes_as_its_text() {
        let json = serde_json::to_string(&parsed("tcp://[::1]:5557")).expect("JSON");
        assert_eq!(json, "\"tcp://[::1]:5557\"");
    }
}
