//! The `POST /select` request (docs.md "Selection"): the `/query` body in either form, read by
//! `query_body` unchanged, plus `reserve` and `expected_output_tokens` — JSON fields of a JSON
//! body, query-string parameters of the binary one — and the `prefill_complete` body.
//!
//! Owns: those fields and every rejection of them, each naming the field. Never: reads the
//! `/query` fields itself (a body `/query` accepts, `/select` accepts alike), or takes a JSON
//! field from the query string or a binary body's parameter from nowhere but the query string.

use serde::de::{Deserializer, Error as _};
use serde::Deserialize;

use super::form::form_pairs;
use super::query_body::{is_binary, parse_query_request, QueryRequest};
use super::BadBody;
use crate::select::Options;

/// The extra parameters in the query string of a binary body.
const RESERVE: &str = "reserve";
const EXPECTED_OUTPUT_TOKENS: &str = "expected_output_tokens";

/// Parses a `/select` request: the `/query` request (`parse_query_request`) and the options.
pub(super) fn parse_select_request(
    content_type: Option<&str>,
    query_string: Option<&str>,
    body: &[u8],
    tokens: Vec<u32>,
) -> Result<(QueryRequest, Options), BadBody> {
    if is_binary(content_type) {
        let (options, rest) = query_string_options(query_string.unwrap_or_default())?;
        let query = parse_query_request(content_type, Some(&rest), body, tokens)?;
        Ok((query, options))
    } else {
        let query = parse_query_request(content_type, query_string, body, tokens)?;
        Ok((query, json_options(body)?))
    }
}

#[derive(Deserialize)]
struct JsonOptions {
    #[serde(default, deserialize_with = "reserve")]
    reserve: Option<bool>,
    #[serde(default, deserialize_with = "expected_output_tokens")]
    expected_output_tokens: Option<u64>,
}

fn reserve<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<bool>, D::Error> {
    Option::<bool>::deserialize(deserializer).map_err(|err| D::Error::custom(named(RESERVE, err)))
}

fn expected_output_tokens<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    Option::<u64>::deserialize(deserializer)
        .map_err(|err| D::Error::custom(named(EXPECTED_OUTPUT_TOKENS, err)))
}

fn named(field: &str, err: impl std::fmt::Display) -> String {
    format!("{field}: {err} (a non-negative integer, or true / false for reserve)")
}

/// The options of a JSON body, which `parse_query_request` already found valid. Read with a
/// second pass only when the body can hold them: either name, or an escape that could spell
/// one, must be in it; a plain `/query` body costs one substring search.
fn json_options(body: &[u8]) -> Result<Options, BadBody> {
    let may_hold = memchr::memchr(b'\\', body).is_some()
        || memchr::memmem::find(body, b"\"reserve\"").is_some()
        || memchr::memmem::find(body, b"\"expected_output_tokens\"").is_some();
    if !may_hold {
        return Ok(Options::default());
    }
    let read: JsonOptions = serde_json::from_slice(body).map_err(|err| {
        let text = err.to_string();
        // serde_json appends the position; the message already names the field.
        let position = format!(" at line {} column {}", err.line(), err.column());
        BadBody::Field(text.strip_suffix(&position).unwrap_or(&text).to_owned())
    })?;
    Ok(Options {
        reserve: read.reserve.unwrap_or(false),
        expected_output_tokens: read.expected_output_tokens.unwrap_or(0),
        unlinked: false,
    })
}

/// `reserve` and `expected_output_tokens` taken out of a binary body's query string (names
/// decoded as `query_body` decodes them), and the rest of it for `parse_query_request`.
fn query_string_options(query_string: &str) -> Result<(Options, String), BadBody> {
    let mut options = Options::default();
    let (mut reserve, mut expected) = (None, None);
    let mut rest = Vec::new();
    for pair in form_pairs(query_string) {
        // A name that does not decode is none of these: `parse_query_request` refuses it.
        let Ok(name) = pair.name() else {
            rest.push(pair.text);
            continue;
        };
        let slot = match name.as_str() {
            RESERVE => &mut reserve,
            EXPECTED_OUTPUT_TOKENS => &mut expected,
            _ => {
                rest.push(pair.text);
                continue;
            }
        };
        pair.fill(slot, name)?;
    }
    if let Some(value) = reserve {
        options.reserve = match value.as_str() {
            "true" => true,
            "false" => false,
            _ => return Err(BadBody::Reserve(value)),
        };
    }
    if let Some(value) = expected {
        options.expected_output_tokens = value
            .parse()
            .map_err(|_| BadBody::ExpectedOutputTokens(value))?;
    }
    Ok((options, rest.join("&")))
}

