//! A minimal HTTP/1.1 client over a raw `TcpStream` for the integration tests: keep-alive,
//! Content-Length bodies (the API never answers chunked), bounded by a read timeout.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|err| {
            panic!(
                "status {} body is not JSON ({err}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One keep-alive connection.
pub struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    pub fn open(addr: SocketAddr) -> Connection {
        let stream = TcpStream::connect(addr).unwrap_or_else(|err| panic!("connect {addr}: {err}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("set read timeout");
        stream.set_nodelay(true).expect("set TCP_NODELAY");
        Connection {
            reader: BufReader::new(stream),
        }
    }

    /// Writes raw bytes (a hand-made request head or body part).
    pub fn write_raw(&mut self, bytes: &[u8]) {
        self.reader
            .get_mut()
            .write_all(bytes)
            .expect("write request");
    }

    pub fn set_read_timeout(&mut self, timeout: Duration) {
        self.reader
            .get_mut()
            .set_read_timeout(Some(timeout))
            .expect("set read timeout");
    }

    pub fn send(&mut self, method: &str, path: &str, body: Option<&[u8]>) -> Reply {
        self.send_with(method, path, &[("Content-Type", "application/json")], body)
    }

    /// `send` with the given headers (and no `Content-Type` unless among them).
    pub fn send_with(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Reply {
        let body = body.unwrap_or_default();
        let headers: String = headers
            .iter()
            .map(|(name, value)| format!("{name}: {value}\r\n"))
            .collect();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: test\r\n{headers}Content-Length: {}\r\n\r\n",
            body.len()
        );
        let mut request = head.into_bytes();
        request.extend_from_slice(body);
        self.write_raw(&request);
        self.read_reply()
    }

    /// Whether the server closed (or reset) the connection, waiting up to the read timeout.
    pub fn closed_by_peer(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.reader.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(err) => err.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }

    pub fn read_reply(&mut self) -> Reply {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("read status line");
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {line:?}"));
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("read header");
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            let (name, value) = trimmed.split_once(':').expect("header has a colon");
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        let length: usize = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("Content-Length"))
            .map_or(0, |(_, v)| v.parse().expect("numeric Content-Length"));
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).expect("read body");
        Reply {
            status,
            headers,
            body,
        }
    }
}

pub fn get(addr: SocketAddr, path: &str) -> Reply {
    Connection::open(addr).send("GET", path, None)
}

pub fn post(addr: SocketAddr, path: &str, body: &[u8]) -> Reply {
    Connection::open(addr).send("POST", path, Some(body))
}

/// The value of `series` (a metric name with its labels as rendered, `name{a="x"}`) on the
/// server's `/metrics`; `None` when it is not there.
pub fn metric_value(addr: SocketAddr, series: &str) -> Option<f64> {
    series_value(&get(addr, "/metrics").text(), series)
}

/// The value of one series (name and labels as rendered) in a scrape's text.
pub fn series_value(scrape: &str, series: &str) -> Option<f64> {
    let wanted = format!("{series} ");
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(&wanted))
        .map(|n| n.trim().parse().expect("a metric value"))
}

/// The sum of the series of metric `name` whose labels include each of `labels` (as rendered,
/// `instance="a"`); 0 when there is none.
pub fn metric_sum(addr: SocketAddr, name: &str, labels: &[&str]) -> f64 {
    let prefix = format!("{name}{{");
    get(addr, "/metrics")
        .text()
        .lines()
        .filter(|line| line.starts_with(&prefix))
        .filter(|line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The server's `kv_indexer_http_errors_total{status}` counter (0 before the first such error).
pub fn errors_with_status(addr: SocketAddr, status: u16) -> u64 {
    let series = format!("kv_indexer_http_errors_total{{status=\"{status}\"}}");
    metric_value(addr, &series).map_or(0, |n| n as u64)
}

/// Polls `probe` for `duration`, failing the first time it is false: for a state that must not
/// change, which has no event to wait for.
pub fn holds_for(duration: Duration, what: &str, mut probe: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + duration;
    while std::time::Instant::now() < deadline {
        assert!(probe(), "{what} stopped holding");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `probe` until it returns `Some`, failing after `seconds`.
pub fn wait_for<T>(seconds: u64, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(seconds);
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {seconds}s waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
