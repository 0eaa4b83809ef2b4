//! An HTTP/1.1 client over a raw `TcpStream` that reads an answer as it comes: the head first,
//! then a chunked or Content-Length body piece by piece, server-sent events one at a time. A
//! connection closed mid-body is an error the test can assert on, not a panic.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// An answer whose head is read and whose body is not (yet).
pub struct Answer {
    reader: BufReader<TcpStream>,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    body: BodyLeft,
    /// Body bytes read and not yet returned as an event.
    pending: Vec<u8>,
}

enum BodyLeft {
    Chunked,
    Length(usize),
    Done,
}

/// Sends `POST path` with a JSON `body` and the extra `headers`, and reads the answer's head.
pub fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Answer {
    send(addr, path, headers, body).unwrap_or_else(|err| panic!("POST {path} to {addr}: {err}"))
}

/// `post`, with an error for a head that does not come (connection refused or closed, timeout).
pub fn send(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Answer> {
    send_timed(addr, path, headers, body, Duration::from_secs(10))
}

/// `send`, waiting at most `timeout` for each read.
pub fn send_timed(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<Answer> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    Answer::read_head(BufReader::new(stream))
}

impl Answer {
    fn read_head(mut reader: BufReader<TcpStream>) -> io::Result<Answer> {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|status| status.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line {line:?}")))?;
        let mut headers = Vec::new();
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            let (name, value) = trimmed
                .split_once(':')
                .ok_or_else(|| io::Error::other(format!("bad header {trimmed:?}")))?;
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        let mut answer = Answer {
            reader,
            status,
            headers,
            body: BodyLeft::Done,
            pending: Vec::new(),
        };
        answer.body = if answer
            .header("Transfer-Encoding")
            .is_some_and(|coding| coding.eq_ignore_ascii_case("chunked"))
        {
            BodyLeft::Chunked
        } else {
            let length = answer.header("Content-Length").map_or(Ok(0), |length| {
                length
                    .parse()
                    .map_err(|_| io::Error::other("bad Content-Length"))
            })?;
            BodyLeft::Length(length)
        };
        Ok(answer)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    pub fn set_read_timeout(&mut self, timeout: Duration) {
        self.reader
            .get_mut()
            .set_read_timeout(Some(timeout))
            .expect("set read timeout");
    }

    /// The next piece of the body as it arrived (a chunk, or what one read returned), `None`
    /// at its end.
    fn next_piece(&mut self) -> io::Result<Option<Vec<u8>>> {
        match self.body {
            BodyLeft::Done => Ok(None),
            BodyLeft::Length(0) => {
                self.body = BodyLeft::Done;
                Ok(None)
            }
            BodyLeft::Length(left) => {
                let mut piece = vec![0; left.min(64 << 10)];
                let read = self.reader.read(&mut piece)?;
                if read == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("connection closed with {left} body bytes to come"),
                    ));
                }
                piece.truncate(read);
                self.body = BodyLeft::Length(left - read);
                Ok(Some(piece))
            }
            BodyLeft::Chunked => {
                let mut line = String::new();
                if self.reader.read_line(&mut line)? == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed before the last chunk",
                    ));
                }
                let size = usize::from_str_radix(line.trim_end(), 16)
                    .map_err(|_| io::Error::other(format!("bad chunk size line {line:?}")))?;
                let mut piece = vec![0; size + 2];
                self.reader.read_exact(&mut piece)?;
                piece.truncate(size);
                if size == 0 {
                    self.body = BodyLeft::Done;
                    return Ok(None);
                }
                Ok(Some(piece))
            }
        }
    }

    /// The next piece of the body as it arrives; empty at its end.
    pub fn read_some(&mut self) -> io::Result<Vec<u8>> {
        if !self.pending.is_empty() {
            return Ok(std::mem::take(&mut self.pending));
        }
        Ok(self.next_piece()?.unwrap_or_default())
    }

    /// The rest of the body.
    pub fn body(&mut self) -> io::Result<Vec<u8>> {
        let mut body = std::mem::take(&mut self.pending);
        while let Some(piece) = self.next_piece()? {
            body.extend_from_slice(&piece);
        }
        Ok(body)
    }

    /// The rest of the body as JSON; panics if it is not whole or not JSON.
    pub fn json(&mut self) -> serde_json::Value {
        let status = self.status;
        let body = self
            .body()
            .unwrap_or_else(|err| panic!("status {status}: reading the body: {err}"));
        serde_json::from_slice(&body).unwrap_or_else(|err| {
            panic!(
                "status {status} body is not JSON ({err}): {}",
                String::from_utf8_lossy(&body)
            )
        })
    }

    /// The data of the next server-sent event (`data: ...`), `None` at the end of the body.
    pub fn next_event(&mut self) -> io::Result<Option<String>> {
        loop {
            if let Some(end) = self.pending.windows(2).position(|pair| pair == b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..end + 2).collect();
                let text = String::from_utf8_lossy(&event[..end]).into_owned();
                let data = text
                    .strip_prefix("data: ")
                    .ok_or_else(|| io::Error::other(format!("not a data event: {text:?}")))?;
                return Ok(Some(data.to_string()));
            }
            match self.next_piece()? {
                Some(piece) => self.pending.extend_from_slice(&piece),
                None if self.pending.is_empty() => return Ok(None),
                None => {
                    return Err(io::Error::other(format!(
                        "the body ends inside an event: {:?}",
                        String::from_utf8_lossy(&self.pending)
                    )))
                }
            }
        }
    }

    /// Every event left, as JSON (`[DONE]` as the string `"[DONE]"`).
    pub fn events(&mut self) -> io::Result<Vec<serde_json::Value>> {
        let mut events = Vec::new();
        while let Some(data) = self.next_event()? {
            events.push(
                serde_json::from_str(&data).unwrap_or(serde_json::Value::String(data.clone())),
            );
        }
        Ok(events)
    }
}
