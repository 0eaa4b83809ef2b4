//! Binding a simulated engine's sockets: a ZeroMQ socket or a tiny_http server on `base + rank`
//! (any free port when `base` is 0) on an IPv4 host, `*` or an IPv6 literal, and the address
//! forms of such a host (to listen on, and to reach it at).
//!
//! Owns the address forms and the options a socket must have before `bind`. Never: connects, or
//! picks a port itself (the OS does, for 0).

use anyhow::{anyhow, Context, Result};

/// `base + rank`, or an error naming both when that is past 65535.
pub(super) fn offset_port(base: u16, rank: u32) -> Result<u16> {
    u16::try_from(u32::from(base) + rank)
        .map_err(|_| anyhow!("port {base} + rank {rank} is above 65535"))
}

/// Binds a socket on `base + rank` (any free port when `base` is 0) and returns the bound port.
pub(super) fn bind_zmq(
    context: &zmq::Context,
    kind: zmq::SocketType,
    bind: &str,
    base: u16,
    rank: u32,
) -> Result<(zmq::Socket, u16)> {
    let socket = context.socket(kind).context("creating the socket")?;
    socket.set_linger(0).context("setting linger")?;
    if kind == zmq::PUB {
        // As vLLM's publisher (`hwm` 100,000 per subscriber), not ZeroMQ's default 1,000, so
        // that a paused subscriber loses no sooner here. Before `bind`: a bound socket's
        // connections take the options it had when it was bound.
        socket
            .set_sndhwm(100_000)
            .context("setting the send high-water mark")?;
    }
    let ipv6 = bind.contains(':');
    socket.set_ipv6(ipv6).context("enabling IPv6")?;
    let host = if ipv6 {
        format!("[{bind}]")
    } else {
        bind.to_string()
    };
    let port = if base == 0 {
        "*".to_string()
    } else {
        offset_port(base, rank)?.to_string()
    };
    let endpoint = format!("tcp://{host}:{port}");
    socket
        .bind(&endpoint)
        .with_context(|| format!("binding {endpoint}"))?;
    let bound = socket
        .get_last_endpoint()
        .context("reading the bound endpoint")?
        .map_err(|raw| anyhow!("bound endpoint is not UTF-8: {raw:?}"))?;
    let port = bound
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .with_context(|| format!("no port in bound endpoint {bound}"))?;
    Ok((socket, port))
}

/// `bind:port` as a socket address to listen on: `*` is every IPv4 interface, an IPv6 literal
/// gets its brackets.
pub(crate) fn listen_address(bind: &str, port: u16) -> String {
    if bind == "*" {
        format!("0.0.0.0:{port}")
    } else if bind.contains(':') {
        format!("[{bind}]:{port}")
    } else {
        format!("{bind}:{port}")
    }
}

/// The host a client on this node reaches `bind` at: 127.0.0.1 for `*`, an IPv6 literal in
/// brackets.
pub(crate) fn url_host(bind: &str) -> String {
    match bind {
        "*" => "127.0.0.1".to_string(),
        ip if ip.contains(':') => format!("[{ip}]"),
        ip => ip.to_string(),
    }
}

/// A tiny_http server on `bind:port` (0: picked by the OS) and the port it bound.
pub(crate) fn bind_http(bind: &str, port: u16) -> Result<(tiny_http::Server, u16)> {
    let address = listen_address(bind, port);
    let server = tiny_http::Server::http(address.as_str())
        .map_err(|e| anyhow!("binding HTTP on {address}: {e}"))?;
    let port = server
        .server_addr()
        .to_ip()
        .map(|address| address.port())
        .with_context(|| format!("HTTP server on {address} has no IP port"))?;
    Ok((server, port))
}
