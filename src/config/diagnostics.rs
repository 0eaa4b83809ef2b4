//! The problem list of one configuration file: each problem as `FILE:LINE: section: what`.
//!
//! Owns turning a byte span into a line and a serde error into the key it is about. It never
//! decides what is a problem (the checks in `keys`, `engine` and `ports` do) and never stops at
//! the first one: problems are collected, and the caller reports them all at once.

use std::fmt;
use std::ops::Range;

use toml::de::DeTable;

use super::ConfigError;

/// Collects problems, each prefixed with `origin:line:` and the section it belongs to.
pub(super) struct Problems<'a> {
    origin: &'a str,
    text: &'a str,
    list: Vec<String>,
}

impl<'a> Problems<'a> {
    /// An empty list for `text`, read from `origin` (the file name).
    pub(super) fn new(origin: &'a str, text: &'a str) -> Problems<'a> {
        Problems {
            origin,
            text,
            list: Vec::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub(super) fn add(
        &mut self,
        span: Option<Range<usize>>,
        section: &str,
        what: impl fmt::Display,
    ) {
        let mut problem = match span {
            Some(span) => format!("{}:{}: ", self.origin, self.line(span.start)),
            None => format!("{}: ", self.origin),
        };
        if !section.is_empty() {
            problem.push_str(section);
            problem.push_str(": ");
        }
        problem.push_str(&what.to_string());
        self.list.push(problem);
    }

    /// 1-based line of a byte offset.
    pub(super) fn line(&self, offset: usize) -> usize {
        let before = self.text.get(..offset).unwrap_or(self.text);
        before.bytes().filter(|&b| b == b'\n').count() + 1
    }

    /// A serde error inside `table`, naming the key whose key or value span holds the error;
    /// returns that key.
    pub(super) fn add_serde(
        &mut self,
        err: toml::de::Error,
        table: &DeTable<'_>,
        section: &str,
    ) -> Option<String> {
        let message = err
            .message()
            .trim_end()
            .replace("unknown field", "unknown key");
        let key = err.span().and_then(|span| {
            table.iter().find_map(|(key, value)| {
                let holds = |range: Range<usize>| range.contains(&span.start);
                (holds(key.span()) || holds(value.span())).then(|| key.get_ref().to_string())
            })
        });
        match &key {
            Some(key) if !message.contains(&format!("`{key}`")) => {
                self.add(err.span(), section, format!("`{key}`: {message}"))
            }
            _ => self.add(err.span(), section, message),
        }
        key
    }

    pub(super) fn into_error(self) -> ConfigError {
        ConfigError {
            problems: self.list,
        }
    }
}
