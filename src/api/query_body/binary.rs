//! The binary `/query` body (docs.md "HTTP API"), for routers that care about the tail: with
//! `Content-Type: application/octet-stream` the body is the prompt's token ids as little-endian
//! u32 and nothing else, and `model`, `lora_name` and `cache_salt` come from the query string.
//! A 12,000-token prompt is then 48,000 bytes read by a bounds check and a copy, instead of
//! ~84 KiB of JSON scanned digit by digit (docs/performance.md "Why a binary `/query` body"
//! measures both).
//!
//! Owns: the byte order, the query-string parameters and every rejection of either. Never:
//! accepts a length that is not a multiple of 4, a parameter it does not know or a repeated
//! one (a typo would silently query another prompt), or multimodal items (JSON-only: an item's
//! identifier and placement have no place in a flat array of u32); never panics on what a
//! client sends.

use super::QueryRequest;
use crate::api::form::form_pairs;
use crate::api::BadBody;

/// The media type of the binary body; any other (or none) is JSON, so a client that names no
/// type keeps the JSON body.
pub(in crate::api) const OCTET_STREAM: &str = "application/octet-stream";
/// What a token id takes in the binary body.
const TOKEN_BYTES: usize = std::mem::size_of::<u32>();

/// Whether a `Content-Type` names the binary body: its media type, case-insensitive, with
/// any parameters (`; charset=...`) ignored.
pub(in crate::api) fn is_binary(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|value| {
        let media_type = value.split(';').next().unwrap_or_default();
        media_type.trim().eq_ignore_ascii_case(OCTET_STREAM)
    })
}

/// Reads a binary body into `tokens` (cleared first) and
/// its options from `query_string` (the URL after `?`, if any); the error is the 400's message.
pub(super) fn parse_binary(
    query_string: Option<&str>,
    body: &[u8],
    mut tokens: Vec<u32>,
) -> Result<QueryRequest, BadBody> {
    let mut query = options(query_string.unwrap_or_default())?;
    if body.len() % TOKEN_BYTES != 0 {
        return Err(BadBody::BinaryLength(body.len()));
    }
    tokens.clear();
    tokens.extend(
        body.chunks_exact(TOKEN_BYTES)
            .map(|bytes| u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])),
    );
    query.token_ids = tokens;
    Ok(query)
}

/// `model`, `lora_name` and `cache_salt` from the query string's pairs (`form`).
fn options(query_string: &str) -> Result<QueryRequest, BadBody> {
    let mut query = QueryRequest::default();
    for pair in form_pairs(query_string) {
        let name = pair.name()?;
        let slot = match name.as_str() {
            "model" => &mut query.model,
            "lora_name" => &mut query.lora_name,
            "cache_salt" => &mut query.cache_salt,
            "mm_features" => return Err(BadBody::MmFeaturesInQueryString),
            _ => return Err(BadBody::UnknownParameter(name)),
        };
        pair.fill(slot, name)?;
    }
    Ok(query)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le_bytes(tokens: &[u32]) -> Vec<u8> {
        tokens
            .iter()
            .flat_map(|token| token.to_le_bytes())
            .collect()
    }

    #[test]
    fn the_content_type_is_matched_by_its_media_type_alone() {
        for binary in [
            "application/octet-stream",
            "Application/Octet-Stream",
            " application/octet-stream ; charset=binary",
        ] {
            assert!(is_binary(Some(binary)), "{binary}");
        }
        for json in [
            "application/json",
            "text/plain",
            "application/octet-streams",
            "",
        ] {
            assert!(!is_binary(Some(json)), "{json}");
        }
        assert!(!is_binary(None));
    }

    #[test]
    fn tokens_are_little_endian_and_options_come_from_the_query_string() {
        let tokens = [0, 1, 256, 0x0102_0304, u32::MAX];
        let query = parse_binary(
            Some("model=Qwen%2FQwen3-8B&lora_name=my+adapter&cache_salt=a%2Bb%20c&&"),
            &le_bytes(&tokens),
            Vec::new(),
        );
        assert_eq!(
            query,
            Ok(QueryRequest {
                token_ids: tokens.to_vec(),
                model: Some("Qwen/Qwen3-8B".into()),
                lora_name: Some("my adapter".into()),
                cache_salt: Some("a+b c".into()),
                mm_features: Vec::new(),
                text: None,
            })
        );
        assert_eq!(
            parse_binary(None, &[], vec![7, 8, 9]),
            Ok(QueryRequest::default()),
            "the reused vector is cleared"
        );
        assert_eq!(
            parse_binary(Some("model"), &[], Vec::new()).map(|query| query.model),
            Ok(Some(String::new()))
        );
    }

    #[test]
    fn every_rejection_names_what_was_wrong() {
        let cases = [
            (None, 7, "body is 7 bytes, not a multiple of 4"),
            (Some("modle=m"), 0, "query parameter \"modle\" is not known"),
            (
                Some("token_ids=1"),
                0,
                "query parameter \"token_ids\" is not known",
            ),
            (
                Some("mm_features=x"),
                0,
                "query parameter mm_features: multimodal",
            ),
            (
                Some("model=a&model=b"),
                0,
                "query parameter model is given more than once",
            ),
            (
                Some("model=a%2"),
                0,
                "query parameter \"model=a%2\" is not percent-encoded",
            ),
            (
                Some("model=%zz"),
                0,
                "query parameter \"model=%zz\" is not percent-encoded",
            ),
            // `+` is a space before escapes are read: "% f" is no escape.
            (
                Some("model=%+f"),
                0,
                "query parameter \"model=%+f\" is not percent-encoded",
            ),
            (
                Some("model=%ff"),
                0,
                "query parameter \"model=%ff\" is not percent-encoded",
            ),
            (
                Some("%6dodel=a%"),
                0,
                "query parameter \"%6dodel=a%\" is not percent-encoded",
            ),
        ];
        for (query_string, length, reason) in cases {
            let refused = parse_binary(query_string, &vec![0; length], Vec::new());
            match refused {
                Err(refused) => assert!(refused.to_string().starts_with(reason), "{refused}"),
                Ok(query) => panic!("{query_string:?} accepted as {query:?}"),
            }
        }
    }
}
