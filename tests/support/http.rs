//! A minimal HTTP/1.1 client over one keep-alive connection, enough to talk to the indexer's
//! tiny_http API from tests and benchmarks without a client library.
//!
//! It only understands responses with a `Content-Length` (all of tiny_http's fixed-size bodies);
//! anything else is an error, never a panic.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

/// Keeps one connection open and reconnects once when the server closed it.
pub struct HttpClient {
    address: SocketAddr,
    timeout: Duration,
    connection: Option<BufReader<TcpStream>>,
}

impl HttpClient {
    pub fn new(address: SocketAddr, timeout: Duration) -> HttpClient {
        HttpClient {
            address,
            timeout,
            connection: None,
        }
    }

    /// Sends one request and returns (status, body).
    pub fn request(&mut self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>)> {
        // A kept-alive connection the server has since closed fails on first use: retry once.
        let reused = self.connection.is_some();
        match self.exchange(method, path, body) {
            Ok(reply) => Ok(reply),
            Err(_) if reused => {
                self.connection = None;
                self.exchange(method, path, body)
            }
            Err(error) => Err(error),
        }
        .with_context(|| format!("{method} http://{}{path}", self.address))
    }

    /// `request` with a JSON body, expecting status 200 and a JSON reply.
    pub fn post_json(&mut self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
        let (status, reply) = self.request("POST", path, body.to_string().as_bytes())?;
        json_ok(status, &reply, path)
    }

    /// `GET path`, expecting status 200 and a JSON reply.
    pub fn get_json(&mut self, path: &str) -> Result<serde_json::Value> {
        let (status, reply) = self.request("GET", path, b"")?;
        json_ok(status, &reply, path)
    }

    fn exchange(&mut self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>)> {
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => {
                let stream = TcpStream::connect_timeout(&self.address, self.timeout)
                    .context("connecting")?;
                stream.set_read_timeout(Some(self.timeout))?;
                stream.set_write_timeout(Some(self.timeout))?;
                stream.set_nodelay(true)?;
                self.connection.insert(BufReader::new(stream))
            }
        };
        let result = send_and_receive(connection, method, path, body);
        if !matches!(&result, Ok((_, _, keep_alive)) if *keep_alive) {
            self.connection = None;
        }
        result.map(|(status, body, _)| (status, body))
    }
}

/// (status, body, whether the connection stays open).
fn send_and_receive(
    connection: &mut BufReader<TcpStream>,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Vec<u8>, bool)> {
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: kv-indexer\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    connection
        .get_mut()
        .write_all(&request)
        .context("sending")?;

    let mut line = String::new();
    connection
        .read_line(&mut line)
        .context("reading the status line")?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {line:?}"))?;
    let mut length = None;
    let mut keep_alive = true;
    loop {
        line.clear();
        if connection
            .read_line(&mut line)
            .context("reading a header")?
            == 0
        {
            bail!("connection closed inside the headers");
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            bail!("bad header {header:?}");
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().context("bad Content-Length")?);
        } else if name.eq_ignore_ascii_case("connection") && value.eq_ignore_ascii_case("close") {
            keep_alive = false;
        }
    }
    let length = length.ok_or_else(|| anyhow!("status {status}: no Content-Length"))?;
    let mut reply = vec![0; length];
    connection
        .read_exact(&mut reply)
        .context("reading the body")?;
    Ok((status, reply, keep_alive))
}

fn json_ok(status: u16, reply: &[u8], path: &str) -> Result<serde_json::Value> {
    if status != 200 {
        bail!(
            "{path}: status {status}: {}",
            String::from_utf8_lossy(reply)
        );
    }
    serde_json::from_slice(reply).with_context(|| format!("{path}: reply is not JSON"))
}
