//! `GET /snapshot/{engine}/{dp_rank}`: a rank's current state in the `/kv_recover` format, for
//! the other indexers that recover from this one (docs.md "Replicas", docs/design.md "Recovery
//! from a peer").
//!
//! Owns: every status the path answers (its guard is `indexer`'s table). Never: serves a rank
//! that is not whole (`active`), or a part of one.

use super::form::percent_decode;
use super::IndexerApi;
use crate::listener::Unservable;
use crate::serve::Reply;

/// `engine` (percent-encoded) and `dp_rank` are the path's segments; the table has checked the
/// method and the secret.
pub(super) fn snapshot(api: &IndexerApi, engine: &str, dp_rank: &str) -> Reply {
    let parsed = percent_decode(engine).zip(dp_rank.parse::<u32>().ok());
    let Some((engine, dp_rank)) = parsed else {
        return Reply::error(
            404,
            format!(
                "no such rank: /snapshot/{engine}/{dp_rank}; expected \
                 /snapshot/{{engine}}/{{dp_rank}} with a number for dp_rank"
            ),
        );
    };
    let Some(handle) = api.ranks.current().handle(&engine, dp_rank) else {
        return Reply::error(404, format!("no running rank {engine}/{dp_rank}"));
    };
    match handle.snapshot() {
        Ok(served) => {
            tracing::debug!(
                "served the snapshot of {engine}/{dp_rank}: {} blocks, {} orphans left out, \
                 {} bytes",
                served.blocks,
                served.orphans,
                served.body.len()
            );
            Reply::bytes(200, served.body, "application/json")
        }
        Err(Unservable::NotRetained) => Reply::error(
            409,
            "this indexer keeps no block contents, so it serves no snapshots: set \
             serve_snapshots = true (or peers) in its indexer.toml and restart it",
        ),
        Err(Unservable::NotWhole(state)) => Reply::error(
            503,
            format!(
                "rank {engine}/{dp_rank} is {}: it has nothing trustworthy to serve",
                state.as_str()
            ),
        ),
    }
}
