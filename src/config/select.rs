//! The `[select]` table: the knobs of `POST /select` (docs.md "Selection"), all reloadable.
//!
//! Owns their defaults and ranges: weights finite and non-negative, time-to-lives positive and
//! bounded (a `Duration` is built from them), a temperature finite and non-negative. It never
//! decides anything with them (that is `select`).

use serde::de::IgnoredAny;
use serde::{Deserialize, Deserializer};
use toml::de::DeValue;
use toml::Spanned;

use super::diagnostics::Problems;
use super::keys::{as_table, read_table, Int};
use crate::select::{known_policy, policy_names, DEFAULT_POLICY};

const SECTION: &str = "[select]";
/// The longest interval between two scrapes of an engine's load: an hour (a figure older than
/// a few intervals is stale anyway).
pub const MAX_LOAD_INTERVAL_MS: u64 = 3_600_000;
/// The longest a time-to-live may be: a week (a reservation outliving it is a leak, not a
/// request).
pub const MAX_TTL_S: f64 = 7.0 * 86_400.0;

/// The `[select]` knobs, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Select {
    /// Cost of one block to prefill, on the rank's queue or for this prompt.
    pub prefill_weight: f64,
    /// Cost of one block an unreleased reservation decodes (its prompt and expected output).
    pub decode_weight: f64,
    /// What one block held only in CPU counts for, against one held in GPU.
    pub cpu_weight: f64,
    /// What one block held only on disk counts for.
    pub disk_weight: f64,
    /// How long a reserved prompt's blocks count as predicted on its rank.
    pub predicted_ttl_s: f64,
    /// When a reservation never released expires.
    pub reservation_ttl_s: f64,
    /// 0: the lowest cost wins; above, a rank is drawn with softmax(−cost / temperature).
    pub temperature: f64,
    /// How many of the lowest-cost candidates an answer lists (every rank is considered);
    /// 0 lists them all.
    pub max_candidates: usize,
    /// Cost of one request an engine reports running or waiting beyond this router's own
    /// reservations (another router's, or sent to the engine directly), in blocks to prefill.
    pub engine_request_weight: f64,
    /// Between two scrapes of each engine's load (`metrics_url`); 0: no scrapes.
    pub load_interval_ms: u64,
    /// How the candidates are ordered and one chosen: a name in `select::policy`'s table.
    pub policy: &'static str,
}

impl Default for Select {
    fn default() -> Select {
        Select {
            prefill_weight: 1.0,
            decode_weight: 0.1,
            cpu_weight: 0.75,
            disk_weight: 0.25,
            predicted_ttl_s: 2.0,
            reservation_ttl_s: 600.0,
            temperature: 0.0,
            max_candidates: 16,
            engine_request_weight: 10.0,
            load_interval_ms: 500,
            policy: DEFAULT_POLICY,
        }
    }
}

/// A TOML number, integer or float.
struct Number(f64);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Number, D::Error> {
        struct NumberVisitor;
        impl serde::de::Visitor<'_> for NumberVisitor {
            type Value = Number;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Number, E> {
                Ok(Number(v))
            }
        }
        deserializer.deserialize_f64(NumberVisitor)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSelect {
    prefill_weight: Option<Spanned<Number>>,
    decode_weight: Option<Spanned<Number>>,
    cpu_weight: Option<Spanned<Number>>,
    disk_weight: Option<Spanned<Number>>,
    predicted_ttl_s: Option<Spanned<Number>>,
    reservation_ttl_s: Option<Spanned<Number>>,
    temperature: Option<Spanned<Number>>,
    /// A key no longer read: named so that its error says what to do, not "unknown key".
    seed: Option<Spanned<IgnoredAny>>,
    max_candidates: Option<Spanned<Int>>,
    engine_request_weight: Option<Spanned<Number>>,
    load_interval_ms: Option<Spanned<Int>>,
    policy: Option<Spanned<String>>,
}

