//! The running process: index, metrics, registry, HTTP server, signals.

use std::path::Path;

use crate::config::Config;

/// Serves `config` (loaded from `config_path`, which SIGHUP and `POST /reload` re-read) until
/// SIGTERM or SIGINT. `listen` overrides the file's `listen`.
pub fn run(config_path: &Path, config: Config, listen: Option<String>) -> anyhow::Result<()> {
    todo!("service helper: {config_path:?} {config:?} {listen:?}")
}
