//! The other indexers a rank may recover from (docs/design.md "Recovery from a peer"): the
//! reloadable `peers` list, the shared secret in effect (`crate::auth`'s, sent to them and
//! checked by the HTTP APIs), and whether ranks keep the block contents a snapshot needs; and
//! where this indexer's own saved states are (`state_dir`, docs/design.md "Saved state").
//! Shared by every listener; a reload swaps the list and the secret without touching any
//! listener.
//!
//! Owns: the list, the handle on the secret, the snapshot URL of a rank at a peer, and the
//! client snapshot fetches share (`recovery::Fetcher`). Never: fetches anything (`recovery`
//! does) or decides whether an answer is usable (`applier` does).

use std::sync::Arc;

use parking_lot::RwLock;
use tokio::runtime::Handle;

use super::recovery::Fetcher;
use crate::auth::{CurrentSecret, Secret};
use crate::plan::WorkerKey;

/// What every listener of the process shares about its replicas.
pub struct Replication {
    peers: RwLock<Arc<[String]>>,
    secret: Arc<CurrentSecret>,
    retain: bool,
    /// Where this indexer saves its ranks' states (`state_dir`), read when a rank starts.
    state_dir: Option<std::path::PathBuf>,
    /// The client every snapshot fetch (from a peer or an engine) goes through.
    fetcher: Fetcher,
}

impl Replication {
    /// `peers` are base URLs (`http://host:port`); `retain`: whether ranks keep their block
    /// contents (decided at start: a rank cannot serve what it did not keep).
    /// Its snapshots are fetched on a runtime of their own (`engine_http`'s standalone one).
    pub fn new(peers: Vec<String>, secret: Option<Secret>, retain: bool) -> Arc<Replication> {
        Arc::new(Replication {
            peers: RwLock::new(peers.into()),
            secret: Arc::new(CurrentSecret::new(secret)),
            retain,
            state_dir: None,
            fetcher: Fetcher::on(None),
        })
    }

    /// `new`, for a service's indexer, which saves its ranks' states in `state_dir` and fetches
    /// snapshots on its `runtime`.
    pub fn with_state_dir(
        peers: Vec<String>,
        secret: Option<Secret>,
        retain: bool,
        state_dir: Option<std::path::PathBuf>,
        runtime: Handle,
    ) -> Arc<Replication> {
        Arc::new(Replication {
            peers: RwLock::new(peers.into()),
            secret: Arc::new(CurrentSecret::new(secret)),
            retain,
            state_dir,
            fetcher: Fetcher::on(Some(runtime)),
        })
    }

    pub fn state_dir(&self) -> Option<&std::path::Path> {
        self.state_dir.as_deref()
    }

    /// No peers, no secret, nothing retained: a lone indexer.
    pub fn none() -> Arc<Replication> {
        Replication::new(Vec::new(), None, false)
    }

    /// A reload's new list; recoveries already running keep the list they started with.
    pub fn set_peers(&self, peers: Vec<String>) {
        *self.peers.write() = peers.into();
    }

    pub fn peers(&self) -> Arc<[String]> {
        Arc::clone(&self.peers.read())
    }

    /// The secret in effect, shared with the HTTP APIs (a reload replaces it there too).
    pub fn secret(&self) -> &Arc<CurrentSecret> {
        &self.secret
    }

    pub fn retains_contents(&self) -> bool {
        self.retain
    }

    pub(super) fn fetcher(&self) -> &Fetcher {
        &self.fetcher
    }
}

/// `GET {peer}/snapshot/{engine}/{dp_rank}`, the engine name percent-encoded.
pub(super) fn snapshot_url(peer: &str, key: &WorkerKey) -> String {
    let mut engine = String::new();
    for byte in key.engine.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            engine.push(char::from(byte));
        } else {
            engine.push_str(&format!("%{byte:02X}"));
        }
    }
    format!("{peer}/snapshot/{engine}/{}", key.dp_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_names_are_percent_encoded_in_the_snapshot_url() {
        let key = WorkerKey {
            engine: "vllm a/b".into(),
            dp_rank: 3,
        };
        assert_eq!(
            snapshot_url("http://x:1", &key),
            "http://x:1/snapshot/vllm%20a%2Fb/3"
        );
    }
}
