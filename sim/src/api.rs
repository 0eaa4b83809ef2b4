//! The simulated engine's API server, as vLLM's OpenAI server: `GET /kv_event_sources` (one
//! entry per running rank, vLLM 0.33's shape) and `POST /scale_elastic_ep`
//! (`{"new_data_parallel_size": N}`, vLLM's elastic scaling route) to add or remove ranks while
//! running. FastAPI's `{"detail": "Not Found"}` 404 elsewhere.
//!
//! Owns the routes and the broken answers tests inject (`ApiReply::Canned`). Never: binds a
//! rank's socket itself (scaling goes through the engine's shared state).

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use serde::Deserialize;
use tracing::warn;

use crate::rank_http::{error_reply, path_of, respond};
use crate::server::{bind_http, Shared, STOP_POLL};

/// Largest `POST /scale_elastic_ep` body read: the request is one small object.
const MAX_SCALE_BODY_BYTES: u64 = 4 << 10;

/// What `GET /kv_event_sources` answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiReply {
    /// The running ranks, as vLLM answers.
    Sources,
    /// This status and body instead (a broken or confused API server).
    Canned { status: u16, body: String },
}

/// The running API server; `stop` ends its thread.
pub(super) struct ApiServer {
    port: u16,
    stopping: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl ApiServer {
    pub(super) fn port(&self) -> u16 {
        self.port
    }

    pub(super) fn stop(self) {
        self.stopping.store(true, Ordering::Relaxed);
        if self.thread.join().is_err() {
            warn!("the simulated API server thread panicked");
        }
    }
}

/// Binds `bind:port` (0: picked by the OS) and serves until stopped.
pub(super) fn start(shared: Arc<Shared>, bind: &str, port: u16) -> Result<ApiServer> {
    let (server, port) = bind_http(bind, port).context("the engine's API server")?;
    let stopping = Arc::new(AtomicBool::new(false));
    let stop = Arc::clone(&stopping);
    let thread = std::thread::Builder::new()
        .name("sim-api".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match server.recv_timeout(STOP_POLL) {
                    Ok(Some(request)) => answer(&shared, request),
                    Ok(None) => {}
                    Err(error) => warn!("API server: accept failed: {error}"),
                }
            }
        })
        .context("spawning the API server thread")?;
    Ok(ApiServer {
        port,
        stopping,
        thread,
    })
}

#[derive(Deserialize)]
struct ScaleRequest {
    new_data_parallel_size: u32,
}

fn answer(shared: &Shared, mut request: tiny_http::Request) {
    let path = path_of(&request);
    let (status, body) = match (request.method(), path.as_str()) {
        (tiny_http::Method::Get, "/kv_event_sources") => match shared.api_reply.lock().clone() {
            ApiReply::Sources => (200, shared.kv_event_sources().to_string().into_bytes()),
            ApiReply::Canned { status, body } => (status, body.into_bytes()),
        },
        (tiny_http::Method::Post, "/scale_elastic_ep") => scale(shared, &mut request),
        _ => (404, br#"{"detail":"Not Found"}"#.to_vec()),
    };
    respond(request, status, body, "API server");
}

fn scale(shared: &Shared, request: &mut tiny_http::Request) -> (u16, Vec<u8>) {
    let mut body = Vec::new();
    if let Err(error) = request
        .as_reader()
        .take(MAX_SCALE_BODY_BYTES)
        .read_to_end(&mut body)
    {
        return error_reply(400, &format!("reading the body: {error}"));
    }
    let wanted = match serde_json::from_slice::<ScaleRequest>(&body) {
        Ok(wanted) => wanted.new_data_parallel_size,
        Err(error) => {
            return error_reply(
                400,
                &format!("expected {{\"new_data_parallel_size\": N}}: {error}"),
            )
        }
    };
    match shared.scale_to(wanted) {
        Ok(()) => (
            200,
            serde_json::json!({ "message": format!("Scaled to {wanted} data parallel engines") })
                .to_string()
                .into_bytes(),
        ),
        Err(error) => error_reply(500, &format!("{error:#}")),
    }
}
