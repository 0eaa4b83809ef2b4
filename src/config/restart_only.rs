//! The keys a running indexer reads at start only (docs.md "Reloading"), listed once.
//!
//! Owns: `RESTART_ONLY`, each such key with how to show its value and how to put the running
//! value back into a newly read file's `Config`, and `keep_restart_only`, what a reload calls:
//! every restart-only key the new file changes keeps its running value and is reported. Never:
//! logs (the reloader does, and `POST /reload` answers the list), or touches a reloadable key.

use std::fmt;

use super::Config;

/// One key read at start only.
pub struct RestartOnlyKey {
    /// As written in `indexer.toml`.
    pub key: &'static str,
    /// The value as a message shows it.
    shown: fn(&Config) -> String,
    /// Sets `into`'s value to `running`'s.
    keep: fn(into: &mut Config, running: &Config),
}

/// Every top-level key a reload cannot apply: what it sets is built once, at start (a bound
/// socket, the index's shape and cap, the Dynamo API's limit, whether ranks keep contents).
pub const RESTART_ONLY: [RestartOnlyKey; 10] = [
    RestartOnlyKey {
        key: "listen",
        shown: |config| config.listen.clone(),
        keep: |into, running| into.listen.clone_from(&running.listen),
    },
    RestartOnlyKey {
        key: "dynamo_listen",
        shown: |config| {
            let listen = config.dynamo_listen.as_deref();
            listen.unwrap_or("(none)").to_string()
        },
        keep: |into, running| into.dynamo_listen.clone_from(&running.dynamo_listen),
    },
    RestartOnlyKey {
        key: "max_runtime_ranks",
        shown: |config| config.max_runtime_ranks.to_string(),
        keep: |into, running| into.max_runtime_ranks = running.max_runtime_ranks,
    },
    RestartOnlyKey {
        key: "block_size",
        shown: |config| config.block_size.to_string(),
        keep: |into, running| into.block_size = running.block_size,
    },
    RestartOnlyKey {
        key: "max_blocks_per_rank",
        shown: |config| config.max_blocks_per_rank.to_string(),
        keep: |into, running| into.max_blocks_per_rank = running.max_blocks_per_rank,
    },
    RestartOnlyKey {
        key: "serve_snapshots",
        shown: |config| config.replicas.serve_snapshots.to_string(),
        keep: |into, running| into.replicas.serve_snapshots = running.replicas.serve_snapshots,
    },
    RestartOnlyKey {
        key: "state_dir",
        shown: |config| {
            let dir = config.state.dir.as_deref();
            dir.map_or_else(|| "(none)".to_string(), |dir| dir.display().to_string())
        },
        keep: |into, running| into.state.dir.clone_from(&running.state.dir),
    },
    RestartOnlyKey {
        key: "state_interval_s",
        shown: |config| config.state.interval_s.to_string(),
        keep: |into, running| into.state.interval_s = running.state.interval_s,
    },
    // The front end's socket: a `[route]` added by a reload starts nothing, and one removed
    // keeps serving, until a restart.
    RestartOnlyKey {
        key: "[route] listen",
        shown: |config| {
            let listen = config.route.as_ref().map(|route| route.listen.as_str());
            listen.unwrap_or("(none)").to_string()
        },
        keep: |into, running| match (&mut into.route, &running.route) {
            (Some(new), Some(old)) => new.listen.clone_from(&old.listen),
            (_, old) => into.route.clone_from(old),
        },
    },
    RestartOnlyKey {
        key: "[route] max_concurrent_requests",
        shown: |config| {
            let max = config.route.as_ref().map(|r| r.max_concurrent_requests);
            max.map_or_else(|| "(none)".to_string(), |max| max.to_string())
        },
        keep: |into, running| {
            if let (Some(new), Some(old)) = (&mut into.route, &running.route) {
                new.max_concurrent_requests = old.max_concurrent_requests;
            }
        },
    },
];

/// A restart-only key a reloaded file changed; displays as the reload's warning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartPending {
    pub key: &'static str,
    /// The value in effect, kept until a restart.
    pub running: String,
    /// The value the file now has.
    pub written: String,
}

impl fmt::Display for RestartPending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let RestartPending {
            key,
            running,
            written,
        } = self;
        write!(
            f,
            "{key} changed from {running} to {written}; restart kv-indexer to apply it \
             (keeping {running})"
        )
    }
}

