//! Our API and the Dynamo API over one real registry, listeners and index, built as the service
//! builds them for `dynamo_listen`: the same `Api`, `DynamoApi` and `RuntimeEngines`, with
//! `POST /reload` applying the file's plan again through `RuntimeEngines::apply_file_plan`, as
//! SIGHUP does. For `tests/dynamo_api.rs` and `examples/bench_dynamo.rs`.

#![allow(dead_code)] // Each includer uses its own subset.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use kv_indexer::config::Config;
use kv_indexer::http::dynamo::{self, DynamoApi, RuntimeEngines};
use kv_indexer::http::{Api, HttpServer};
use kv_indexer::index::Index;
use kv_indexer::metrics::Metrics;
use kv_indexer::plan;
use kv_indexer::registry::Registry;

/// Our API and the Dynamo API over one registry running `toml`'s engines.
pub struct Servers {
    pub index: Arc<Index>,
    ours: Option<HttpServer>,
    dynamo: Option<HttpServer>,
    registry: Arc<Mutex<Registry>>,
}

impl Servers {
    pub fn start(toml: &str) -> Servers {
        let config = Config::parse(toml, "indexer.toml").unwrap_or_else(|err| panic!("{err}"));
        let index = Index::new(config.block_size, config.shards);
        let metrics = Arc::new(Metrics::new());
        let registry = Registry::new(zmq::Context::new(), index.clone(), metrics.clone());
        let directory = registry.directory();
        let registry = Arc::new(Mutex::new(registry));
        let applier = registry.clone();
        let engines = Arc::new(RuntimeEngines::new(Box::new(move |plan| {
            applier
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .apply(plan)
        })));
        let file_plan = plan::expand(&config);
        let diff = engines.apply_file_plan(file_plan.clone());
        assert!(diff.failed.is_empty(), "{:?}", diff.failed);
        let reloader = engines.clone();
        let ours = HttpServer::start(
            "127.0.0.1:0",
            Arc::new(Api {
                index: index.clone(),
                metrics: metrics.clone(),
                registry: registry.clone(),
                directory: directory.clone(),
                reload: Box::new(move || Ok(reloader.apply_file_plan(file_plan.clone()))),
            }),
        )
        .unwrap_or_else(|err| panic!("{err:#}"));
        let dynamo = dynamo::serve(
            "127.0.0.1:0",
            Arc::new(DynamoApi {
                index: index.clone(),
                metrics,
                directory,
                engines,
            }),
        )
        .unwrap_or_else(|err| panic!("{err:#}"));
        Servers {
            index,
            ours: Some(ours),
            dynamo: Some(dynamo),
            registry,
        }
    }

    pub fn ours(&self) -> SocketAddr {
        self.ours.as_ref().expect("running").addr()
    }

    pub fn dynamo(&self) -> SocketAddr {
        self.dynamo.as_ref().expect("running").addr()
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        if let Some(server) = self.dynamo.take() {
            server.stop();
        }
        if let Some(server) = self.ours.take() {
            server.stop();
        }
        self.registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stop_all();
    }
}
