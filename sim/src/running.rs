//! The indexer's own `Service` in this process (the binary's wiring: registry, index, HTTP, and
//! the Dynamo API when the file sets `dynamo_listen`) on a config file of its own, HTTP on a
//! port the OS picks: the one in-process indexer of tests and benchmarks that drive it over
//! real HTTP without a child process.
//!
//! It owns the service and its config file. It never outlives either: the service is shut
//! down, then the file removed, on drop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};

use crate::process::PrivateDir;
use kv_indexer::config::Config;
use kv_indexer::select::Clock;
use kv_indexer::service::Service;

/// A running `Service`, shut down on drop.
pub struct RunningService {
    service: Option<Service>,
    config: PathBuf,
    // Declared last: removed after the service is gone.
    _dir: PrivateDir,
}

impl RunningService {
    /// Writes `toml` to a fresh `indexer.toml`, loads it and starts the service on it, with
    /// `listen` overridden to 127.0.0.1:0.
    pub fn start(toml: &str) -> Result<RunningService> {
        RunningService::start_with_select_clock(toml, Clock::real())
    }

    /// `start`, with `/select`'s time-to-lives measured on `select_clock` (a test's
    /// `Clock::manual()`, which it advances instead of waiting).
    pub fn start_with_select_clock(toml: &str, select_clock: Clock) -> Result<RunningService> {
        let dir = PrivateDir::create()?;
        let config = dir.path().join("indexer.toml");
        std::fs::write(&config, toml).with_context(|| format!("writing {}", config.display()))?;
        let loaded =
            Config::load(&config).map_err(|error| anyhow!("{}: {error}", config.display()))?;
        let listen = Some("127.0.0.1:0".into());
        let service = Service::start_with_select_clock(&config, loaded, listen, select_clock)
            .with_context(|| format!("starting the service on {}", config.display()))?;
        Ok(RunningService {
            service: Some(service),
            config,
            _dir: dir,
        })
    }

    /// The service itself (to reload it, say).
    pub fn service(&self) -> &Service {
        // Some until drop.
        self.service.as_ref().expect("the service runs until drop")
    }

    /// Where our HTTP API serves.
    pub fn http_addr(&self) -> SocketAddr {
        self.service().http_addr()
    }

    /// Where the route front end serves; None unless the file has `[route]`.
    pub fn route_addr(&self) -> Option<SocketAddr> {
        self.service().route_addr()
    }

    /// Where the Dynamo API serves; None unless the file sets `dynamo_listen`.
    pub fn dynamo_addr(&self) -> Option<SocketAddr> {
        self.service().dynamo_addr()
    }

    /// The config file the service was started on (a test rewrites it before a reload).
    pub fn config_path(&self) -> &Path {
        &self.config
    }
}

impl Drop for RunningService {
    fn drop(&mut self) {
        if let Some(service) = self.service.take() {
            service.shutdown();
        }
    }
}
