//! Endpoint policy: which `tcp://host:port` endpoints from outside the file (a discovery
//! answer, a `POST /register`) a SUB or replay DEALER socket may be aimed at (docs.md
//! "Endpoints from outside the file").
//!
//! Owns: turning an endpoint's host (already parsed: `crate::endpoint`) into the addresses a
//! connect would reach (inet_aton spellings such as `127.0.0.01` and `127.1`, IPv4-mapped IPv6,
//! `localhost`, and other names through the system resolver), and the rules on them: the same address and port at most once
//! per answer or registration, never one of the indexer's own listen addresses, a loopback (or
//! unspecified) address only from an origin that is itself loopback, and an address on another
//! host than the origin accepted but logged once. Every refusal names the endpoint and says why.
//! Never: opens a connection (the local-address test binds a UDP socket to port 0 and drops
//! it), counts (the caller counts each refusal by its `reason`), or compares endpoints as text.

use std::collections::HashSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use parking_lot::Mutex;
use tracing::info;

use crate::endpoint::{Endpoint, Host};
pub use crate::metrics::EndpointRefusal as Reason;

/// One endpoint refused, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub endpoint: Endpoint,
    pub reason: Reason,
    pub detail: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "endpoint {}: {}", self.endpoint, self.detail)
    }
}

/// The rules, with the indexer's own listen addresses; one is shared by discovery and the
/// Dynamo API.
pub struct EndpointPolicy {
    own: Vec<SocketAddr>,
    /// (who, address) pairs already logged as on another host than their origin.
    logged_foreign: Mutex<HashSet<(String, IpAddr)>>,
}

impl EndpointPolicy {
    /// `own`: every address the indexer listens on (its HTTP API, the Dynamo API).
    pub fn new(own: Vec<SocketAddr>) -> EndpointPolicy {
        EndpointPolicy {
            own,
            logged_foreign: Mutex::new(HashSet::new()),
        }
    }

    /// Checks the endpoints of one discovery answer or registration, announced by `who` (for
    /// the log) from `origin` (the engine's `host`, else its `discover` URL's host; for a
    /// registration, the address it came from). Every endpoint refused is in the error, in
    /// order.
    pub fn check<'a>(
        &self,
        who: &str,
        origin: &Host,
        endpoints: impl IntoIterator<Item = &'a Endpoint>,
    ) -> Result<(), Vec<Refusal>> {
        // An origin that does not resolve is on no host we know: nothing it names is its own
        // node, and it is not loopback.
        let origin_addresses = addresses(origin).unwrap_or_default();
        let origin_is_loopback = origin_addresses.iter().copied().any(is_local_only);
        let mut seen = HashSet::new();
        let mut refusals = Vec::new();
        for endpoint in endpoints {
            let refuse = |reason: Reason, detail: String| Refusal {
                endpoint: endpoint.clone(),
                reason,
                detail,
            };
            let port = endpoint.port;
            let found = match addresses(&endpoint.host) {
                Ok(found) => found,
                Err(why) => {
                    refusals.push(refuse(
                        Reason::Unresolvable,
                        format!("{why}: kv-indexer connects only to addresses it can check"),
                    ));
                    continue;
                }
            };
            let refusal = if let Some(own) = found.iter().find_map(|&ip| self.own_address(ip, port))
            {
                Some(refuse(
                    Reason::OwnAddress,
                    format!(
                        "is this indexer's own listen address {own}: a socket aimed there would \
                         hold a connection to our own API"
                    ),
                ))
            } else if let Some(twice) = found
                .iter()
                .map(|&ip| SocketAddr::new(ip, port))
                .find(|address| seen.contains(address))
            {
                Some(refuse(
                    Reason::Duplicate,
                    format!("{twice} is named twice: each rank publishes on its own port"),
                ))
            } else if !origin_is_loopback && found.iter().copied().any(is_local_only) {
                Some(refuse(
                    Reason::Loopback,
                    format!(
                        "is a loopback address, but it comes from {origin}, which is not: only \
                         an engine on loopback may announce loopback endpoints"
                    ),
                ))
            } else {
                None
            };
            match refusal {
                Some(refusal) => refusals.push(refusal),
                None => {
                    seen.extend(found.iter().map(|&ip| SocketAddr::new(ip, port)));
                    if !found.iter().any(|ip| origin_addresses.contains(ip)) {
                        self.log_foreign(who, origin, endpoint, &found);
                    }
                }
            }
        }
        if refusals.is_empty() {
            Ok(())
        } else {
            Err(refusals)
        }
    }

    /// The own listen address `ip:port` would reach, if any: a listener on an unspecified
    /// address is reached on every address of this host.
    fn own_address(&self, ip: IpAddr, port: u16) -> Option<SocketAddr> {
        self.own.iter().copied().find(|own| {
            own.port() == port
                && (canonical(own.ip()) == ip
                    || (own.ip().is_unspecified() && (is_local_only(ip) || is_this_host(ip))))
        })
    }

    /// Multi-node data parallel lists other nodes' ranks: accepted, said once per address.
    fn log_foreign(&self, who: &str, origin: &Host, endpoint: &Endpoint, found: &[IpAddr]) {
        let Some(&first) = found.first() else { return };
        if self.logged_foreign.lock().insert((who.to_string(), first)) {
            info!(
                "{who}: endpoint {endpoint} is on another host than {origin}: accepted \
                 (multi-node data parallel lists other nodes' ranks)"
            );
        }
    }
}

