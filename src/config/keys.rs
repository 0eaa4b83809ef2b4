//! Reading one section's keys: serde for the shapes, then each key's own check.
//!
//! Owns the rule that a bad key (unknown, of the wrong type, or out of range) is reported once
//! and dropped while the section's other keys are still read, so that one bad key never hides
//! another. It never checks a rule across keys or sections (that is `engine` and `ports`).

use std::fmt;

use serde::de::{DeserializeOwned, Visitor};
use serde::{Deserialize, Deserializer};
use toml::de::{DeTable, DeValue, ValueDeserializer};
use toml::Spanned;

use super::diagnostics::Problems;

/// A section that must be a table: reported when it is not.
pub(super) fn as_table<'i>(
    value: &Spanned<DeValue<'i>>,
    section: &str,
    problems: &mut Problems<'_>,
) -> Option<Spanned<DeTable<'i>>> {
    match value.get_ref() {
        DeValue::Table(table) => Some(Spanned::new(value.span(), table.clone())),
        other => {
            let why = format!("expected a table, found {}", other.type_str());
            problems.add(Some(value.span()), section, why);
            None
        }
    }
}

/// Reads `table` into `T` with serde. A key serde rejects (unknown, or of the wrong type) is
/// reported and dropped, and the rest is read again, so that every bad key is reported; the
/// dropped keys are returned with the value.
pub(super) fn read_table<T: DeserializeOwned>(
    table: &Spanned<DeTable<'_>>,
    section: &str,
    problems: &mut Problems<'_>,
) -> Option<(T, Vec<String>)> {
    let mut remaining = table.get_ref().clone();
    let mut dropped = Vec::new();
    loop {
        let value = Spanned::new(table.span(), DeValue::Table(remaining.clone()));
        match T::deserialize(ValueDeserializer::from(value)) {
            Ok(read) => return Some((read, dropped)),
            Err(err) => {
                let key = problems.add_serde(err, &remaining, section)?;
                remaining.remove(key.as_str());
                dropped.push(key);
            }
        }
    }
}

/// A TOML integer; its own type so that a wrong type reads "expected an integer".
pub(super) struct Int(pub(super) i64);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Int, D::Error> {
        struct IntVisitor;
        impl Visitor<'_> for IntVisitor {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Int, E> {
                Ok(Int(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Int, E> {
                i64::try_from(v)
                    .map(Int)
                    .map_err(|_| E::custom(format!("integer {v} is too large")))
            }
        }
        deserializer.deserialize_i64(IntVisitor)
    }
}

/// A key after its own checks.
#[derive(Clone, Debug, Default)]
pub(super) enum Checked<T> {
    #[default]
    Absent,
    /// Present but wrong; already reported.
    Rejected,
    Valid(T),
}

impl<T: Clone> Checked<T> {
    /// This engine's value, else the `[defaults]` one.
    pub(super) fn or(&self, fallback: &Checked<T>) -> Checked<T> {
        match self {
            Checked::Absent => fallback.clone(),
            own => own.clone(),
        }
    }

    /// The value, or `default` when absent; nothing when rejected.
    pub(super) fn or_default_to(self, default: T) -> Option<T> {
        match self {
            Checked::Valid(value) => Some(value),
            Checked::Absent => Some(default),
            Checked::Rejected => None,
        }
    }

    /// For an optional key: `Some(None)` when absent; nothing when rejected.
    pub(super) fn optional(self) -> Option<Option<T>> {
        match self {
            Checked::Valid(value) => Some(Some(value)),
            Checked::Absent => Some(None),
            Checked::Rejected => None,
        }
    }
}

/// Checks the keys of one section that serde read; `dropped` keys were already reported.
pub(super) struct SectionChecker<'p, 'a> {
    pub(super) section: &'p str,
    pub(super) dropped: &'p [String],
    pub(super) problems: &'p mut Problems<'a>,
}

impl SectionChecker<'_, '_> {
    /// An integer key: valid when `convert` accepts it, else reported with `expected`.
    pub(super) fn int<T>(
        &mut self,
        key: &str,
        value: Option<Spanned<Int>>,
        expected: &str,
        convert: impl Fn(i64) -> Option<T>,
    ) -> Checked<T> {
        if self.dropped.iter().any(|dropped| dropped == key) {
            return Checked::Rejected;
        }
        let Some(value) = value else {
            return Checked::Absent;
        };
        match convert(value.get_ref().0) {
            Some(converted) => Checked::Valid(converted),
            None => {
                let why = format!("`{key}` must be {expected}, found {}", value.get_ref().0);
                self.problems.add(Some(value.span()), self.section, why);
                Checked::Rejected
            }
        }
    }

