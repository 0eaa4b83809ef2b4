//! The top-level keys of an indexer that runs beside other replicas (docs.md "Replicas"):
//! `peers`, `serve_snapshots` and `auth_token_file`.
//!
//! Owns their shapes and checks: a peer is an `http://host:port` base URL, a token file is a
//! path, read at start (`read_auth_token`; a check never touches the file system). It never
//! opens a socket and never puts a token in a message.

use toml::Spanned;

use super::diagnostics::Problems;
use super::read_token_file;

/// The replica keys, validated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replicas {
    /// Base URLs of the other indexers (`http://host:port`, no trailing slash), asked for a
    /// rank's snapshot when the engine's replay cannot fill a hole. Reloadable.
    pub peers: Vec<String>,
    /// Serve `GET /snapshot/{engine}/{dp_rank}` even with no `peers` of our own.
    pub serve_snapshots: bool,
    /// The file holding the shared secret of the snapshot, reload and registration routes.
    pub auth_token_file: Option<String>,
}

impl Replicas {
    /// Whether each rank keeps what a snapshot needs (token ids per block): when this replica
    /// asks peers (so it can answer them back) or is told to serve.
    pub fn retains_contents(&self) -> bool {
        self.serve_snapshots || !self.peers.is_empty()
    }

    /// The text of `auth_token_file`, when set; the error names the file, never its content.
    pub fn read_auth_token(&self) -> anyhow::Result<Option<String>> {
        read_token_file(
            self.auth_token_file.as_deref(),
            "auth_token_file",
            "the shared token",
        )
    }
}

/// Whether an HTTP `listen` address only accepts connections from this host.
pub fn is_loopback_listen(listen: &str) -> bool {
    super::listen::listen_host_port(listen).is_ok_and(|(host, _)| host.is_loopback())
}

/// Checks `peers`, `serve_snapshots` and `auth_token_file`; `None` when any is wrong (reported).
pub(super) fn check_replicas(
    peers: Option<Spanned<Vec<Spanned<String>>>>,
    serve_snapshots: Option<Spanned<bool>>,
    auth_token_file: Option<Spanned<String>>,
    dropped: &[String],
    problems: &mut Problems<'_>,
) -> Option<Replicas> {
    let mut ok = !dropped.iter().any(|key| {
        matches!(
            key.as_str(),
            "peers" | "serve_snapshots" | "auth_token_file"
        )
    });
    let mut urls = Vec::new();
    for peer in peers.map(Spanned::into_inner).unwrap_or_default() {
        match peer_url(peer.get_ref()) {
            Ok(url) if urls.contains(&url) => {
                problems.add(
                    Some(peer.span()),
                    "",
                    format!("`peers`: {url} is listed twice"),
                );
                ok = false;
            }
            Ok(url) => urls.push(url),
            Err(why) => {
                problems.add(Some(peer.span()), "", format!("`peers`: {why}"));
                ok = false;
            }
        }
    }
    let token_file = match auth_token_file {
        Some(path) if path.get_ref().trim().is_empty() => {
            problems.add(Some(path.span()), "", "`auth_token_file` is empty");
            ok = false;
            None
        }
        other => other.map(Spanned::into_inner),
    };
    ok.then(|| Replicas {
        peers: urls,
        serve_snapshots: serve_snapshots.is_some_and(Spanned::into_inner),
        auth_token_file: token_file,
    })
}

/// What every refusal of a peer's URL ends with.
const PEER_EXPECTED: &str = "expected http://host:port (another indexer's `listen`)";

/// Why a `peers` entry is refused; each message quotes it.
#[derive(Debug, thiserror::Error)]
enum PeerUrlError {
    #[error("{0:?} does not start with http://; {PEER_EXPECTED}")]
    NotHttp(String),
    #[error("{0:?} has a path; {PEER_EXPECTED}")]
    Path(String),
    #[error("{source} in {text:?}")]
    Listen {
        text: String,
        source: super::ListenError,
    },
}

/// `http://host:port` with an optional trailing slash, normalised without it. No path: the
/// snapshot route is appended to it.
fn peer_url(text: &str) -> Result<String, PeerUrlError> {
    let Some(rest) = text.strip_prefix("http://") else {
        return Err(PeerUrlError::NotHttp(text.to_string()));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains('/') || authority.contains('?') {
        return Err(PeerUrlError::Path(text.to_string()));
    }
    super::validate_listen(authority).map_err(|source| PeerUrlError::Listen {
        text: text.to_string(),
        source,
    })?;
    Ok(format!("http://{authority}"))
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{find, problems};
    use crate::config::Config;

    #[test]
    fn peers_are_normalised_base_urls_and_retention_follows_them() {
        let config = Config::parse(
            "peers = [\"http://10.0.0.9:8090/\", \"http://indexer-b:8090\"]\n",
            "f",
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(
            config.replicas.peers,
            ["http://10.0.0.9:8090", "http://indexer-b:8090"]
        );
        assert!(config.replicas.retains_contents());
        let plain = Config::parse("", "f").unwrap_or_else(|err| panic!("{err}"));
        assert!(!plain.replicas.retains_contents());
        let serving = Config::parse("serve_snapshots = true\nauth_token_file = \"/t\"\n", "f")
            .unwrap_or_else(|err| panic!("{err}"));
        assert!(serving.replicas.retains_contents());
        assert_eq!(serving.replicas.auth_token_file.as_deref(), Some("/t"));
    }

    #[test]
    fn loopback_listen_addresses_are_told_apart() {
        for local in [
            "127.0.0.1:8090",
            "[::1]:8090",
            "localhost:80",
            "127.1.2.3:1",
        ] {
            assert!(super::is_loopback_listen(local), "{local}");
        }
        for open in ["0.0.0.0:8090", "[::]:8090", "10.0.0.9:8090", "indexer:8090"] {
            assert!(!super::is_loopback_listen(open), "{open}");
        }
    }

    #[test]
    fn bad_peers_and_token_files_are_reported_with_their_line() {
        let text = "peers = [\"10.0.0.9:8090\",\n \"http://a:1/snapshot\",\n \"http://a:1\", \"http://a:1/\"]\nauth_token_file = \"\"\nserve_snapshots = \"yes\"\n";
        let found = problems(text);
        find(&found, &["indexer.toml:1:", "`peers`", "http://"]);
        find(&found, &["indexer.toml:2:", "`peers`", "has a path"]);
        find(&found, &["indexer.toml:3:", "`peers`", "twice"]);
        find(&found, &["indexer.toml:4:", "`auth_token_file` is empty"]);
        find(&found, &["indexer.toml:5:", "`serve_snapshots`"]);
        assert_eq!(found.len(), 5, "{found:#?}");
    }
}
