//! Engine ids for the Dynamo API (docs.md, "Dynamo / Mooncake indexer API", "Instances"):
//! `instance_id` as written, else derived from the engine's name, and no two engines with one id.
//!
//! Owns the derivation and the uniqueness rule. Never reads a key (`engine` does) and never
//! decides anything else about an engine.

use std::collections::HashMap;
use std::ops::Range;

use super::diagnostics::Problems;
use super::EngineConfig;

/// Two engines with one `instance_id` (written, or derived from their names) would answer the
/// Dynamo API as one instance: the later one is reported, with the line of the first.
pub(super) fn check_unique_instance(
    engine: &EngineConfig,
    first_line_of_instance: &mut HashMap<u64, usize>,
    label: &str,
    span: Range<usize>,
    problems: &mut Problems<'_>,
) {
    let line = problems.line(span.start);
    match first_line_of_instance.get(&engine.instance_id) {
        Some(first) => {
            let why = format!(
                "`instance_id` {} is already the id of the engine on line {first}",
                engine.instance_id
            );
            problems.add(Some(span), label, why);
        }
        None => {
            first_line_of_instance.insert(engine.instance_id, line);
        }
    }
}

/// The id the Dynamo API gives an engine without `instance_id`: a hash of its name, stable
/// across restarts and hosts, kept below 2^53 so that every JSON client (JavaScript's numbers
/// are doubles) reads it exactly.
pub fn derived_instance_id(name: &str) -> u64 {
    const JSON_SAFE_BITS: u32 = 53;
    xxhash_rust::xxh3::xxh3_64(name.as_bytes()) & ((1 << JSON_SAFE_BITS) - 1)
}

#[cfg(test)]
mod tests {
    use super::derived_instance_id;
    use crate::config::test_support::{find, problems};
    use crate::config::Config;

    #[test]
    fn instance_id_is_the_written_one_else_a_json_safe_hash_of_the_name() {
        let text = "[[engine]]\nname = \"a\"\nhost = \"h\"\ninstance_id = 7\n\
                    [[engine]]\nname = \"b\"\nhost = \"h\"\nzmq_port = 6000\n";
        let config = Config::parse(text, "f").unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(config.engines[0].instance_id, 7);
        assert_eq!(config.engines[1].instance_id, derived_instance_id("b"));
        assert_ne!(derived_instance_id("a"), derived_instance_id("b"));
        assert!(derived_instance_id("b") < 1 << 53);
    }

    #[test]
    fn a_negative_shared_or_defaulted_instance_id_is_reported() {
        let text = "[defaults]\ninstance_id = 1\n\
                    [[engine]]\nname = \"a\"\nhost = \"h\"\ninstance_id = -1\n\
                    [[engine]]\nname = \"b\"\nhost = \"h\"\nzmq_port = 6000\ninstance_id = 5\n\
                    [[engine]]\nname = \"c\"\nhost = \"h\"\nzmq_port = 7000\ninstance_id = 5\n";
        let found = problems(text);
        find(
            &found,
            &[
                "indexer.toml:2:",
                "[defaults]",
                "`instance_id` is not allowed",
            ],
        );
        find(
            &found,
            &["indexer.toml:6:", "engine \"a\"", "`instance_id` must be"],
        );
        find(
            &found,
            &[
                "indexer.toml:12:",
                "engine \"c\"",
                "already the id",
                "line 7",
            ],
        );
        assert_eq!(found.len(), 3, "{found:#?}");
    }
}
