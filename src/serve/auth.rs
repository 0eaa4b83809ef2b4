//! The guard of the paths that reveal cache contents or change state (docs.md "Replicas"):
//! `GET /snapshot/...`, `POST /reload`, a reserving `POST /select` and the reservation paths,
//! and any registration path (the Dynamo API's `/register` and `/unregister`): a path table's
//! `Guard::Secret`, or a handler that calls `is_authorized` itself.
//!
//! Owns: the guard's check of a request (`crate::auth` decides what a valid token is) and the
//! 401 it answers. Never: logs or echoes a token (presented or configured).

use super::{Reply, Request};
use crate::auth::Secret;

/// Whether `request` may use a guarded path: always when no secret is configured, else only
/// with `Authorization: Bearer <the secret>` (scheme case-insensitive, RFC 7235).
pub fn is_authorized(request: &Request, secret: Option<&Secret>) -> bool {
    crate::auth::authorized(request.header("Authorization"), secret)
}

/// The 401 a guarded path answers without the secret (counted in `http_errors_total`), with
/// the challenge RFC 7235 requires of every 401.
pub(crate) fn unauthorized() -> Reply {
    Reply::error(
        401,
        "this route requires Authorization: Bearer <token> (the indexer's auth_token_file)",
    )
    .with_header("WWW-Authenticate", "Bearer realm=\"kv-indexer\"")
}
