//! `indexer.toml` text for harnesses that run the indexer on simulated or scripted engines: the
//! one place tests and examples write the file's keys.
//!
//! It owns formatting only; it never validates (a test may want a broken file) and never
//! writes a file.

use std::fmt;

/// One `[[engine]]` table on 127.0.0.1 (or `host`, or asked of `discover`); unset keys are left
/// out (the file's defaults apply).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineToml {
    pub name: String,
    /// None: 127.0.0.1.
    pub host: Option<String>,
    /// 0: not written (an engine with `discover` needs none).
    pub zmq_port: u16,
    pub dp_size: Option<u32>,
    pub replay_port: Option<u16>,
    pub recover_port: Option<u16>,
    pub model: Option<String>,
    /// The model's tokenizer directory (docs.md "Prompts as text or chat messages").
    pub tokenizer: Option<String>,
    /// The engine's HTTP server; written instead of `host`.
    pub discover: Option<String>,
    pub discover_interval_s: Option<u32>,
    /// The engine's OpenAI server, where a `[route]` front end sends its requests.
    pub openai_url: Option<String>,
    /// The file holding the key its OpenAI server wants (vLLM's `--api-key`).
    pub api_key_file: Option<String>,
    /// Where its load is scraped (absent: the OpenAI server's `/metrics`; `""`: nowhere).
    pub metrics_url: Option<String>,
}

impl EngineToml {
    pub fn new(name: impl Into<String>, zmq_port: u16) -> EngineToml {
        EngineToml {
            name: name.into(),
            zmq_port,
            ..EngineToml::default()
        }
    }

    /// An engine whose ranks come from its API server at `api_port` on 127.0.0.1.
    pub fn discovered(name: impl Into<String>, api_port: u16) -> EngineToml {
        EngineToml {
            name: name.into(),
            discover: Some(format!("http://127.0.0.1:{api_port}")),
            ..EngineToml::default()
        }
    }
}

impl fmt::Display for EngineToml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[[engine]]\nname = \"{}\"", self.name)?;
        match &self.discover {
            Some(url) => writeln!(f, "discover = \"{url}\"")?,
            None => writeln!(
                f,
                "host = \"{}\"",
                self.host.as_deref().unwrap_or("127.0.0.1")
            )?,
        }
        if let Some(interval) = self.discover_interval_s {
            writeln!(f, "discover_interval_s = {interval}")?;
        }
        if self.zmq_port != 0 {
            writeln!(f, "zmq_port = {}", self.zmq_port)?;
        }
        if let Some(dp_size) = self.dp_size {
            writeln!(f, "dp_size = {dp_size}")?;
        }
        if let Some(port) = self.replay_port {
            writeln!(f, "replay_port = {port}")?;
        }
        if let Some(port) = self.recover_port {
            writeln!(f, "recover_port = {port}")?;
        }
        if let Some(model) = &self.model {
            writeln!(f, "model = \"{model}\"")?;
        }
        if let Some(tokenizer) = &self.tokenizer {
            // A literal string: a path's backslashes stay as they are.
            writeln!(f, "tokenizer = '{tokenizer}'")?;
        }
        if let Some(url) = &self.openai_url {
            writeln!(f, "openai_url = \"{url}\"")?;
        }
        if let Some(path) = &self.api_key_file {
            writeln!(f, "api_key_file = '{path}'")?;
        }
        if let Some(url) = &self.metrics_url {
            writeln!(f, "metrics_url = \"{url}\"")?;
        }
        Ok(())
    }
}

/// A whole file: `listen` (when given), `block_size`, then the engines.
pub fn indexer_toml(listen: Option<&str>, block_size: u32, engines: &[EngineToml]) -> String {
    let mut toml = listen.map_or_else(String::new, |listen| format!("listen = \"{listen}\"\n"));
    toml.push_str(&format!("block_size = {block_size}\n"));
    for engine in engines {
        toml.push_str(&format!("\n{engine}"));
    }
    toml
}

/// A `[route]` table (docs.md "Routing") on `listen`, with `keys` as written (`("idle_timeout_s",
/// "5")`), to put after a file's other tables.
pub fn route_table(listen: &str, keys: &[(&str, &str)]) -> String {
    let mut toml = format!("\n[route]\nlisten = \"{listen}\"\n");
    for (key, value) in keys {
        toml.push_str(&format!("{key} = {value}\n"));
    }
    toml
}

/// The replica keys (docs.md "Replicas"), to put before a file's `[[engine]]` tables: `peers`
/// as `http://ADDRESS`, `serve_snapshots` when true, `auth_token_file` when given.
pub fn replica_keys(
    peers: &[std::net::SocketAddr],
    serve_snapshots: bool,
    auth_token_file: Option<&std::path::Path>,
) -> String {
    let peers: Vec<String> = peers
        .iter()
        .map(|peer| format!("\"http://{peer}\""))
        .collect();
    let mut toml = format!("peers = [{}]\n", peers.join(", "));
    if serve_snapshots {
        toml.push_str("serve_snapshots = true\n");
    }
    if let Some(path) = auth_token_file {
        toml.push_str(&format!(
            "auth_token_file = {:?}\n",
            path.display().to_string()
        ));
    }
    toml
}

/// A `[select]` table (docs.md "Selection") of `key = value` pairs, values as TOML text; put it
/// after everything else in a file.
pub fn select_table(keys: &[(&str, &str)]) -> String {
    let mut toml = String::from("\n[select]\n");
    for (key, value) in keys {
        toml.push_str(&format!("{key} = {value}\n"));
    }
    toml
}
