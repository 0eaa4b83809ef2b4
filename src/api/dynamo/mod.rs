//! The Dynamo / Mooncake indexer API (docs.md, "Dynamo / Mooncake indexer API"): NVIDIA
//! Dynamo's standalone indexer paths (`/query`, `/query_by_hash`, `/register`, `/unregister`,
//! `/workers`, `/health`) on their own address (`dynamo_listen`), so that routers written for
//! Dynamo or Mooncake Conductor use kv-indexer as a drop-in, beside our own API and without
//! clashing paths.
//!
//! Owns: its paths and their answers (`handlers`) and its body parser (`requests`); the
//! engines it registers at runtime are the registry's `Reconciler`'s. It is served by a second
//! `HttpServer` (`HttpServer::bind(dynamo_listen)` then `BoundHttp::serve`: the same
//! connection cap, head and body limits and deadlines as our API). Never: changes the index or starts a listener itself (registrations go through
//! `Reconciler` to the registry), or panics on a request.

mod handlers;
mod requests;

use std::sync::Arc;

use crate::auth::CurrentSecret;
use crate::discover::EndpointPolicy;
use crate::index::Index;
use crate::metrics::Metrics;
use crate::registry::DirectoryReader;
use crate::registry::Reconciler;
use crate::serve::table::{dispatch, runs};
use crate::serve::{Api, Reply, Request, Runs};
pub use handlers::{runtime_engine_name, ROUTING_GROUP};

/// What the Dynamo API's handlers read and call.
pub struct DynamoApi {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    pub directory: DirectoryReader,
    pub engines: Arc<Reconciler>,
    /// Which endpoints a registration may name (shared with discovery).
    pub endpoints: Arc<EndpointPolicy>,
    /// The secret `/register` and `/unregister` require (they change state), when
    /// `auth_token_file` is set; the query paths stay open, as on our own API.
    pub secret: Arc<CurrentSecret>,
}

impl Api for DynamoApi {
    fn name(&self) -> &'static str {
        "Dynamo API"
    }

    fn answer(&self, request: &Request, body: &[u8]) -> Reply {
        dispatch(handlers::DYNAMO_PATHS, self, &self.secret, request, body)
    }

    fn runs(&self, request: &Request) -> Runs {
        runs(handlers::DYNAMO_PATHS, request)
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}
