//! Our API and the Dynamo API of one in-process `Service` (the binary's own wiring: one
//! registry, index and `RuntimeEngines`), on a config file of its own with `dynamo_listen` set,
//! both on ports the OS picks. `POST /reload` re-reads that file, as SIGHUP does. For
//! `tests/dynamo_api.rs` and `examples/bench_dynamo.rs`.

use std::net::SocketAddr;

use kv_indexer::config::Config;
use kv_indexer::service::Service;
use tempfile::TempDir;

/// The service on `toml` with the Dynamo API on, stopped on drop.
pub struct Servers {
    service: Option<Service>,
    // Declared last: removed after the service is gone.
    _dir: TempDir,
}

impl Servers {
    /// `toml` (top-level keys first, as any config) with `dynamo_listen` added.
    pub fn start(toml: &str) -> Servers {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("indexer.toml");
        let toml = format!("dynamo_listen = \"127.0.0.1:0\"\n{toml}");
        std::fs::write(&path, toml).expect("write config");
        let config = Config::load(&path).unwrap_or_else(|err| panic!("config: {err}"));
        let service = Service::start(&path, config, Some("127.0.0.1:0".into()))
            .unwrap_or_else(|err| panic!("service: {err:#}"));
        Servers {
            service: Some(service),
            _dir: dir,
        }
    }

    fn service(&self) -> &Service {
        self.service.as_ref().expect("running")
    }

    pub fn ours(&self) -> SocketAddr {
        self.service().http_addr()
    }

    pub fn dynamo(&self) -> SocketAddr {
        self.service()
            .dynamo_addr()
            .expect("dynamo_listen is set, so the Dynamo API runs")
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        if let Some(service) = self.service.take() {
            service.shutdown();
        }
    }
}
