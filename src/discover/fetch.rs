//! The one HTTP GET discovery makes: bounded in time and size, no redirect followed, every
//! failure a `DiscoverError` naming the engine and the URL.
//!
//! Owns: the limits of a fetch (the client, `engine_http`, follows no redirect and reads no
//! proxy from the environment) and what each failure is called. Never: interprets a body
//! beyond "is it JSON".

use std::sync::Arc;
use std::time::Duration;

use super::{DiscoverError, Failure};
use crate::engine_http::{Bounds, Connections, FetchError, Whole};

/// What one fetch may cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// To establish the TCP connection. Without it a SYN to a dead node waits for the
    /// kernel's retries (about 127 s on Linux).
    pub connect: Duration,
    /// For the whole request, from resolving the name to the body's last byte: a server that
    /// trickles its body is cut off here.
    pub whole: Duration,
    /// Largest body taken. An entry of `/kv_event_sources` is about 250 bytes, so 1,024 ranks
    /// (`MAX_DP_SIZE`) answer about 256 KiB; SGLang's `/server_info` is some 10 KiB.
    /// 1 MiB is four times the largest real answer, and bounds what a broken server can make
    /// the indexer hold.
    pub max_body: u64,
}

impl Default for Limits {
    /// Engines answer these routes from memory in milliseconds; 5 s tolerates an API server
    /// whose event loop is busy with traffic without stalling a discovery round for long.
    fn default() -> Limits {
        Limits {
            connect: Duration::from_secs(2),
            whole: Duration::from_secs(5),
            max_body: 1 << 20,
        }
    }
}

/// Asks engines' HTTP servers; one is shared by every engine (its connections are pooled).
pub struct Client {
    connections: Arc<Connections>,
    limits: Limits,
}

/// Characters of an error body quoted in a status error: enough for FastAPI's `{"detail":
/// "Not Found"}` or a proxy's one-line reason, not a page of HTML.
const QUOTED_BODY_CHARS: usize = 160;

impl Client {
    pub fn new(limits: Limits) -> Client {
        Client {
            connections: Arc::default(),
            limits,
        }
    }

    /// GETs `url` and parses the body as JSON; `None` for a 404 (the route does not exist on
    /// this kind of engine).
    pub(super) async fn get_json(
        &self,
        engine: &str,
        url: &str,
    ) -> Result<Option<serde_json::Value>, DiscoverError> {
        let fail = |failure: Failure, detail: String| DiscoverError {
            engine: engine.to_string(),
            url: url.to_string(),
            failure,
            detail,
        };
        let bounds = Bounds {
            connect: self.limits.connect,
            silence: None,
            whole: self.limits.whole,
            max_body: self.limits.max_body,
            // A character is at most 4 bytes.
            max_error_body: 4 * QUOTED_BODY_CHARS as u64,
        };
        let Whole { parts, body } = self
            .connections
            .get(url, &[("accept", "application/json")], &bounds)
            .await
            .map_err(|err| {
                let (failure, detail) = self.transport_failure(err);
                fail(failure, detail)
            })?;
        let status = parts.status;
        if status.is_redirection() {
            let target = parts
                .headers
                .get("location")
                .and_then(|value| value.to_str().ok())
                .unwrap_or("nowhere given");
            return Err(fail(
                Failure::Redirect(status.as_u16()),
                format!(
                    "answered {status} redirecting to {target}: discovery follows no redirect; \
                     point discover at the engine's HTTP server itself"
                ),
            ));
        }
        if status.as_u16() == 404 {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(fail(
                Failure::Status(status.as_u16()),
                format!("answered {status}{}", quote(&body)),
            ));
        }
        serde_json::from_slice(&body).map(Some).map_err(|err| {
            fail(
                Failure::NotJson,
                format!("answered {status} with a body that is not JSON ({err}): is this the engine's HTTP server?"),
            )
        })
    }

    fn transport_failure(&self, err: FetchError) -> (Failure, String) {
        let Limits {
            connect,
            whole,
            max_body,
        } = self.limits;
        match err {
            FetchError::ConnectTimedOut(_) => (
                Failure::Unreachable,
                format!("cannot be reached: no connection within {connect:?}"),
            ),
            FetchError::TimedOut(_) | FetchError::Silent(_) => (
                Failure::Timeout,
                format!("gave no whole answer within {whole:?}"),
            ),
            FetchError::TooLarge { .. } => (
                Failure::TooLarge,
                format!(
                    "answered more than {}, refused: a real answer is at most some 256 KiB",
                    byte_size(max_body)
                ),
            ),
            FetchError::Malformed(why) => (
                Failure::NotHttp,
                format!("answered something that is not HTTP ({why})"),
            ),
            FetchError::NotDelivered(why) | FetchError::Broken(why) => {
                (Failure::Unreachable, format!("cannot be reached: {why}"))
            }
            FetchError::Request(why) => (Failure::Unreachable, format!("cannot be reached: {why}")),
            FetchError::BodyBroke { read, why } => (
                Failure::Unreachable,
                format!("cannot be reached: the answer broke {read} bytes in ({why})"),
            ),
        }
    }
}

/// `: "…"` with the body's first characters on one line, or nothing for an empty body.
fn quote(body: &[u8]) -> String {
    let text: String = String::from_utf8_lossy(body)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(QUOTED_BODY_CHARS)
        .collect();
    let text = text.trim();
    if text.is_empty() {
        String::new()
    } else {
        format!(": {text:?}")
    }
}

/// `1 MiB`, `512 KiB` or `100 bytes`: the cap as a reader would write it.
fn byte_size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}
