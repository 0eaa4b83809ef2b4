//! A model's chat template, rendered the way Hugging Face transformers renders it.
//!
//! Owns the Jinja environment and what transformers puts in it: `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python's string and dict methods, `raise_exception`,
//! `strftime_now`, and a `tojson` that writes what Python's `json.dumps(ensure_ascii=False)`
//! writes (no HTML escaping, `", "` and `": "` separators). Never tokenizes, and never reads a
//! file: `model` hands it the template's text.

use anyhow::{Context, Result};
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use super::content_format::{self, ContentFormat};

/// What one render may spend (minijinja's fuel: about one unit an instruction). A real template
/// over a request of the largest body we accept spends far less; a template that loops without
/// end stops here instead of holding an HTTP thread.
const RENDER_FUEL: u64 = 50_000_000;

/// The name the template is kept under in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template and the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    content_format: ContentFormat,
}

/// A render refused: the template's own words (`raise_exception`) or where rendering failed,
/// with the template line and the causes, in one line.
#[derive(Debug, thiserror::Error)]
#[error("{}", describe(.0))]
pub struct RenderError(Error);

/// What a chat request gives the template.
#[derive(Serialize)]
pub struct ChatContext<'a> {
    pub messages: &'a serde_json::Value,
    /// Passed only when the request has tools, as vLLM does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a serde_json::Value>,
}

impl ChatTemplate {
    /// Compiles `source`; the error says where the template does not parse.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .context("configuring the template syntax")?;
        env.set_syntax(syntax);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", python_tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let content_format = content_format::detect(&source);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|error| anyhow::anyhow!(describe(&error)))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            content_format,
        })
    }

    /// The form of `content` vLLM gives this template.
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// The prompt text for `context`, with `add_generation_prompt = true`, as vLLM's
    /// `/v1/chat/completions` renders it. The error is the template's own words (for
    /// `raise_exception`) or where rendering failed.
    pub fn render(&self, context: &ChatContext<'_>) -> Result<String, RenderError> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(RenderError)?;
        let context = minijinja::context! {
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            add_generation_prompt => true,
            ..Value::from(Serde(context)),
        };
        template.render(context).map_err(RenderError)
    }
}

/// An error with its line and its causes, in one line.
fn describe(error: &Error) -> String {
    let mut text = match error.line() {
        Some(line) => format!("{} (template line {line})", error),
        None => error.to_string(),
    };
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `raise_exception(message)`: the template refuses the request with `message`.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time now, as Python's `datetime.now().strftime(format)`.
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = jiff::ZonedDateTime::now();
    jiff::fmt::strtime::format(format.as_str(), &now)
        .map(Value::from)
        .map_err(|error| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("strftime_now({format:?}): {error}"),
            )
        })
}

/// `tojson`, as transformers defines it: `json.dumps(value, ensure_ascii=False,
/// indent=indent, separators=separators, sort_keys=sort_keys)`.
fn python_tojson(value: &Value, args: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = args.get("indent")?;
    let sort_keys: Option<bool> = args.get("sort_keys")?;
    let separators: Option<Vec<String>> = args.get("separators")?;
    args.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ))
        }
    };
    let json = serde_json::to_value(value).map_err(|error| {
        Error::new(ErrorKind::InvalidOperation, "tojson: cannot serialize").with_source(error)
    })?;
    let mut out = String::new();
    python_json::write(
        &mut out,
        &json,
        &python_json::Style {
            indent,
            item,
            key,
            sort_keys: sort_keys.unwrap_or(false),
        },
        0,
    );
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` output for a JSON value.
mod python_json {
    use std::fmt::Write;

    pub struct Style {
        pub indent: Option<usize>,
        pub item: String,
        pub key: String,
        pub sort_keys: bool,
    }

    pub fn write(out: &mut String, value: &serde_json::Value, style: &Style, depth: usize) {
        match value {
            serde_json::Value::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    separate(out, style, depth + 1, i == 0);
                    write(out, item, style, depth + 1);
                }
                close(out, style, depth);
                out.push(']');
            }
            serde_json::Value::Object(map) if !map.is_empty() => {
                let mut entries: Vec<_> = map.iter().collect();
                if style.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (name, item)) in entries.into_iter().enumerate() {
                    separate(out, style, depth + 1, i == 0);
                    string(out, name);
                    out.push_str(&style.key);
                    write(out, item, style, depth + 1);
                }
                close(out, style, depth);
                out.push('}');
            }
            serde_json::Value::String(text) => string(out, text),
            other => out.push_str(&other.to_string()),
        }
    }

    /// Before an element: the item separator (but for the first), then with `indent` a new
    /// line indented to `depth`.
    fn separate(out: &mut String, style: &Style, depth: usize, first: bool) {
        match style.indent {
            Some(indent) => {
                if !first {
                    out.push_str(&style.item);
                }
                out.push('\n');
                out.extend(std::iter::repeat_n(' ', indent * depth));
            }
            None if !first => out.push_str(&style.item),
            None => {}
        }
    }

    fn close(out: &mut String, style: &Style, depth: usize) {
        if let Some(indent) = style.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', indent * depth));
        }
    }

    /// A string as `ensure_ascii=False` writes it: only `"`, `\` and control characters escaped.
    fn string(out: &mut String, text: &str) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: serde_json::Value) -> Result<String, String> {
        let template = ChatTemplate::new(source.to_string(), "<s>".into(), "</s>".into())
            .map_err(|error| format!("{error:#}"))?;
        template
            .render(&ChatContext {
                messages: &messages,
                tools: None,
            })
            .map_err(|error| error.to_string())
    }

    #[test]
    fn blocks_are_trimmed_and_stripped_as_transformers_does() {
        let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}";
        let text = render(
            source,
            serde_json::json!([{"role": "user", "content": "hi"}]),
        );
        assert_eq!(text.as_deref(), Ok("[hi]\n"));
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let source = "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}";
        let messages = serde_json::json!([{"b": "<é\"\n>", "a": [1, 2.5, null, true]}]);
        let text = render(source, messages).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            text,
            "[{\"b\": \"<é\\\"\\n>\", \"a\": [1, 2.5, null, true]}]|{\n  \"b\": \"<é\\\"\\n>\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}"
        );
    }

    #[test]
    fn python_methods_namespace_and_raise_exception() {
        let source = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.content.split('</think>')[-1].strip() | upper }}{% endfor %}{{ ns.n }}{{ bos_token }}";
        let messages = serde_json::json!([{"role": "assistant", "content": "x</think>  done "}]);
        assert_eq!(render(source, messages).as_deref(), Ok("DONE1<s>"));
        let refusing = "{{ raise_exception('Conversation roles must alternate') }}";
        let error = render(refusing, serde_json::json!([])).expect_err("refused");
        assert!(
            error.contains("Conversation roles must alternate"),
            "{error}"
        );
    }

    #[test]
    fn a_template_that_does_not_parse_says_where() {
        let error = render("{% for m in messages %}", serde_json::json!([])).expect_err("bad");
        assert!(error.contains("line 1"), "{error}");
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let source =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let error = render(source, serde_json::json!([])).expect_err("out of fuel");
        assert!(error.contains("fuel"), "{error}");
    }

    #[test]
    fn strftime_now_formats_the_date() {
        let text = render("{{ strftime_now('%Y') }}", serde_json::json!([])).unwrap_or_default();
        assert_eq!(text.len(), 4, "{text}");
        assert!(text.starts_with("20"), "{text}");
    }
}