/// Reads `[select]`; `None` when a key is wrong (each reported).
pub(super) fn check_select(
    value: &Spanned<DeValue<'_>>,
    problems: &mut Problems<'_>,
) -> Option<Select> {
    let table = as_table(value, SECTION, problems)?;
    let (raw, dropped) = read_table::<RawSelect>(&table, SECTION, problems)?;
    let mut ok = dropped.is_empty();
    let mut select = Select::default();
    let mut number = |key: &str,
                      value: Option<Spanned<Number>>,
                      slot: &mut f64,
                      expected: &str,
                      valid: fn(f64) -> bool| {
        let Some(value) = value else { return };
        let read = value.get_ref().0;
        if valid(read) {
            *slot = read;
        } else {
            let why = format!("`{key}` must be {expected}, found {read}");
            problems.add(Some(value.span()), SECTION, why);
            ok = false;
        }
    };
    let weight = |n: f64| n.is_finite() && n >= 0.0;
    let ttl = |n: f64| n > 0.0 && n <= MAX_TTL_S;
    let weight_range = "a finite number >= 0";
    let ttl_range = &format!("a number of seconds > 0 and <= {MAX_TTL_S}");
    number(
        "prefill_weight",
        raw.prefill_weight,
        &mut select.prefill_weight,
        weight_range,
        weight,
    );
    number(
        "decode_weight",
        raw.decode_weight,
        &mut select.decode_weight,
        weight_range,
        weight,
    );
    number(
        "cpu_weight",
        raw.cpu_weight,
        &mut select.cpu_weight,
        weight_range,
        weight,
    );
    number(
        "disk_weight",
        raw.disk_weight,
        &mut select.disk_weight,
        weight_range,
        weight,
    );
    number(
        "predicted_ttl_s",
        raw.predicted_ttl_s,
        &mut select.predicted_ttl_s,
        ttl_range,
        ttl,
    );
    number(
        "reservation_ttl_s",
        raw.reservation_ttl_s,
        &mut select.reservation_ttl_s,
        ttl_range,
        ttl,
    );
    number(
        "engine_request_weight",
        raw.engine_request_weight,
        &mut select.engine_request_weight,
        weight_range,
        weight,
    );
    number(
        "temperature",
        raw.temperature,
        &mut select.temperature,
        weight_range,
        weight,
    );
    if let Some(seed) = raw.seed {
        let why = "`seed` is no longer read (the draw is seeded from the clock): delete the line";
        problems.add(Some(seed.span()), SECTION, why);
        ok = false;
    }
    if let Some(shown) = raw.max_candidates {
        match usize::try_from(shown.get_ref().0) {
            Ok(read) => select.max_candidates = read,
            Err(_) => {
                let why = format!(
                    "`max_candidates` must be >= 0 (0: all), found {}",
                    shown.get_ref().0
                );
                problems.add(Some(shown.span()), SECTION, why);
                ok = false;
            }
        }
    }
    if let Some(interval) = raw.load_interval_ms {
        match u64::try_from(interval.get_ref().0) {
            Ok(read) if read <= MAX_LOAD_INTERVAL_MS => select.load_interval_ms = read,
            _ => {
                let why = format!(
                    "`load_interval_ms` must be 0 (no scrapes) ..= {MAX_LOAD_INTERVAL_MS}, found {}",
                    interval.get_ref().0
                );
                problems.add(Some(interval.span()), SECTION, why);
                ok = false;
            }
        }
    }
    if let Some(policy) = raw.policy {
        match known_policy(policy.get_ref()) {
            Some(known) => select.policy = known,
            None => {
                let names: Vec<&str> = policy_names().collect();
                let why = format!(
                    "`policy` must be one of {}, found {:?}",
                    names.join(", "),
                    policy.get_ref()
                );
                problems.add(Some(policy.span()), SECTION, why);
                ok = false;
            }
        }
    }
    ok.then_some(select)
}

#[cfg(test)]
mod tests {
    use super::Select;
    use crate::config::test_support::{find, problems};
    use crate::config::Config;

    #[test]
    fn absent_keys_take_the_documented_defaults_and_integers_are_numbers() {
        let plain = Config::parse("", "f").unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(plain.select, Select::default());
        let set = Config::parse(
            "[select]\nprefill_weight = 2\ndecode_weight = 0.5\ntemperature = 0.1\n",
            "f",
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(set.select.prefill_weight, 2.0);
        assert_eq!(set.select.decode_weight, 0.5);
        assert_eq!(set.select.temperature, 0.1);
        assert_eq!(set.select.cpu_weight, 0.75);
        assert_eq!(set.select.load_interval_ms, 500);
        let scraped = Config::parse(
            "[select]\nload_interval_ms = 0\nengine_request_weight = 2.5\n",
            "f",
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(scraped.select.load_interval_ms, 0);
        assert_eq!(scraped.select.engine_request_weight, 2.5);
        assert_eq!(plain.select.policy, "cost");
        let policy = Config::parse("[select]\npolicy = \"least_load\"\n", "f")
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(policy.select.policy, "least_load");
    }

    #[test]
    fn every_bad_key_is_reported_with_its_line_and_range() {
        let found = problems(
            "[select]\nprefill_weight = -1\npredicted_ttl_s = 0\ntemperature = \"hot\"\n\
             speed = 3\nreservation_ttl_s = 1e9\nseed = 7\n",
        );
        let line = find(
            &found,
            &["[select]", "prefill_weight", "finite number >= 0", "-1"],
        );
        assert!(line.starts_with("indexer.toml:2:"), "{line}");
        find(&found, &["predicted_ttl_s", "> 0", "found 0"]);
        find(&found, &["temperature", "a number"]);
        find(&found, &["unknown key", "speed"]);
        find(&found, &["reservation_ttl_s", "1000000000"]);
        find(
            &found,
            &[
                "indexer.toml:7:",
                "`seed` is no longer read",
                "delete the line",
            ],
        );
        let found = problems("[select]\nload_interval_ms = -1\nengine_request_weight = -2\n");
        find(&found, &["load_interval_ms", "0 (no scrapes)", "-1"]);
        find(&found, &["engine_request_weight", "finite number >= 0"]);
        let found = problems("[select]\npolicy = \"fastest\"\n");
        find(
            &found,
            &[
                "policy",
                "cost, round_robin, least_load, prefix",
                "\"fastest\"",
            ],
        );
        problems("select = 3\n");
    }
}