    pub(super) fn port(&mut self, key: &str, value: Option<Spanned<Int>>) -> Checked<u16> {
        let convert = |n| u16::try_from(n).ok().filter(|&port| port > 0);
        self.int(key, value, "a port 1..=65535", convert)
    }

    /// A string key; `check` returns why a value is wrong.
    pub(super) fn text(
        &mut self,
        key: &str,
        value: Option<Spanned<String>>,
        check: impl Fn(&str) -> Option<String>,
    ) -> Checked<String> {
        self.parsed(key, value, |text| match check(text) {
            None => Ok(text.to_string()),
            Some(why) => Err(why),
        })
    }

    /// A string key read into a `T` once, here; `parse` returns why a value is wrong.
    pub(super) fn parsed<T>(
        &mut self,
        key: &str,
        value: Option<Spanned<String>>,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Checked<T> {
        if self.dropped.iter().any(|dropped| dropped == key) {
            return Checked::Rejected;
        }
        let Some(value) = value else {
            return Checked::Absent;
        };
        match parse(value.get_ref()) {
            Ok(parsed) => Checked::Valid(parsed),
            Err(why) => {
                let why = format!("`{key}` {why}");
                self.problems.add(Some(value.span()), self.section, why);
                Checked::Rejected
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{find, problems, ENGINE_A};

    #[test]
    fn unknown_keys_are_reported_with_line_section_and_key() {
        let text = format!("bogus = 1\n[defaults]\nport = 1\n{ENGINE_A}typo = 3\ntypo2 = 4\n");
        let found = problems(&text);
        find(&found, &["indexer.toml:1:", "unknown key", "`bogus`"]);
        find(
            &found,
            &["indexer.toml:3:", "[defaults]", "unknown key", "`port`"],
        );
        find(
            &found,
            &["indexer.toml:7:", "engine \"a\"", "unknown key", "`typo`"],
        );
        find(
            &found,
            &["indexer.toml:8:", "engine \"a\"", "unknown key", "`typo2`"],
        );
        assert_eq!(found.len(), 4, "{found:#?}");
    }

    #[test]
    fn wrong_types_name_the_key_not_a_serde_dump() {
        let text = format!(
            "listen = 8090\nblock_size = \"16\"\n{ENGINE_A}zmq_port = \"abc\"\ndp_size = 1.5\n"
        );
        let found = problems(&text);
        find(
            &found,
            &["indexer.toml:1:", "`listen`", "expected a string"],
        );
        find(
            &found,
            &["indexer.toml:2:", "`block_size`", "expected an integer"],
        );
        find(
            &found,
            &[
                "indexer.toml:6:",
                "engine \"a\"",
                "`zmq_port`",
                "expected an integer",
            ],
        );
        find(
            &found,
            &[
                "indexer.toml:7:",
                "engine \"a\"",
                "`dp_size`",
                "expected an integer",
            ],
        );
        assert_eq!(found.len(), 4, "{found:#?}");
    }

    #[test]
    fn ports_outside_1_to_65535_are_rejected() {
        let text = format!("{ENGINE_A}zmq_port = 70000\nreplay_port = 0\nrecover_port = -1\n");
        let found = problems(&text);
        find(
            &found,
            &["indexer.toml:4:", "engine \"a\"", "`zmq_port`", "70000"],
        );
        find(
            &found,
            &[
                "indexer.toml:5:",
                "engine \"a\"",
                "`replay_port`",
                "found 0",
            ],
        );
        find(
            &found,
            &["indexer.toml:6:", "engine \"a\"", "`recover_port`", "-1"],
        );
        assert_eq!(found.len(), 3, "{found:#?}");
    }

    #[test]
    fn dp_size_and_block_size_out_of_range_and_shards_no_longer_read() {
        let text = format!(
            "block_size = 0\nshards = 48\n[defaults]\ndp_size = 0\n{ENGINE_A}dp_size = 1025\n"
        );
        let found = problems(&text);
        find(&found, &["indexer.toml:1:", "`block_size`", "found 0"]);
        find(
            &found,
            &[
                "indexer.toml:2:",
                "`shards` is no longer read",
                "64 lock shards",
            ],
        );
        find(
            &found,
            &["indexer.toml:4:", "[defaults]", "`dp_size`", "found 0"],
        );
        find(
            &found,
            &["indexer.toml:8:", "engine \"a\"", "`dp_size`", "found 1025"],
        );
        assert_eq!(found.len(), 4, "{found:#?}");
    }
}
