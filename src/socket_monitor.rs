//! A ZMQ socket with its socket monitor, kept so that the monitor can never stop a ZMQ I/O
//! thread.
//!
//! libzmq sends each monitor event from the I/O thread that saw it (a connect, a handshake, a
//! disconnection), by a *blocking* send on an inproc PAIR. That send waits for as long as the
//! PAIR's queue is full or has no reader, and while it waits the I/O thread serves nothing:
//! every socket of the context stops receiving. Two ways lead there, and this type closes both:
//! - an unread monitor (a rank waiting for a recovery turn while a peer accepts and drops its
//!   connections, a monitor read late): the reader's queue has no limit (RCVHWM 0). An event is
//!   a few dozen bytes, a few per connection change, and every holder reads them as they come;
//! - a reader closed while its socket can still report (the socket is closed after its reader,
//!   or lives on in libzmq's reaper while a connect completes): dropping a `Monitored` first
//!   turns the monitor's events off, then closes the socket, then the reader (libzmq issue
//!   #3575 describes this hang; its remedy, `zmq_socket_monitor(socket, NULL, 0)`, is what
//!   `Drop` does by the zmq crate's safe API).
//!
//! What either looks like: every rank of a context stops advancing, with a ZMQ I/O thread
//! blocked in `zmq_msg_send` on a monitor. `examples/soak` churns connections long enough to
//! show it.
//!
//! Owns: the socket, its monitor's reader, the order they are closed in. Never: closes the
//! reader while the monitor may still send, or waits for an event.

use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context as _;

/// A socket and the reader of its monitor.
pub struct Monitored {
    /// Declared before `reader`: fields drop in order, after `Drop::drop` turned events off.
    socket: zmq::Socket,
    reader: zmq::Socket,
    /// The monitor's inproc endpoint (unique in the process).
    endpoint: String,
}

impl Monitored {
    /// Watches `socket` for `events`; call it before the socket binds or connects, or its first
    /// events are missed. `name` only makes the monitor's endpoint readable in a debugger.
    pub fn attach(
        context: &zmq::Context,
        socket: zmq::Socket,
        events: &[zmq::SocketEvent],
        name: &str,
    ) -> anyhow::Result<Monitored> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let endpoint = format!(
            "inproc://kv-indexer-monitor-{name}-{}-{}",
            std::process::id(),
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        );
        let mask = events.iter().fold(0, |mask, event| mask | event.to_raw());
        socket
            .monitor(&endpoint, mask.into())
            .context("attaching the socket monitor")?;
        let reader = context
            .socket(zmq::PAIR)
            .context("creating the monitor's reader")?;
        reader
            .set_linger(0)
            .context("setting the monitor's LINGER")?;
        // 0: no limit. With a limit, a full queue blocks the I/O thread (the module's doc).
        reader
            .set_rcvhwm(0)
            .context("setting the monitor's RCVHWM")?;
        reader
            .connect(&endpoint)
            .context("connecting the monitor's reader")?;
        Ok(Monitored {
            socket,
            reader,
            endpoint,
        })
    }

    /// The watched socket.
    pub fn socket(&self) -> &zmq::Socket {
        &self.socket
    }

    /// The monitor's reader: for its `ZMQ_FD`, `ZMQ_EVENTS` or `poll`.
    pub fn reader(&self) -> &zmq::Socket {
        &self.reader
    }

    /// The next event waiting (libzmq's raw event id), `None` when none is: never waits.
    pub fn next_event(&self) -> anyhow::Result<Option<u16>> {
        loop {
            let frames = match self.reader.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => return Ok(None),
                Err(error) => return Err(error).context("reading the socket monitor"),
            };
            // Frame 0: u16 event id (native order), u32 value; frame 1: the endpoint.
            let event = frames
                .first()
                .and_then(|frame| frame.get(..2))
                .and_then(|id| <[u8; 2]>::try_from(id).ok())
                .map(u16::from_ne_bytes);
            if event.is_some() {
                return Ok(event);
            }
        }
    }
}

