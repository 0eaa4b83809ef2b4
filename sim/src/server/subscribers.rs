//! Who is subscribed to a rank's PUB socket, as far as the engine can know: the ZMTP handshakes
//! its monitor reported, less the disconnections. A subscriber whose handshake succeeded sends
//! its subscription next, so this is the condition a test waits on before publishing to engines
//! that cannot replay (a first batch lost to the PUB/SUB slow joiner would be lost for good),
//! instead of sleeping.
//!
//! Owns the PUB socket's monitor. Never: blocks (events are read when asked, and at every
//! batch the rank publishes: libzmq stops the PUB's I/O when its monitor's queue is full), or
//! publishes.

use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};

pub(super) struct Subscribers {
    monitor: zmq::Socket,
    count: usize,
}

impl Subscribers {
    /// Attaches a monitor to `publisher` (before anything connects to it).
    pub(super) fn watch(context: &zmq::Context, publisher: &zmq::Socket) -> Result<Subscribers> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let endpoint = format!(
            "inproc://sim-subscribers-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let events = zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw()
            | zmq::SocketEvent::DISCONNECTED.to_raw();
        publisher
            .monitor(&endpoint, events.into())
            .context("attaching the PUB socket's monitor")?;
        let monitor = context
            .socket(zmq::PAIR)
            .context("creating the monitor socket")?;
        monitor
            .connect(&endpoint)
            .context("connecting the monitor socket")?;
        Ok(Subscribers { monitor, count: 0 })
    }

    /// Subscribers handshaken and not disconnected, reading the events that came meanwhile.
    pub(super) fn count(&mut self) -> Result<usize> {
        loop {
            let frames = match self.monitor.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => return Ok(self.count),
                Err(error) => return Err(error).context("reading the PUB socket's monitor"),
            };
            let event = frames
                .first()
                .and_then(|frame| frame.get(..2))
                .and_then(|id| <[u8; 2]>::try_from(id).ok())
                .map(u16::from_ne_bytes);
            if event == Some(zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw()) {
                self.count += 1;
            } else if event == Some(zmq::SocketEvent::DISCONNECTED.to_raw()) {
                self.count = self.count.saturating_sub(1);
            }
        }
    }
}
