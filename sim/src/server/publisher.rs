//! A rank's PUB socket and who is subscribed to it, as far as the engine can know: the ZMTP
//! handshakes its monitor reported, less the disconnections. A subscriber whose handshake succeeded sends
//! its subscription next, so this is the condition a test waits on before publishing to engines
//! that cannot replay (a first batch lost to the PUB/SUB slow joiner would be lost for good),
//! instead of sleeping.
//!
//! Owns the PUB socket and its monitor (`kv_indexer::socket_monitor`, which keeps libzmq from
//! blocking the PUB's I/O on it). Never: waits for an event (they are read when asked, and at
//! every batch the rank publishes), or publishes (the rank does, on `socket`).

use anyhow::Result;
use kv_indexer::socket_monitor::Monitored;

/// The PUB socket and what its monitor said.
pub(super) struct Publisher {
    socket: Monitored,
    count: usize,
}

impl Publisher {
    /// Attaches a monitor to `publisher` (before it binds).
    pub(super) fn watch(context: &zmq::Context, publisher: zmq::Socket) -> Result<Publisher> {
        let events = [
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
            zmq::SocketEvent::DISCONNECTED,
        ];
        let socket = Monitored::attach(context, publisher, &events, "sim-publisher")?;
        Ok(Publisher { socket, count: 0 })
    }

    /// The PUB socket.
    pub(super) fn socket(&self) -> &zmq::Socket {
        self.socket.socket()
    }

    /// Subscribers handshaken and not disconnected, reading the events that came meanwhile.
    pub(super) fn subscribers(&mut self) -> Result<usize> {
        while let Some(event) = self.socket.next_event()? {
            if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                self.count += 1;
            } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                self.count = self.count.saturating_sub(1);
            }
        }
        Ok(self.count)
    }
}
