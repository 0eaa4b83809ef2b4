//! indexer.toml.

use std::path::Path;

/// A validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// HTTP API address, `IP:port` or `hostname:port`.
    pub listen: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Lock shards of the index (a power of two).
    pub shards: usize,
    /// `[[engine]]` tables with `[defaults]` applied.
    pub engines: Vec<EngineConfig>,
}

/// One `[[engine]]` with defaults applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub name: String,
    pub host: String,
    pub zmq_port: u16,
    pub dp_size: u32,
    pub replay_port: Option<u16>,
    pub recover_port: Option<u16>,
    pub model: Option<String>,
    pub topic: String,
}

/// Every problem found in a configuration file; each names the file, the engine and the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub problems: Vec<String>,
}

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        todo!("config helper: {path:?}")
    }

    /// Validates `text`; `origin` (the file name) prefixes every problem.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        todo!("config helper: {text} {origin}")
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.problems.join("\n"))
    }
}

impl std::error::Error for ConfigError {}
