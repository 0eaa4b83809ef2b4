//! The Dynamo / Mooncake indexer API (`docs/dynamo-api.md`): NVIDIA Dynamo's standalone
//! indexer routes (`/query`, `/query_by_hash`, `/register`, `/unregister`, `/workers`,
//! `/health`) on their own address (`dynamo_listen`), so that routers written for Dynamo or
//! Mooncake Conductor use kv-indexer as a drop-in, beside our own API and without clashing paths.
//!
//! Owns: its server and pool, its routes (`routes`), its body parser (`requests`) and the
//! engines registered at runtime (`engines`). Shares with our API the body limits, deadlines and
//! safe refusals of `http::body`, the reply type and the socket options. Never: changes the index
//! or starts a listener itself (registrations go through `RuntimeEngines` to the registry),
//! panics on a request, or spawns a thread per request.

mod engines;
mod requests;
mod routes;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::Context;
use log::{debug, info};
use tiny_http::{Request, Server};

use super::body::{refuse_unread, take_body, Uploads};
use super::{inherit_no_delay, POOL_THREADS, STOP_POLL};
use crate::index::Index;
use crate::metrics::Metrics;
use crate::registry::DirectoryReader;
pub use engines::{ApplyFn, EngineChange, RuntimeEngines};
pub use routes::{runtime_engine_name, ROUTING_GROUP};

/// What the Dynamo routes read and call.
pub struct DynamoApi {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    pub directory: DirectoryReader,
    pub engines: Arc<RuntimeEngines>,
}

/// The running Dynamo API server and its pool.
pub struct DynamoServer {
    server: Arc<Server>,
    stopping: Arc<AtomicBool>,
    pool: Vec<JoinHandle<()>>,
    addr: SocketAddr,
}

impl DynamoServer {
    /// Binds `listen` (`IP:port` or `hostname:port`; port 0 picks a free one) and serves the
    /// Dynamo API on it.
    pub fn start(listen: &str, api: Arc<DynamoApi>) -> anyhow::Result<DynamoServer> {
        let listener = TcpListener::bind(listen)
            .with_context(|| format!("binding the Dynamo API to {listen}"))?;
        let addr = listener
            .local_addr()
            .with_context(|| format!("reading the bound address of {listen}"))?;
        inherit_no_delay(&listener).with_context(|| format!("setting TCP_NODELAY on {addr}"))?;
        let server = Server::from_listener(listener, None)
            .map_err(|err| anyhow::anyhow!("starting the Dynamo API server on {addr}: {err}"))?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let uploads = Arc::new(Uploads::default());
        let pool = (0..POOL_THREADS)
            .map(|n| {
                let (server, stopping) = (server.clone(), stopping.clone());
                let (api, uploads) = (api.clone(), uploads.clone());
                std::thread::Builder::new()
                    .name(format!("dynamo-{n}"))
                    .spawn(move || {
                        while !stopping.load(Ordering::SeqCst) {
                            match server.recv_timeout(STOP_POLL) {
                                Ok(Some(request)) => serve(&api, &uploads, request),
                                Ok(None) => {}
                                Err(err) => debug!("Dynamo API accept error: {err}"),
                            }
                        }
                        while let Ok(Some(request)) = server.try_recv() {
                            serve(&api, &uploads, request);
                        }
                    })
                    .with_context(|| format!("spawning Dynamo API thread {n}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        info!("Dynamo API listening on http://{addr} ({POOL_THREADS} threads)");
        Ok(DynamoServer {
            server,
            stopping,
            pool,
            addr,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers the requests already received, then stops accepting and returns.
    pub fn stop(self) {
        self.stopping.store(true, Ordering::SeqCst);
        for thread in self.pool {
            // A pool thread never panics on a request; a join error would be a bug, not input.
            let _ = thread.join();
        }
        drop(self.server);
        info!("Dynamo API on {} stopped", self.addr);
    }
}

fn serve(api: &DynamoApi, uploads: &Uploads, mut request: Request) {
    let started = Instant::now();
    let body = match take_body(&mut request, uploads) {
        Ok(body) => body,
        Err(refusal) => {
            api.metrics.http_error(refusal.reply.status);
            refuse_unread(request, refusal);
            return;
        }
    };
    let reply = routes::route(api, &request, &body);
    let is_query = reply.is_query;
    if reply.status >= 400 {
        api.metrics.http_error(reply.status);
    }
    if let Err(err) = request.respond(reply.into_response()) {
        debug!("Dynamo API response not delivered: {err}");
    }
    if is_query {
        api.metrics.observe_query(started.elapsed().as_secs_f64());
    }
}