/// Loopback, or unspecified (a connect to `0.0.0.0` or `::` reaches this host).
fn is_local_only(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified()
}

/// Whether `ip` is an address of one of this host's interfaces: only those can be bound.
fn is_this_host(ip: IpAddr) -> bool {
    UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// IPv4-mapped IPv6 addresses as the IPv4 address they reach.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Why the addresses a host name reaches cannot be known.
#[derive(Debug, thiserror::Error)]
enum Unresolvable {
    #[error("host {host:?} does not resolve ({source})")]
    Fails {
        host: String,
        source: std::io::Error,
    },
    #[error("host {0:?} resolves to no address")]
    NoAddress(String),
}

/// The addresses a connect to `host` reaches: an address's own (the wildcard's are the
/// unspecified ones), `localhost`'s two, a name `inet_aton` reads as an IPv4 address, or what
/// the system resolver answers for another name.
fn addresses(host: &Host) -> Result<Vec<IpAddr>, Unresolvable> {
    let host = match host {
        Host::Any => {
            return Ok(vec![
                IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            ])
        }
        Host::Ip(ip) => return Ok(vec![canonical(*ip)]),
        Host::Name(name) => name.as_str(),
    };
    let name = host.trim_end_matches('.').to_ascii_lowercase();
    if name == "localhost" || name.ends_with(".localhost") {
        return Ok(vec![
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
        ]);
    }
    if let Some(v4) = inet_aton(host) {
        return Ok(vec![IpAddr::V4(v4)]);
    }
    let resolved: Vec<IpAddr> = (host, 0)
        .to_socket_addrs()
        .map_err(|source| Unresolvable::Fails {
            host: host.to_string(),
            source,
        })?
        .map(|address| canonical(address.ip()))
        .collect();
    if resolved.is_empty() {
        return Err(Unresolvable::NoAddress(host.to_string()));
    }
    Ok(resolved)
}

/// An IPv4 address as `inet_aton(3)` (and so `getaddrinfo`, which ZMQ's connect uses) reads
/// it: one to four parts, each decimal, octal (leading `0`) or hex (`0x`), the last filling
/// the remaining bytes: `127.1`, `127.0.0.01`, `0x7f.1` and `2130706433` are all 127.0.0.1.
fn inet_aton(text: &str) -> Option<Ipv4Addr> {
    let parts: Vec<u32> = text
        .split('.')
        .map(|part| {
            let (digits, radix) =
                if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
                    (hex, 16)
                } else if part.len() > 1 && part.starts_with('0') {
                    (&part[1..], 8)
                } else {
                    (part, 10)
                };
            if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
                return None;
            }
            u32::from_str_radix(digits, radix).ok()
        })
        .collect::<Option<_>>()?;
    let (&last, leading) = parts.split_last()?;
    if leading.len() > 3 || leading.iter().any(|&part| part > 0xFF) {
        return None;
    }
    let last_bits = 8 * (4 - leading.len() as u32);
    if last_bits < 32 && last >> last_bits != 0 {
        return None;
    }
    let high = leading
        .iter()
        .fold(0u32, |address, &part| (address << 8) | part)
        .checked_shl(last_bits)
        .unwrap_or(0);
    Some(Ipv4Addr::from(high | last))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `policy.check` of `endpoints` (each parsed) from `origin`, announced by engine `e`.
    fn check(
        policy: &EndpointPolicy,
        origin: &str,
        endpoints: &[&str],
    ) -> Result<(), Vec<Refusal>> {
        let parsed: Vec<Endpoint> = endpoints
            .iter()
            .map(|text| Endpoint::parse(text).expect("an endpoint"))
            .collect();
        let origin = Host::parse(origin).expect("a host");
        policy.check("engine e", &origin, &parsed)
    }

    fn host(text: &str) -> Host {
        Host::parse(text).expect("a host")
    }

    #[test]
    fn inet_aton_spellings_are_one_address() {
        for spelling in [
            "127.0.0.1",
            "127.0.0.01",
            "127.0.0.001",
            "127.1",
            "127.0.1",
            "0x7f.1",
            "0177.0.0.1",
            "2130706433",
        ] {
            assert_eq!(inet_aton(spelling), Some(Ipv4Addr::LOCALHOST), "{spelling}");
        }
        assert_eq!(inet_aton("127.0.0.010"), Some(Ipv4Addr::new(127, 0, 0, 8)));
        for not_an_address in [
            "gpu-1",
            "127.0.0.256",
            "1.2.3.4.5",
            "",
            "127..1",
            "08.1",
            "1.0x",
        ] {
            assert_eq!(inet_aton(not_an_address), None, "{not_an_address}");
        }
    }

    #[test]
    fn loopback_spellings_meet_and_mapped_addresses_are_ipv4() {
        let local = addresses(&host("localhost")).expect("localhost");
        assert!(local.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)));
        assert_eq!(
            addresses(&host("::ffff:127.0.0.1")).expect("mapped"),
            vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]
        );
        let policy = EndpointPolicy::new(Vec::new());
        let refused = check(
            &policy,
            "127.0.0.1",
            &[
                "tcp://127.0.0.1:5557",
                "tcp://localhost:5557",
                "tcp://127.1:5558",
            ],
        )
        .expect_err("the same address twice");
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].reason, Reason::Duplicate);
        assert!(refused[0].to_string().contains("tcp://localhost:5557"));
    }

    #[test]
    fn own_addresses_are_refused_in_every_spelling() {
        let own = SocketAddr::from(([127, 0, 0, 1], 8090));
        let policy = EndpointPolicy::new(vec![own]);
        let endpoints = [
            "tcp://127.0.0.01:8090",
            "tcp://127.1:8090",
            "tcp://localhost:8090",
        ];
        let refused = check(&policy, "localhost", &endpoints).expect_err("our own port");
        assert_eq!(refused.len(), 3);
        assert!(refused.iter().all(|r| r.reason == Reason::OwnAddress));
        let any = EndpointPolicy::new(vec![SocketAddr::from(([0, 0, 0, 0], 8090))]);
        let refused = check(&any, "127.0.0.1", &["tcp://127.0.0.2:8090", "tcp://0:8090"])
            .expect_err("a wildcard listener is on every local address");
        assert_eq!(refused.len(), 2);
        assert!(check(&policy, "127.0.0.1", &["tcp://127.0.0.1:8091"]).is_ok());
    }

    #[test]
    fn loopback_only_from_loopback_and_other_hosts_are_accepted() {
        let policy = EndpointPolicy::new(Vec::new());
        let refused = check(
            &policy,
            "10.0.0.5",
            &["tcp://10.0.0.5:5557", "tcp://127.1:5558"],
        )
        .expect_err("loopback from a remote engine");
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].reason, Reason::Loopback);
        assert!(check(
            &policy,
            "10.0.0.5",
            &["tcp://10.0.0.6:5557", "tcp://[fd00::7]:5557"]
        )
        .is_ok());
        let refused = check(
            &policy,
            "10.0.0.5",
            &["tcp://no-such-host.invalid:1", "tcp://*:5557"],
        )
        .expect_err("a name that does not resolve, a wildcard that reaches this host");
        let reasons: Vec<Reason> = refused.iter().map(|r| r.reason).collect();
        assert_eq!(reasons, [Reason::Unresolvable, Reason::Loopback]);
    }
}
