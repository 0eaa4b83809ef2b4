//! A choice explained (docs.md "Explaining a choice"): asked with the request header
//! `x-kv-indexer-explain: 1`, answered with a response header of the same name holding, as
//! one line of JSON, the policy, the prompt's blocks, and the chosen and runner-up ranks with
//! their cost terms as `/select` lists them.
//!
//! Owns the header's name and its text. Never: chooses, shows a term the selection did not
//! weigh, or decides who may ask (every request past the route's token may).

use hyper::header::HeaderValue;
use hyper::Response;
use serde::Serialize;

use crate::api::CandidateJson;
use crate::select::Selection;
use crate::serve::{AnswerBody, Request};

/// The request header that asks, and the response header that answers.
pub const HEADER: &str = "x-kv-indexer-explain";

#[derive(Serialize)]
struct Explained<'a> {
    policy: &'a str,
    query_blocks: u32,
    chosen: CandidateJson<'a>,
    runner_up: Option<CandidateJson<'a>>,
}

/// Whether `request` asks for its choice explained.
pub fn asked(request: &Request) -> bool {
    request
        .header(HEADER)
        .is_some_and(|value| value.trim() == "1")
}

/// `answer`, with the choice explained when the request asked: `asked` is then its selection.
pub fn explaining(
    mut answer: Response<AnswerBody>,
    asked: Option<&Selection>,
) -> Response<AnswerBody> {
    if let Some(value) =
        asked.and_then(|selection| HeaderValue::from_str(&explained(selection)).ok())
    {
        answer.headers_mut().insert(HEADER, value);
    }
    answer
}

/// `selection` explained, as a header's value: JSON with every character past ASCII escaped
/// (an engine's name or a stale scrape's reason may hold one, and a header may not).
fn explained(selection: &Selection) -> String {
    let explained = Explained {
        policy: selection.policy,
        query_blocks: selection.query_blocks,
        chosen: CandidateJson::new(&selection.chosen),
        runner_up: selection.runner_up.as_ref().map(CandidateJson::new),
    };
    let json = serde_json::to_string(&explained).unwrap_or_default();
    ascii(&json)
}

/// `json` with each character past ASCII as its `\uXXXX` escape(s): the same JSON (such a
/// character can only be inside a string).
fn ascii(json: &str) -> String {
    let mut escaped = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() {
            escaped.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                escaped.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::ascii;

    #[test]
    fn characters_past_ascii_are_escaped_into_the_same_json() {
        let json = serde_json::to_string(&serde_json::json!({ "rank": "moteur-é/𝄞" }))
            .expect("serializable");
        let escaped = ascii(&json);
        assert!(escaped.is_ascii(), "{escaped}");
        let back: serde_json::Value = serde_json::from_str(&escaped).expect("still JSON");
        assert_eq!(back["rank"], "moteur-é/𝄞");
    }
}