impl Drop for Monitored {
    /// Turns the monitor's events off before the sockets close. The zmq crate has no way to pass
    /// libzmq's NULL endpoint (its own "stop monitoring"); attaching a monitor with no events
    /// does the same: libzmq closes the first monitor, and the second sends nothing.
    fn drop(&mut self) {
        if let Err(error) = self.turn_off() {
            // ETERM: the context is gone, and its I/O threads with it.
            tracing::debug!("stopping the socket monitor {}: {error}", self.endpoint);
        }
    }
}

impl Monitored {
    fn turn_off(&self) -> zmq::Result<()> {
        self.socket
            .monitor(&format!("{}-stopped", self.endpoint), 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    /// Whether a message from a PUB to a SUB, both on `context` over loopback TCP, arrives
    /// within 5 s: the context's (one) I/O thread is serving.
    fn io_thread_serves(context: &zmq::Context) -> bool {
        let publisher = context.socket(zmq::PUB).expect("PUB");
        publisher.set_linger(0).expect("LINGER");
        publisher.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = publisher
            .get_last_endpoint()
            .expect("endpoint")
            .expect("utf-8");
        let subscriber = context.socket(zmq::SUB).expect("SUB");
        subscriber.set_linger(0).expect("LINGER");
        subscriber.set_subscribe(b"").expect("subscribe");
        subscriber.connect(&endpoint).expect("connect");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            // PUB/SUB drops what is sent before the subscription arrives: send until one lands.
            publisher.send("ping", zmq::DONTWAIT).expect("send");
            if subscriber.poll(zmq::POLLIN, 50).expect("poll") > 0 {
                return true;
            }
        }
        false
    }

    /// A loopback TCP port that accepts every connection and closes it at once, counting them.
    fn accepting_port() -> (String, std::sync::Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = format!("tcp://{}", listener.local_addr().expect("address"));
        let accepted = std::sync::Arc::new(AtomicU64::new(0));
        let counter = std::sync::Arc::clone(&accepted);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                drop(stream);
                counter.fetch_add(1, Ordering::Relaxed);
            }
        });
        (endpoint, accepted)
    }

    fn monitored_sub(context: &zmq::Context) -> Monitored {
        let sub = context.socket(zmq::SUB).expect("SUB");
        sub.set_linger(0).expect("LINGER");
        Monitored::attach(context, sub, &[zmq::SocketEvent::CONNECTED], "test").expect("attach")
    }

    /// Connects and disconnects `socket` `times` times, each connect reported to its monitor.
    fn reconnect(socket: &zmq::Socket, endpoint: &str, times: u64, accepted: &AtomicU64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        for n in 1..=times {
            socket.connect(endpoint).expect("connect");
            // Each connect waits for its accept: the I/O thread made it and sent its event.
            while accepted.load(Ordering::Relaxed) < n && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
            socket.disconnect(endpoint).expect("disconnect");
        }
    }

    #[test]
    fn an_unread_monitor_never_stops_the_io_thread() {
        let context = zmq::Context::new();
        let monitored = monitored_sub(&context);
        let (endpoint, accepted) = accepting_port();
        // Well past libzmq's default queue of 1,000 + 1,000 events, none read.
        reconnect(monitored.socket(), &endpoint, 3_000, &accepted);
        assert_eq!(accepted.load(Ordering::Relaxed), 3_000);
        assert!(io_thread_serves(&context));
        let mut events = 0;
        while monitored.next_event().expect("event").is_some() {
            events += 1;
        }
        // A connect the disconnect overtakes (accepted by the kernel, not yet seen by ZMQ) is
        // not reported: not every one of the 3,000.
        assert!(events > 2_000, "{events} connects reported, queued unread");
    }

    #[test]
    fn a_closed_reader_never_stops_the_io_thread() {
        let context = zmq::Context::new();
        let mut monitored = monitored_sub(&context);
        let (endpoint, accepted) = accepting_port();
        // What `drop` does first, then the reader closed while the socket lives on and
        // connects (as it may in libzmq's reaper after `zmq_close`).
        monitored.turn_off().expect("stop");
        let spare = context.socket(zmq::PAIR).expect("PAIR");
        drop(std::mem::replace(&mut monitored.reader, spare));
        reconnect(monitored.socket(), &endpoint, 3, &accepted);
        assert_eq!(accepted.load(Ordering::Relaxed), 3);
        assert!(io_thread_serves(&context));
    }
}
