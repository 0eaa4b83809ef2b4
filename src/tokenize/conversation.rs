//! The messages a chat template is given, made from a request's `messages` as vLLM makes them
//! (`chat_utils.parse_chat_messages`), so that the rendered text is the engine's.
//!
//! vLLM does not hand the template the request's messages: it builds each anew from `role`,
//! `content` in the template's form (`content_format`: text parts joined with "\n", or a list
//! of text parts; a `null` or absent content is "" or no parts), `name` and `task` when they
//! are strings, and `tools` for a `developer` message, and drops every other field. Owns that
//! building, and which chats it cannot build exactly: a tool-call turn, a `tool` message, a part
//! that is not text (an image, audio, a file, a refusal), an assistant's reasoning, a
//! developer's tools (vLLM versions and its request models reshape those): `Unreadable`, routed
//! by load alone, never guessed. A shape that is not an OpenAI chat is `Refused`, naming the
//! field. Never: renders or tokenizes.

use serde_json::{Map, Value};

use super::content_format::ContentFormat;
use super::model::{EncodeError, PromptError};

/// `messages` as vLLM gives them to a template whose content format is `format`.
pub fn conversation(messages: &Value, format: ContentFormat) -> Result<Value, EncodeError> {
    let Some(list) = messages.as_array() else {
        return Err(refused("messages", "must be an array of messages"));
    };
    if list.is_empty() {
        return Err(refused("messages", "is empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, message)| conversation_message(i, message, format))
        .collect::<Result<Vec<Value>, EncodeError>>()
        .map(Value::Array)
}

fn conversation_message(
    i: usize,
    message: &Value,
    format: ContentFormat,
) -> Result<Value, EncodeError> {
    let Some(fields) = message.as_object() else {
        return Err(refused(
            format!("messages[{i}]"),
            "must be an object with `role` and `content`",
        ));
    };
    let Some(role) = fields.get("role").and_then(Value::as_str) else {
        return Err(refused(format!("messages[{i}].role"), "must be a string"));
    };
    let present = |key: &str| fields.get(key).is_some_and(|value| !value.is_null());
    match role {
        "tool" => {
            return Err(unreadable(format!(
                "messages[{i}] is a tool message (its rendering is not known exactly)"
            )))
        }
        "assistant" => {
            match fields.get("tool_calls") {
                // vLLM drops an empty list: the turn renders as a plain one.
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) if calls.is_empty() => {}
                Some(Value::Array(_)) => {
                    return Err(unreadable(format!(
                        "messages[{i}] is a tool-call turn (its rendering is not known exactly)"
                    )))
                }
                Some(_) => {
                    return Err(refused(
                        format!("messages[{i}].tool_calls"),
                        "must be an array of tool calls",
                    ))
                }
            }
            if present("reasoning") || present("reasoning_content") {
                return Err(unreadable(format!(
                    "messages[{i}] carries reasoning (vLLM versions render it differently)"
                )));
            }
        }
        "developer" if present("tools") => {
            return Err(unreadable(format!(
                "messages[{i}] is a developer message with tools"
            )))
        }
        _ => {}
    }

    let mut built = Map::new();
    built.insert("role".into(), Value::String(role.to_owned()));
    built.insert("content".into(), content(i, fields.get("content"), format)?);
    match fields.get("name") {
        None | Some(Value::Null) => {}
        Some(Value::String(name)) => {
            built.insert("name".into(), Value::String(name.clone()));
        }
        Some(_) => return Err(refused(format!("messages[{i}].name"), "must be a string")),
    }
    // vLLM passes a string `task` on and ignores any other.
    if let Some(Value::String(task)) = fields.get("task") {
        built.insert("task".into(), Value::String(task.clone()));
    }
    if role == "developer" {
        built.insert("tools".into(), Value::Null);
    }
    Ok(Value::Object(built))
}

/// A message's `content` in the template's form.
fn content(i: usize, content: Option<&Value>, format: ContentFormat) -> Result<Value, EncodeError> {
    let texts: Vec<&str> = match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(text)) => vec![text],
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, part)| text_part(i, j, part))
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(refused(
                format!("messages[{i}].content"),
                "must be a string, an array of content parts, or null",
            ))
        }
    };
    Ok(match format {
        ContentFormat::String => Value::String(texts.join("\n")),
        ContentFormat::OpenAi => Value::Array(
            texts
                .into_iter()
                .map(|text| serde_json::json!({ "type": "text", "text": text }))
                .collect(),
        ),
    })
}

/// The text of a content part, which must be `{"type": "text", "text": "..."}`.
fn text_part(i: usize, j: usize, part: &Value) -> Result<&str, EncodeError> {
    let field = format!("messages[{i}].content[{j}]");
    let Some(part) = part.as_object() else {
        return Err(refused(
            field,
            "must be a content part: an object with `type`",
        ));
    };
    match part.get("type") {
        Some(Value::String(kind)) if kind == "text" => match part.get("text") {
            Some(Value::String(text)) => Ok(text),
            _ => Err(refused(format!("{field}.text"), "must be a string")),
        },
        Some(Value::String(kind)) => Err(unreadable(format!(
            "{field} is a {kind:?} part (only text parts are tokenized)"
        ))),
        _ => Err(refused(format!("{field}.type"), "must be a string")),
    }
}

