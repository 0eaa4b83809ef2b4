//! Receiving a multipart ZMQ message without allocating: the frames are kept from one message
//! to the next. It never interprets a frame.

use anyhow::Context as _;

/// The frames of one multipart message, received in place into ZMQ messages kept from one
/// message to the next: receiving allocates and copies nothing of its own.
#[derive(Default)]
pub(super) struct Frames {
    frames: Vec<zmq::Message>,
    received: usize,
}

impl Frames {
    /// Receives one message if one is waiting; `false` when none is.
    pub(super) fn receive(&mut self, socket: &zmq::Socket) -> anyhow::Result<bool> {
        self.received = 0;
        loop {
            if self.received == self.frames.len() {
                self.frames.push(zmq::Message::new());
            }
            // Pushed above when missing.
            let frame = &mut self.frames[self.received];
            // ZMQ delivers a multipart message whole: only its first frame can be missing.
            let flags = if self.received == 0 { zmq::DONTWAIT } else { 0 };
            match socket.recv(frame, flags) {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN) if self.received == 0 => return Ok(false),
                Err(error) => return Err(error).context("receiving"),
            }
            self.received += 1;
            if !frame.get_more() {
                return Ok(true);
            }
        }
    }

    /// The frames of the last message received.
    pub(super) fn as_slice(&self) -> &[zmq::Message] {
        self.frames.get(..self.received).unwrap_or_default()
    }
}
