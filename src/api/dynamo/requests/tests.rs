use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use super::*;
use crate::api::json_mutation::mutate;
use crate::config::MAX_INSTANCE_ID;

fn rejection(body: &str) -> String {
    match parse_body(body.as_bytes()) {
        Ok(parsed) => panic!("{body} was accepted as {parsed:?}"),
        Err(reason) => reason.to_string(),
    }
}

#[test]
fn every_field_reads_and_unknown_ones_are_ignored() {
    let body = br#"{"token_ids": [0, 4294967295], "block_hashes": [-1, 18446744073709551615, 5],
        "model_name": "m", "lora_name": null, "cache_salt": "s", "routing_group": "g",
        "tenant_id": "t", "instance_id": 9223372036854775807, "endpoint": "tcp://h:1",
        "replay_endpoint": "tcp://h:2", "block_size": 16, "dp_rank": 3, "extra": {"a": [1]}}"#;
    assert_eq!(
        parse_body(body),
        Ok(DynamoBody {
            token_ids: Some(vec![0, u32::MAX]),
            block_hashes: Some(vec![u64::MAX, u64::MAX, 5]),
            model_name: Some("m".into()),
            lora_name: None,
            cache_salt: Some("s".into()),
            routing_group: Some("g".into()),
            tenant_id: Some("t".into()),
            instance_id: Some(i64::MAX as u64),
            endpoint: Some("tcp://h:1".into()),
            replay_endpoint: Some("tcp://h:2".into()),
            block_size: Some(16),
            dp_rank: Some(3),
        })
    );
    assert_eq!(parse_body(b"{}"), Ok(DynamoBody::default()));
    assert_eq!(
        required(None::<u32>, "block_size"),
        Err(BadBody::Missing("block_size".into()))
    );
}

