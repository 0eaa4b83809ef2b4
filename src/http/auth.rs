//! The shared secret of the routes that reveal cache contents or change state (docs.md
//! "Replicas"): `GET /snapshot/...`, `POST /reload`, a reserving `POST /select` and the
//! reservation routes, and any registration route (the Dynamo API's `/register` and
//! `/unregister` must call `is_authorized` too).
//!
//! Owns: what counts as a valid `Authorization: Bearer <token>` and the constant-time
//! comparison. Never: logs or echoes a token (presented or configured), or lets the time a
//! comparison takes depend on where the bytes differ.

use super::{Reply, Request};
use crate::listener::Secret;

/// Whether `request` may use a guarded route: always when no secret is configured, else only
/// with `Authorization: Bearer <the secret>` (scheme case-insensitive, RFC 7235).
pub fn is_authorized(request: &Request, secret: Option<&Secret>) -> bool {
    let Some(secret) = secret else {
        return true;
    };
    let presented = request.header("Authorization").and_then(|value| {
        let (scheme, token) = value.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    presented.is_some_and(|token| constant_time_eq(token.as_bytes(), secret.expose().as_bytes()))
}

/// The 401 a guarded route answers without the secret (counted in `http_errors_total`), with
/// the challenge RFC 7235 requires of every 401.
pub(crate) fn unauthorized() -> Reply {
    let mut reply = Reply::error(
        401,
        "this route requires Authorization: Bearer <token> (the indexer's auth_token_file)",
    );
    reply.header = Some(("WWW-Authenticate", "Bearer realm=\"kv-indexer\""));
    reply
}

/// Equality whose time depends only on the lengths: every byte is looked at, differences are
/// OR-ed together, and nothing branches on them. A length mismatch is answered at once, which
/// reveals only the length (a 32-byte random token's length is no secret). Written here rather
/// than taken from `subtle`: these eight lines are all this needs.
pub fn constant_time_eq(presented: &[u8], expected: &[u8]) -> bool {
    if presented.len() != expected.len() {
        return false;
    }
    let difference = presented
        .iter()
        .zip(expected)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secret!", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(constant_time_eq(b"", b""));
    }
}