fn refused(field: impl Into<String>, message: impl Into<String>) -> EncodeError {
    EncodeError::Refused(PromptError::new(field, message))
}

fn unreadable(why: String) -> EncodeError {
    EncodeError::unreadable(&why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What each chat becomes: the messages a template is given (in both formats), a load-only
    /// reason, or a refusal naming its field.
    #[test]
    fn each_chat_is_built_as_vllm_builds_it_or_routed_by_load_or_refused() {
        enum Want {
            Built(Value, Value),
            LoadOnly(&'static str),
            Refused(&'static str),
        }
        use Want::*;
        let text = |t: &str| json!({"type": "text", "text": t});
        let cases = [
            (
                json!([{"role": "user", "content": "hi", "extra": 1}]),
                Built(
                    json!([{"role": "user", "content": "hi"}]),
                    json!([{"role": "user", "content": [text("hi")]}]),
                ),
            ),
            (
                json!([{"role": "user", "content": [text("a"), {"type": "text", "text": "b", "cache_control": {}}]}]),
                Built(
                    json!([{"role": "user", "content": "a\nb"}]),
                    json!([{"role": "user", "content": [text("a"), text("b")]}]),
                ),
            ),
            (
                json!([{"role": "assistant", "content": null, "tool_calls": [], "name": "bot"}, {"role": "user"}]),
                Built(
                    json!([{"role": "assistant", "content": "", "name": "bot"}, {"role": "user", "content": ""}]),
                    json!([{"role": "assistant", "content": [], "name": "bot"}, {"role": "user", "content": []}]),
                ),
            ),
            (
                json!([{"role": "developer", "content": [], "task": "t", "tools": null}]),
                Built(
                    json!([{"role": "developer", "content": "", "task": "t", "tools": null}]),
                    json!([{"role": "developer", "content": [], "task": "t", "tools": null}]),
                ),
            ),
            (
                json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
                LoadOnly("messages[1] is a tool-call turn"),
            ),
            (
                json!([{"role": "tool", "content": "42", "tool_call_id": "c"}]),
                LoadOnly("messages[0] is a tool message"),
            ),
            (
                json!([{"role": "user", "content": [text("look"), {"type": "image_url", "image_url": {"url": "data:"}}]}]),
                LoadOnly("messages[0].content[1] is a \"image_url\" part"),
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_audio\n\u{e9}", "input_audio": {}}]}]),
                LoadOnly("messages[0].content[0] is a \"input_audio\\n\\u{e9}\" part"),
            ),
            (
                json!([{"role": "assistant", "content": "x", "reasoning": "r"}]),
                LoadOnly("messages[0] carries reasoning"),
            ),
            (
                json!([{"role": "developer", "content": "x", "tools": []}]),
                LoadOnly("messages[0] is a developer message with tools"),
            ),
            (json!("hi"), Refused("messages: must be an array")),
            (json!([]), Refused("messages: is empty")),
            (json!([1]), Refused("messages[0]: must be an object")),
            (
                json!([{"content": "x"}]),
                Refused("messages[0].role: must be a string"),
            ),
            (
                json!([{"role": 1, "content": "x"}]),
                Refused("messages[0].role: must be a string"),
            ),
            (
                json!([{"role": "user", "content": 7}]),
                Refused("messages[0].content: must be a string, an array"),
            ),
            (
                json!([{"role": "user", "content": ["x"]}]),
                Refused("messages[0].content[0]: must be a content part"),
            ),
            (
                json!([{"role": "user", "content": [{"text": "x"}]}]),
                Refused("messages[0].content[0].type: must be a string"),
            ),
            (
                json!([{"role": "user", "content": [{"type": "text", "text": null}]}]),
                Refused("messages[0].content[0].text: must be a string"),
            ),
            (
                json!([{"role": "user", "content": "x", "name": 3}]),
                Refused("messages[0].name: must be a string"),
            ),
            (
                json!([{"role": "assistant", "content": "x", "tool_calls": "f"}]),
                Refused("messages[0].tool_calls: must be an array"),
            ),
        ];
        for (messages, want) in cases {
            for format in [ContentFormat::String, ContentFormat::OpenAi] {
                let got = conversation(&messages, format);
                match (&want, got) {
                    (Built(string, openai), Ok(built)) => {
                        let expected = match format {
                            ContentFormat::String => string,
                            ContentFormat::OpenAi => openai,
                        };
                        // Key order too: a template may write a message with `tojson`.
                        assert_eq!(built.to_string(), expected.to_string(), "{messages}");
                    }
                    (LoadOnly(why), Err(EncodeError::Unreadable(got))) => {
                        assert!(got.starts_with(why), "{messages}: {got:?}");
                    }
                    (Refused(wanted), Err(EncodeError::Refused(error))) => {
                        let got = error.to_string();
                        assert!(got.starts_with(wanted), "{messages}: {got:?}");
                    }
                    (_, got) => panic!("{messages} ({format:?}): {got:?}"),
                }
            }
        }
    }
}