/// Every restart-only key whose value `new` (a reloaded file) changes from `running` (the
/// configuration in effect), in `RESTART_ONLY` order, each set back to its running value in
/// `new`.
pub fn keep_restart_only(new: &mut Config, running: &Config) -> Vec<RestartPending> {
    RESTART_ONLY
        .iter()
        .filter_map(|restart_only| {
            let (written, in_effect) = ((restart_only.shown)(new), (restart_only.shown)(running));
            (written != in_effect).then(|| {
                (restart_only.keep)(new, running);
                RestartPending {
                    key: restart_only.key,
                    running: in_effect,
                    written,
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Replicas, Select, StateSettings};

    fn parse(text: &str) -> Config {
        Config::parse(text, "indexer.toml").unwrap_or_else(|err| panic!("{err}"))
    }

    const ROUTE: &str = "[route]\nlisten = \"127.0.0.1:9002\"\n";

    /// Each restart-only key: a running file, a file that changes only that key from it, and
    /// the new value as shown.
    const CHANGED: [(&str, &str, &str, &str); 10] = [
        (
            "listen",
            "",
            "listen = \"127.0.0.1:9000\"",
            "127.0.0.1:9000",
        ),
        (
            "dynamo_listen",
            "",
            "dynamo_listen = \"127.0.0.1:9001\"",
            "127.0.0.1:9001",
        ),
        ("max_runtime_ranks", "", "max_runtime_ranks = 8", "8"),
        ("block_size", "", "block_size = 32", "32"),
        (
            "max_blocks_per_rank",
            "",
            "max_blocks_per_rank = 1000",
            "1000",
        ),
        ("serve_snapshots", "", "serve_snapshots = true", "true"),
        (
            "state_dir",
            "",
            "state_dir = \"/var/lib/kv-indexer\"",
            "/var/lib/kv-indexer",
        ),
        ("state_interval_s", "", "state_interval_s = 5", "5"),
        ("[route] listen", "", ROUTE, "127.0.0.1:9002"),
        (
            "[route] max_concurrent_requests",
            ROUTE,
            "[route]\nlisten = \"127.0.0.1:9002\"\nmax_concurrent_requests = 7\n",
            "7",
        ),
    ];

    #[test]
    fn each_restart_only_key_changed_alone_is_reported_and_keeps_its_running_value() {
        let keys: Vec<&str> = RESTART_ONLY.iter().map(|k| k.key).collect();
        let tested: Vec<&str> = CHANGED.iter().map(|(key, ..)| *key).collect();
        assert_eq!(keys, tested, "every restart-only key is tested");
        let running = parse("");
        // Every top-level field, sorted: a new key does not compile here until it is listed in
        // `RESTART_ONLY` (and `CHANGED`) or known to reload (`service::reload`).
        let Config {
            listen: _,
            dynamo_listen: _,
            max_runtime_ranks: _,
            block_size: _,
            max_blocks_per_rank: _,
            replicas:
                Replicas {
                    serve_snapshots: _,
                    peers: _,
                    auth_token_file: _,
                },
            engines: _,
            select: Select { .. },
            // `[route]`: reloaded by the front end, but for `listen` and
            // `max_concurrent_requests` (above).
            route: _,
            state: StateSettings { .. },
        } = &running;
        for (key, running, changed, shown) in CHANGED {
            let running = parse(running);
            let mut new = parse(changed);
            let pending = keep_restart_only(&mut new, &running);
            assert_eq!(pending.len(), 1, "{key}: {pending:?}");
            assert_eq!((pending[0].key, pending[0].written.as_str()), (key, shown));
            assert_eq!(new, running, "{key} keeps its running value");
        }
        // A `[route]` removed by a reload keeps serving until a restart.
        let mut removed = parse("");
        let pending = keep_restart_only(&mut removed, &parse(ROUTE));
        assert_eq!(pending[0].to_string(), "[route] listen changed from 127.0.0.1:9002 to (none); restart kv-indexer to apply it (keeping 127.0.0.1:9002)");
        assert_eq!(removed, parse(ROUTE));
    }

    #[test]
    fn the_warning_names_the_key_both_values_and_what_stays() {
        let mut new =
            parse("block_size = 32\nmax_runtime_ranks = 8\npeers = [\"http://10.0.0.9:8090\"]\n");
        let pending = keep_restart_only(&mut new, &parse(""));
        let warnings: Vec<String> = pending.iter().map(ToString::to_string).collect();
        assert_eq!(
            warnings,
            [
                "max_runtime_ranks changed from 1024 to 8; restart kv-indexer to apply it (keeping 1024)",
                "block_size changed from 16 to 32; restart kv-indexer to apply it (keeping 16)",
            ]
        );
        assert_eq!(new.replicas.peers, ["http://10.0.0.9:8090"], "peers reload");
        let mut same = parse("");
        assert_eq!(keep_restart_only(&mut same, &parse("")), []);
    }
}
