//! `GET /snapshot/{engine}/{dp_rank}`: a rank's current state in the `/kv_recover` format, for
//! the other indexers that recover from this one (docs.md "Replicas", docs/design.md "Recovery
//! from a peer").
//!
//! Owns: every status the path answers (its guard is `indexer`'s table). Never: serves a rank
//! that is not whole (`active`), or a part of one.

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
            log::debug!(
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

/// `%XX` escapes decoded; `None` for a broken escape (a `%` not followed by two hex digits:
/// no sign, no space) or bytes that are not UTF-8. The `percent-encoding` crate decodes; it
/// passes a broken escape through as it is, so they are refused here first.
pub fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let escapes_whole = bytes.iter().enumerate().all(|(at, &byte)| {
        byte != b'%'
            || bytes
                .get(at + 1..at + 3)
                .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    if !escapes_whole {
        return None;
    }
    // Into a buffer of the text's size: `decode_utf8` grows its own from a few bytes, several
    // allocations for a short value (docs/performance.md "Why the percent-encoding crate").
    let mut decoded = Vec::with_capacity(bytes.len());
    decoded.extend(percent_encoding::percent_decode(bytes));
    String::from_utf8(decoded).ok()
}

#[cfg(test)]
mod tests {
    use super::percent_decode;

    #[test]
    fn percent_escapes_are_decoded_and_broken_ones_refused() {
        assert_eq!(percent_decode("vllm%20a%2Fb").as_deref(), Some("vllm a/b"));
        assert_eq!(
            percent_decode("plain-name_1").as_deref(),
            Some("plain-name_1")
        );
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(percent_decode("%+f"), None, "a sign is not a hex digit");
        assert_eq!(percent_decode("%-f"), None);
        assert_eq!(percent_decode("% f"), None);
        assert_eq!(percent_decode("%%41"), None);
        assert_eq!(percent_decode("100%"), None);
        assert_eq!(percent_decode("%41%e2%82%AC").as_deref(), Some("A€"));
    }
}
