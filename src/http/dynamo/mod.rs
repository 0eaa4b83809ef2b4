//! The Dynamo / Mooncake indexer API (docs.md, "Dynamo / Mooncake indexer API"): NVIDIA
//! Dynamo's standalone indexer routes (`/query`, `/query_by_hash`, `/register`, `/unregister`,
//! `/workers`, `/health`) on their own address (`dynamo_listen`), so that routers written for
//! Dynamo or Mooncake Conductor use kv-indexer as a drop-in, beside our own API and without
//! clashing paths.
//!
//! Owns: its routes (`routes`) and its body parser (`requests`); the engines it registers at
//! runtime are the registry's `Reconciler`'s. It is served by a second `HttpServer` (`HttpServer::bind(dynamo_listen)`
//! then `BoundHttp::serve`: the same connection cap, head and body limits and deadlines as our
//! API). Never: changes the index or starts a listener itself (registrations go through
//! `Reconciler` to the registry), or panics on a request.

mod requests;
mod routes;

use std::sync::Arc;

use crate::http::Request;

use super::{Reply, Routes};
use crate::auth::CurrentSecret;
use crate::discover::EndpointPolicy;
use crate::index::Index;
use crate::metrics::Metrics;
use crate::registry::DirectoryReader;
use crate::registry::Reconciler;
pub use routes::{runtime_engine_name, ROUTING_GROUP};

/// What the Dynamo routes read and call.
pub struct DynamoApi {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    pub directory: DirectoryReader,
    pub engines: Arc<Reconciler>,
    /// Which endpoints a registration may name (shared with discovery).
    pub endpoints: Arc<EndpointPolicy>,
    /// The secret `/register` and `/unregister` require (they change state), when
    /// `auth_token_file` is set; the query routes stay open, as on our own API.
    pub secret: Arc<CurrentSecret>,
}

impl Routes for DynamoApi {
    fn name(&self) -> &'static str {
        "Dynamo API"
    }

    fn route(&self, request: &Request, body: &[u8]) -> Reply {
        crate::http::table::dispatch(routes::DYNAMO_ROUTES, self, &self.secret, request, body)
    }

    fn answers_at_once(&self, request: &Request) -> bool {
        crate::http::is_check(request, &["/health"])
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}