/// The optional body of `POST /reservations/{id}/prefill_complete`: empty, or
/// `{"cached_tokens": N}`, the engine's own count (vLLM's
/// `usage.prompt_tokens_details.cached_tokens`).
pub(super) fn parse_prefill_complete(body: &[u8]) -> Result<Option<u64>, BadBody> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Completed {
        #[serde(default, deserialize_with = "cached_tokens")]
        cached_tokens: Option<u64>,
    }
    fn cached_tokens<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        Option::<u64>::deserialize(deserializer).map_err(|err| {
            D::Error::custom(format!("cached_tokens: {err} (a non-negative integer)"))
        })
    }
    match body.iter().find(|byte| !byte.is_ascii_whitespace()) {
        None => return Ok(None),
        // serde reads a struct from an array too; this body is an object or nothing.
        Some(b'{') => {}
        Some(_) => return Err(BadBody::ObjectOrNothing),
    }
    match serde_json::from_slice::<Completed>(body) {
        Ok(completed) => Ok(completed.cached_tokens),
        Err(err) => Err(BadBody::Value {
            place: "body".to_owned(),
            why: err.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(body: &str) -> Result<Options, BadBody> {
        parse_select_request(None, None, body.as_bytes(), Vec::new()).map(|(_, options)| options)
    }

    #[test]
    fn json_options_sit_beside_the_query_fields() {
        assert_eq!(json(r#"{"token_ids": [1, 2]}"#), Ok(Options::default()));
        assert_eq!(
            json(r#"{"token_ids": [1], "reserve": true, "expected_output_tokens": 300}"#),
            Ok(Options {
                reserve: true,
                expected_output_tokens: 300,
                unlinked: false,
            })
        );
        // An escaped name is the same name.
        assert_eq!(
            json(r#"{"token_ids": [1], "reser\u0076e": true}"#).map(|o| o.reserve),
            Ok(true)
        );
        assert_eq!(
            json(r#"{"token_ids": [1], "reserve": null}"#),
            Ok(Options::default())
        );
    }

    #[test]
    fn every_rejection_names_its_field() {
        for (body, field) in [
            (
                r#"{"token_ids": [1], "reserve": "yes"}"#,
                "reserve: invalid type",
            ),
            (
                r#"{"token_ids": [1], "expected_output_tokens": -3}"#,
                "expected_output_tokens: invalid value",
            ),
            (
                r#"{"token_ids": [1], "expected_output_tokens": 1.5}"#,
                "expected_output_tokens: invalid type",
            ),
            (r#"{"reserve": true}"#, "token_ids: missing"),
            (r#"{"token_ids": ["a"], "reserve": true}"#, "token_ids"),
        ] {
            match json(body) {
                Err(reason) => assert!(reason.to_string().starts_with(field), "{body}: {reason}"),
                Ok(options) => panic!("{body} accepted as {options:?}"),
            }
        }
    }

    #[test]
    fn binary_options_come_from_the_query_string_and_the_rest_goes_to_query_body() {
        let body: Vec<u8> = [5u32, 6].iter().flat_map(|t| t.to_le_bytes()).collect();
        let binary = Some("application/octet-stream");
        let (query, options) = parse_select_request(
            binary,
            Some("model=m&reserve=true&expected_%6Futput_tokens=17"),
            &body,
            Vec::new(),
        )
        .unwrap_or_else(|reason| panic!("{reason}"));
        assert_eq!(query.token_ids, [5, 6]);
        assert_eq!(query.model.as_deref(), Some("m"));
        assert_eq!(
            options,
            Options {
                reserve: true,
                expected_output_tokens: 17,
                unlinked: false,
            }
        );
        for (query_string, reason) in [
            (
                "reserve=1",
                "query parameter reserve: expected true or false",
            ),
            (
                "expected_output_tokens=x",
                "query parameter expected_output_tokens",
            ),
            (
                "reserve=true&reserve=false",
                "query parameter reserve is given more",
            ),
            (
                "modle=m&reserve=true",
                "query parameter \"modle\" is not known",
            ),
        ] {
            match parse_select_request(binary, Some(query_string), &body, Vec::new()) {
                Err(refused) => assert!(refused.to_string().starts_with(reason), "{refused}"),
                Ok(accepted) => panic!("{query_string} accepted as {accepted:?}"),
            }
        }
    }

    #[test]
    fn a_prefill_complete_body_is_empty_or_cached_tokens() {
        assert_eq!(parse_prefill_complete(b""), Ok(None));
        assert_eq!(parse_prefill_complete(b" \n"), Ok(None));
        assert_eq!(
            parse_prefill_complete(br#"{"cached_tokens": 64}"#),
            Ok(Some(64))
        );
        assert_eq!(parse_prefill_complete(b"{}"), Ok(None));
        for (body, reason) in [
            (
                &br#"{"cached_tokens": -1}"#[..],
                "body: cached_tokens: invalid value",
            ),
            (br#"{"cached": 1}"#, "body: unknown field `cached`"),
            (b"[1]", "body: expected a JSON object"),
        ] {
            match parse_prefill_complete(body) {
                Err(refused) => assert!(refused.to_string().starts_with(reason), "{refused}"),
                Ok(accepted) => panic!("accepted as {accepted:?}"),
            }
        }
    }
}
