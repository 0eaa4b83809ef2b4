//! The shared secrets (docs.md "Replicas", "Routing"): the admin token of `auth_token_file`,
//! the route front end's `[route] auth_token_file` and the engines' `api_key_file` keys, as
//! read from their files, and what counts as presenting one.
//!
//! Owns: `Secret` (never printed: its `Debug` is redacted), the secret in effect that a reload
//! swaps (`CurrentSecret`), reading `Authorization: Bearer <token>`, and the constant-time
//! comparison. Never: logs or echoes a token (presented or configured), reads a file or a
//! request itself (callers hand it the text), or lets the time a comparison takes depend on
//! where the bytes differ.

use std::fmt;

use parking_lot::RwLock;

/// The shared secret of `auth_token_file`. Never logged: `Debug` prints a placeholder.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The token as read from its file, trimmed of surrounding whitespace (the file's final
    /// newline); `None` when nothing is left.
    pub fn from_file_text(text: &str) -> Option<Secret> {
        let token = text.trim();
        (!token.is_empty()).then(|| Secret(token.to_owned()))
    }

    /// The token itself, for the `Authorization` header and the constant-time comparison.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The secret in effect: read by every guarded route and peer fetch, replaced by a reload
/// that re-read `auth_token_file`.
#[derive(Default)]
pub struct CurrentSecret(RwLock<Option<Secret>>);

impl CurrentSecret {
    pub fn get(&self) -> Option<Secret> {
        self.0.read().clone()
    }

    /// Puts `secret` in effect; whether it differs from the one it replaces.
    pub fn set(&self, secret: Option<Secret>) -> bool {
        let mut current = self.0.write();
        let changed = *current != secret;
        *current = secret;
        changed
    }
}

impl CurrentSecret {
    /// `secret` in effect from the start.
    pub fn new(secret: Option<Secret>) -> CurrentSecret {
        CurrentSecret(RwLock::new(secret))
    }
}

/// Whether an `Authorization` header's value presents `secret`: always when no secret is
/// configured, else only `Bearer <the secret>` (scheme case-insensitive, RFC 7235).
pub fn authorized(authorization: Option<&str>, secret: Option<&Secret>) -> bool {
    let Some(secret) = secret else {
        return true;
    };
    let presented = authorization.and_then(|value| {
        let (scheme, token) = value.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    presented.is_some_and(|token| constant_time_eq(token.as_bytes(), secret.expose().as_bytes()))
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
    fn the_secret_never_prints_and_is_trimmed() {
        let secret = Secret::from_file_text("  s3cret\n").expect("a token");
        assert_eq!(secret.expose(), "s3cret");
        assert!(!format!("{secret:?}").contains("s3cret"));
        assert_eq!(Secret::from_file_text(" \n"), None);
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secret!", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(constant_time_eq(b"", b""));
    }
}
