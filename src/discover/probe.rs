//! The neighbour-port probe: with static ports, a publisher answering on the port the next
//! rank would use means `dp_size` is too small, which would silently leave a rank unindexed.
//!
//! Owns: one short-lived SUB socket per probe, subscribed to nothing, that only waits for the
//! ZMTP handshake. Never: receives or indexes a message, or keeps a socket past the probe.

use std::time::{Duration, Instant};

use anyhow::Context;

use crate::socket_monitor::Monitored;

/// The port rank `dp_rank_start + dp_size` would publish on (rank r on `zmq_port + r`, as
/// `plan` expands it), or `None` past 65535.
pub fn neighbour_port(zmq_port: u16, dp_rank_start: u32, dp_size: u32) -> Option<u16> {
    let port = u64::from(zmq_port) + u64::from(dp_rank_start) + u64::from(dp_size);
    u16::try_from(port).ok()
}

/// The warning for an engine whose neighbour port answers.
pub fn neighbour_warning(engine: &str, port: u16, dp_size: u32) -> String {
    format!(
        "engine {engine}: a publisher answers on {port}; set dp_size = {} or use discover",
        u64::from(dp_size) + 1
    )
}

/// True when a ZMQ publisher (PUB or XPUB) completes a handshake on `endpoint` within `wait`.
///
/// A SUB's handshake succeeds only with a PUB or XPUB peer (ZMTP checks the socket types), so
/// an engine's replay ROUTER or any other TCP server does not count. Returns early, false, when
/// the connection is refused, the handshake fails or the peer hangs up; a silent peer costs the
/// whole `wait`.
/// Errors only when the sockets cannot be made (the context is out of sockets, say).
pub fn publisher_answers(
    zmq: &zmq::Context,
    endpoint: &str,
    wait: Duration,
) -> anyhow::Result<bool> {
    let sub = zmq
        .socket(zmq::SUB)
        .context("creating the probe's SUB socket")?;
    sub.set_linger(0).context("setting LINGER")?;
    let events = [
        zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
        zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL,
        zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL,
        zmq::SocketEvent::HANDSHAKE_FAILED_AUTH,
        zmq::SocketEvent::CONNECT_RETRIED,
        // What a peer of the wrong socket type gets (libzmq 4.3 reports no handshake failure
        // for it): connected, then dropped.
        zmq::SocketEvent::DISCONNECTED,
    ];
    let probe = Monitored::attach(zmq, sub, &events, "probe").context("the probe's monitor")?;
    probe
        .socket()
        .connect(endpoint)
        .with_context(|| format!("probing {endpoint}"))?;

    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let timeout_ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX).max(1);
        if probe
            .reader()
            .poll(zmq::POLLIN, timeout_ms)
            .context("polling the probe's monitor")?
            == 0
        {
            continue;
        }
        match probe.next_event()? {
            Some(id) if id == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() => return Ok(true),
            Some(_) => return Ok(false),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_neighbour_is_one_past_the_last_rank_of_this_engine() {
        assert_eq!(neighbour_port(5557, 0, 1), Some(5558));
        assert_eq!(neighbour_port(5557, 2, 2), Some(5561));
        assert_eq!(neighbour_port(65535, 0, 1), None);
        assert_eq!(
            neighbour_warning("vllm-a", 5558, 1),
            "engine vllm-a: a publisher answers on 5558; set dp_size = 2 or use discover"
        );
    }
}