#[test]
fn a_bad_value_is_named_by_its_field_or_index() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"token_ids": [1, 2, 3, -1]}"#,
            "token_ids[3]: expected an integer in 0..=4294967295, got -1",
        ),
        (
            r#"{"token_ids": [4294967296]}"#,
            "token_ids[0]: expected an integer in 0..=4294967295, got 4294967296",
        ),
        (
            r#"{"block_hashes": [1, 2.5]}"#,
            "block_hashes[1]: expected an integer in -9223372036854775808..=18446744073709551615 \
         (a 64-bit hash), got 2.5",
        ),
        (
            r#"{"token_ids": "1 2"}"#,
            "token_ids: expected an array of integers in 0..=4294967295, got \"1 2\"",
        ),
        (
            r#"{"model_name": 7}"#,
            "model_name: expected a string or null, got 7",
        ),
        (
            r#"{"instance_id": -7}"#,
            "instance_id: expected an integer in 0..=9223372036854775807 or null, got -7",
        ),
        (
            r#"{"instance_id": 9223372036854775808}"#,
            "instance_id: expected an integer in 0..=9223372036854775807 or null, \
             got 9223372036854775808",
        ),
        (
            r#"{"model_name": "a", "model_name": "b"}"#,
            "body: duplicate field `model_name`",
        ),
        (
            r#"{"dp_rank": "0"}"#,
            "dp_rank: expected an integer in 0..=4294967295 or null, got \"0\"",
        ),
        (
            r#"{"token_ids": [null]}"#,
            "token_ids[0]: expected an integer in 0..=4294967295, got null",
        ),
        ("[1]", "body: expected a JSON object, got an array"),
        ("null", "body: expected a JSON object, got null"),
        (
            r#"{"model_name": [1]}"#,
            "model_name: expected a string or null, got an array",
        ),
    ];
    for (body, message) in cases {
        assert_eq!(rejection(body), *message, "{body}");
    }
    assert!(rejection(r#"{"token_ids": [1,"#).starts_with("body is not valid JSON: "));
    assert!(rejection(r#"{} {}"#).starts_with("body is not valid JSON: "));
    assert!(rejection("").starts_with("body is not valid JSON: "));
    assert_eq!(
        parse_body(b"{\"other\": \"\xff\"}"),
        Err(BadBody::NotUtf8(11))
    );
    let cut = rejection(&format!(r#"{{"token_ids": "{}"}}"#, "é".repeat(100)));
    assert!(cut.ends_with("...") && cut.chars().count() < 130, "{cut}");
}

/// The same body read through a JSON tree: what the derived struct must agree with.
fn reference(body: &[u8]) -> Option<DynamoBody> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let mut parsed = DynamoBody::default();
    let integers = |value: &Value, convert: &dyn Fn(&Value) -> Option<u64>| match value {
        Value::Null => Some(None),
        Value::Array(items) => items
            .iter()
            .map(convert)
            .collect::<Option<Vec<u64>>>()
            .map(Some),
        _ => None,
    };
    let text = |value: &Value| match value {
        Value::Null => Some(None),
        Value::String(text) => Some(Some(text.clone())),
        _ => None,
    };
    let small = |value: &Value| value.as_u64().filter(|&n| n <= u64::from(u32::MAX));
    let number = |value: &Value, limit: u64| match value {
        Value::Null => Some(None),
        _ => value.as_u64().filter(|&n| n <= limit).map(Some),
    };
    for (key, value) in value.as_object()? {
        match key.as_str() {
            "token_ids" => {
                parsed.token_ids =
                    integers(value, &small)?.map(|t| t.into_iter().map(|t| t as u32).collect());
            }
            "block_hashes" => {
                let hash = |v: &Value| v.as_u64().or_else(|| v.as_i64().map(|h| h as u64));
                parsed.block_hashes = integers(value, &hash)?;
            }
            "model_name" => parsed.model_name = text(value)?,
            "lora_name" => parsed.lora_name = text(value)?,
            "cache_salt" => parsed.cache_salt = text(value)?,
            "routing_group" => parsed.routing_group = text(value)?,
            "tenant_id" => parsed.tenant_id = text(value)?,
            "endpoint" => parsed.endpoint = text(value)?,
            "replay_endpoint" => parsed.replay_endpoint = text(value)?,
            "instance_id" => parsed.instance_id = number(value, MAX_INSTANCE_ID)?,
            "block_size" => parsed.block_size = number(value, u32::MAX.into())?.map(|n| n as u32),
            "dp_rank" => parsed.dp_rank = number(value, u32::MAX.into())?.map(|n| n as u32),
            _ => {}
        }
    }
    Some(parsed)
}

/// A body with a random subset of the fields, values mostly of the right type.
fn generated_body(rng: &mut SmallRng) -> String {
    const WORDS: [&str; 6] = [
        "",
        "m",
        "llama-3",
        "ad\\u00e9pt",
        "\u{1f600}",
        "tcp://h:5557",
    ];
    let integer = |rng: &mut SmallRng| match rng.random_range(0..6) {
        0 => rng.random_range(0..10u64).to_string(),
        1 => u64::from(u32::MAX)
            .saturating_add(rng.random_range(0..2))
            .to_string(),
        2 => format!("-{}", rng.random_range(1..1000u64)),
        3 => u64::MAX.to_string(),
        _ => rng.random::<u32>().to_string(),
    };
    let value = |rng: &mut SmallRng, kind: u8| match (kind, rng.random_range(0..12)) {
        (_, 0) => "null".to_owned(),
        (_, 1) => "true".to_owned(),
        (0, _) => {
            let items: Vec<String> = (0..rng.random_range(0..5)).map(|_| integer(rng)).collect();
            format!("[{}]", items.join(", "))
        }
        (1, _) => format!("\"{}\"", WORDS[rng.random_range(0..WORDS.len())]),
        _ => integer(rng),
    };
    const KEYS: [(&str, u8); 13] = [
        ("token_ids", 0),
        ("block_hashes", 0),
        ("model_name", 1),
        ("lora_name", 1),
        ("cache_salt", 1),
        ("routing_group", 1),
        ("tenant_id", 1),
        ("endpoint", 1),
        ("replay_endpoint", 1),
        ("instance_id", 2),
        ("block_size", 2),
        ("dp_rank", 2),
        ("other", 2),
    ];
    let mut fields = Vec::new();
    for (key, kind) in KEYS {
        if rng.random_bool(0.4) {
            fields.push(format!("\"{key}\": {}", value(rng, kind)));
        }
    }
    format!("{{{}}}", fields.join(", "))
}

#[test]
fn the_derived_struct_agrees_with_a_json_tree_on_generated_and_mutated_bodies() {
    let mut rng = SmallRng::seed_from_u64(0xd1a0);
    let (mut accepted, mut refused) = (0, 0);
    for _ in 0..10_000 {
        let body = generated_body(&mut rng);
        let mut bodies = vec![body.clone().into_bytes()];
        bodies.extend((0..3).map(|_| mutate(&mut rng, body.as_bytes())));
        for body in bodies {
            let shown = String::from_utf8_lossy(&body);
            // A tree refuses a number past f64 (`1e999`) that an ignored key may hold and the
            // streaming reader skips unread: valid JSON either way, so not compared.
            let tree = serde_json::from_slice::<Value>(&body);
            if tree.is_err_and(|err| err.to_string().starts_with("number out of range")) {
                continue;
            }
            let read = parse_body(&body);
            assert_eq!(read.clone().ok(), reference(&body), "{shown}: {read:?}");
            match read {
                Ok(_) => accepted += 1,
                Err(reason) => {
                    refused += 1;
                    let reason = reason.to_string();
                    assert!(!reason.is_empty() && !reason.contains('\n'), "{shown}");
                }
            }
        }
    }
    // The comparison means something only if both outcomes occurred many times.
    assert!(
        accepted > 2_000 && refused > 2_000,
        "{accepted} accepted, {refused} refused"
    );
}
