//! The request head as an API's handlers see it: hyper's parsed head and the address it came from.
//!
//! Owns: how a handler reads the method, the URL (path and query, as sent), headers and the
//! peer, and the flag that says its client has gone. Never: reads the body (the server hands it over whole), or parses a byte itself:
//! hyper did, behind `guard`'s byte rules.

use std::net::SocketAddr;

use http::request::Parts;
use http::Method;

use crate::tokenize::gate::Cancel;

/// A parsed request head.
pub struct Request {
    parts: Parts,
    peer: SocketAddr,
    gone: Cancel,
}

impl Request {
    pub(super) fn new(parts: Parts, peer: SocketAddr) -> Request {
        Request {
            parts,
            peer,
            gone: Cancel::default(),
        }
    }

    /// Set once the request's answer is dropped unwritten (its client has gone): a handler's
    /// long step (tokenizing) stops at it.
    pub fn gone(&self) -> &Cancel {
        &self.gone
    }

    /// The address of the client that sent it.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub fn method(&self) -> &Method {
        &self.parts.method
    }

    /// The path and query as sent (`/query?model=m`).
    pub fn url(&self) -> &str {
        self.parts
            .uri
            .path_and_query()
            .map_or("/", |path| path.as_str())
    }

    /// The path alone.
    pub fn path(&self) -> &str {
        self.parts.uri.path()
    }

    /// The query string, without its `?`.
    pub fn query_string(&self) -> Option<&str> {
        self.parts.uri.query()
    }

    /// Every value of header `name` (case-insensitive), in order. `guard` refuses a head that
    /// is not ASCII, so every value reads as text.
    pub fn headers(&self) -> &http::HeaderMap {
        &self.parts.headers
    }

    pub(super) fn header_values<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a str> + 'a {
        self.parts
            .headers
            .get_all(name)
            .into_iter()
            .filter_map(|value| value.to_str().ok())
            .map(str::trim_ascii)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_values(name).next()
    }
}

/// A request of `method` for `target`, from a loopback peer: for the tests of where a path is
/// answered.
#[cfg(test)]
pub(crate) fn test_request(method: &str, target: &str) -> Request {
    let (parts, ()) = http::Request::builder()
        .method(method)
        .uri(target)
        .body(())
        .expect("a request")
        .into_parts();
    Request::new(parts, SocketAddr::from(([127, 0, 0, 1], 1)))
}
