//! The one starting point of every HTTP request the indexer makes (discovery's questions to
//! engines, snapshot fetches from engines and peers).
//!
//! Owns: the settings all of them share: no proxy (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`
//! and their lower-case forms are ignored: engines and peers are on the cluster network, peer
//! requests carry the bearer token and snapshots carry users' token ids, none of which may go
//! through a proxy meant for the internet), no redirect followed, statuses as values, and the
//! user agent. Never: sends a request or sets a time limit (each caller knows its own).

use ureq::config::ConfigBuilder;
use ureq::typestate::AgentScope;

/// A `ureq` agent configuration with the shared settings; callers add their time limits and
/// `build()` it.
pub fn agent_config() -> ConfigBuilder<AgentScope> {
    ureq::Agent::config_builder()
        // Never from the environment: see the module comment.
        .proxy(None)
        // A redirect is answered with an error at its first hop, so a loop ends at once; no
        // engine or peer route has a reason to redirect.
        .max_redirects(0)
        // Statuses are the caller's errors, with the URL and a hint, not ureq's.
        .http_status_as_error(false)
        .user_agent(concat!("kv-indexer/", env!("CARGO_PKG_VERSION")))
}
