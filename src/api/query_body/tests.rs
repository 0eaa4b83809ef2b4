//! The `/query` body: rejections, and the scanner against serde.

use super::scan::scan_common_shape;
use super::*;
use crate::api::json_mutation::mutate;
use crate::index::MmFeature;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn rejection(body: &str) -> String {
    match parse_query(body.as_bytes()) {
        Ok(query) => panic!("{body} was accepted as {query:?}"),
        Err(reason) => reason.to_string(),
    }
}

#[test]
fn a_valid_query_parses_with_and_without_options() {
    let plain = parse_query(br#"{"token_ids": [0, 1, 4294967295]}"#);
    assert_eq!(
        plain,
        Ok(QueryRequest {
            token_ids: vec![0, 1, u32::MAX],
            ..QueryRequest::default()
        })
    );
    let full = parse_query(br#"{"token_ids": [], "model": "m", "lora_name": null, "extra": 1}"#);
    assert_eq!(
        full,
        Ok(QueryRequest {
            token_ids: vec![],
            model: Some("m".into()),
            ..QueryRequest::default()
        })
    );
}

#[test]
fn salt_and_multimodal_items_parse_in_either_path() {
    let body = br#"{"token_ids": [1], "cache_salt": "alice",
        "mm_features": [{"identifier": "img-a", "offset": 4, "length": 8, "modality": "image"}]}"#;
    let expected = QueryRequest {
        token_ids: vec![1],
        cache_salt: Some("alice".into()),
        mm_features: vec![MmFeature {
            identifier: "img-a".into(),
            offset: 4,
            length: 8,
        }],
        ..QueryRequest::default()
    };
    assert_eq!(parse_query(body), Ok(expected));
    let salted = br#"{"cache_salt":"bob","token_ids":[1,2]}"#;
    assert_eq!(
        scan_common_shape(salted, Vec::new()).map(|q| q.cache_salt),
        Some(Some("bob".into()))
    );
    assert_eq!(
        parse_query(br#"{"token_ids": [], "mm_features": null, "cache_salt": null}"#),
        Ok(QueryRequest::default())
    );
}

#[test]
fn bad_salts_and_multimodal_items_are_named() {
    let cases = [
        (
            r#"{"token_ids": [], "cache_salt": 7}"#,
            "cache_salt: expected a string or null, got 7",
        ),
        (
            r#"{"token_ids": [], "cache_salt": ["a"]}"#,
            "cache_salt: expected a string or null, got an array",
        ),
        (
            r#"{"token_ids": [], "mm_features": [{"identifier": "a", "offset": -1, "length": 2}]}"#,
            "mm_features[0].offset: expected an integer in 0..=4294967295, got -1",
        ),
        (
            r#"{"token_ids": [], "mm_features": [{"identifier": "a", "offset": 0, "length": 1},
                {"identifier": "b", "offset": 4294967296, "length": 2}]}"#,
            "mm_features[1].offset: expected an integer in 0..=4294967295, got 4294967296",
        ),
        (
            r#"{"token_ids": [], "mm_features": [{"identifier": 5, "offset": 0, "length": 2}]}"#,
            "mm_features[0].identifier: expected a string, got 5",
        ),
        (
            r#"{"token_ids": [], "mm_features": [{"identifier": "a", "offset": 0}]}"#,
            "mm_features[0].length: missing",
        ),
        (
            r#"{"token_ids": [], "mm_features": [{"identifier": "a", "offset": 0, "length": 1.5}]}"#,
            "mm_features[0].length: expected an integer in 0..=4294967295, got 1.5",
        ),
        (
            r#"{"token_ids": [], "mm_features": ["img"]}"#,
            "mm_features[0]: expected an {identifier, offset, length} object, got \"img\"",
        ),
        (
            r#"{"token_ids": [], "mm_features": {"identifier": "a"}}"#,
            "mm_features: expected an array of {identifier, offset, length} objects, got an object",
        ),
    ];
    for (body, reason) in cases {
        assert_eq!(rejection(body), reason, "{body}");
    }
}

#[test]
fn a_bad_token_is_named_by_its_index() {
    assert_eq!(
        rejection(r#"{"token_ids": [1, 2, 3, -1]}"#),
        "token_ids[3]: expected an integer in 0..=4294967295, got -1"
    );
    assert_eq!(
        rejection(r#"{"token_ids": [4294967296]}"#),
        "token_ids[0]: expected an integer in 0..=4294967295, got 4294967296"
    );
    assert_eq!(
        rejection(r#"{"token_ids": [1, "2"]}"#),
        "token_ids[1]: expected an integer in 0..=4294967295, got \"2\""
    );
    assert_eq!(
        rejection(r#"{"token_ids": [1.5]}"#),
        "token_ids[0]: expected an integer in 0..=4294967295, got 1.5"
    );
}

#[test]
fn structural_problems_name_the_field() {
    assert_eq!(rejection(r#"{"model": "m"}"#), "token_ids: missing");
    assert_eq!(
        rejection(r#"{"token_ids": "1 2 3"}"#),
        "token_ids: expected an array of integers in 0..=4294967295, got \"1 2 3\""
    );
    assert_eq!(
        rejection(r#"{"token_ids": [], "model": 7}"#),
        "model: expected a string or null, got 7"
    );
    assert_eq!(
        rejection("[1, 2]"),
        "body: expected a JSON object, got an array"
    );
    assert_eq!(
        rejection(r#"{"token_ids": [1, [2]]}"#),
        "token_ids[1]: expected an integer in 0..=4294967295, got an array"
    );
    assert_eq!(rejection(r#"{"token_ids": null}"#), "token_ids: missing");
    assert_eq!(
        rejection(r#"{"token_ids": [1], "token_ids": [2]}"#),
        "body: duplicate field `token_ids`"
    );
    assert_eq!(
        rejection(r#"{"token_ids": [], "lora_name": {"a": 1}}"#),
        "lora_name: expected a string or null, got an object"
    );
    assert!(rejection("{\"token_ids\": [1,").starts_with("body is not valid JSON: "));
    assert!(rejection("").starts_with("body is not valid JSON: "));
}

fn query(tokens: &[u32], model: Option<&str>, lora_name: Option<&str>) -> QueryRequest {
    QueryRequest {
        token_ids: tokens.to_vec(),
        model: model.map(str::to_owned),
        lora_name: lora_name.map(str::to_owned),
        ..QueryRequest::default()
    }
}

#[test]
fn the_scanner_reads_the_common_shape_in_any_order_and_spacing() {
    let readings = [
        (
            r#"{"token_ids":[0,1,4294967295]}"#,
            query(&[0, 1, u32::MAX], None, None),
        ),
        (
            " \t\r\n{ \"token_ids\" :\n[ 7 ,\t8\r,9 ] , \"model\" : \"m-1\" }\n ",
            query(&[7, 8, 9], Some("m-1"), None),
        ),
        (
            "{\"lora_name\":\"ad\u{e9}pt\",\"model\":null,\"token_ids\":[ ]}",
            query(&[], None, Some("ad\u{e9}pt")),
        ),
        (
            r#"{"model":"","token_ids":[10],"lora_name":null}"#,
            query(&[10], Some(""), None),
        ),
    ];
    for (body, expected) in readings {
        assert_eq!(
            scan_common_shape(body.as_bytes(), Vec::new()).as_ref(),
            Some(&expected),
            "{body}"
        );
        assert_eq!(parse_any_shape(body.as_bytes()), Ok(expected), "{body}");
    }
}

#[test]
fn the_scanner_leaves_every_irregular_body_to_serde() {
    let irregular: &[&[u8]] = &[
        br#"{"token_ids": [1], "extra": 1}"#,
        br#"{"token_ids": [1], "token_ids": [2]}"#,
        br#"{"token_ids": [1], "model": "a", "model": "b"}"#,
        br#"{"token_\u0069ds": [1]}"#,
        br#"{"token_ids": [1], "model": "a\"b"}"#,
        br#"{"token_ids": [1], "model": "a\nb"}"#,
        b"{\"token_ids\": [1], \"model\": \"a\tb\"}",
        b"{\"token_ids\": [1], \"model\": \"\xff\"}",
        br#"{"token_ids": [-1]}"#,
        br#"{"token_ids": [-0]}"#,
        br#"{"token_ids": [1.0]}"#,
        br#"{"token_ids": [1e3]}"#,
        br#"{"token_ids": [1E3]}"#,
        br#"{"token_ids": [01]}"#,
        br#"{"token_ids": [00]}"#,
        br#"{"token_ids": [4294967296]}"#,
        br#"{"token_ids": [04294967295]}"#,
        br#"{"token_ids": [99999999999]}"#,
        br#"{"token_ids": ["1"]}"#,
        br#"{"token_ids": [[1]]}"#,
        br#"{"token_ids": [1,]}"#,
        br#"{"token_ids": [,1]}"#,
        br#"{"token_ids": [1 2]}"#,
        br#"{"token_ids": null}"#,
        br#"{"token_ids": [1], "model": 7}"#,
        br#"{"token_ids": [1], "model": nul}"#,
        br#"{"token_ids": [1], "model": nullx}"#,
        br#"{"token_ids": [1], "lora_name": {}}"#,
        br#"{"token_ids": [1], "cache_salt": 7}"#,
        br#"{"token_ids": [1], "cache_salt": "a", "cache_salt": "b"}"#,
        br#"{"token_ids": [1], "mm_features": [{"identifier": "a", "offset": 1}]}"#,
        br#"{"token_ids": [1], "mm_features": [{"identifier": 1, "offset": 1, "length": 2}]}"#,
        br#"{"token_ids": [1], "mm_features": [{"identifier": "a", "offset": -1, "length": 2}]}"#,
        br#"{"token_ids": [1], "mm_features": [{"identifier": "a", "offset": 1, "length": 2, "x": 0}]}"#,
        br#"{"token_ids": [1], "mm_features": [{"identifier": "a", "offset": 1, "offset": 2, "length": 2}]}"#,
        br#"{"token_ids": [1], "mm_features": [{}]}"#,
        br#"{"token_ids": [1], "mm_features": [1]}"#,
        br#"{"token_ids": [1], "mm_features": {}}"#,
        br#"{"token_ids": [1],}"#,
        br#"{"token_ids" [1]}"#,
        br#"{"model": "m"}"#,
        br#"{}"#,
        br#"[1, 2]"#,
        br#"{"token_ids": [1]} x"#,
        br#"{"token_ids": [1]}}"#,
        br#"{"token_ids": [1]"#,
        br#"{"token_ids": [1"#,
        b"\xef\xbb\xbf{\"token_ids\": [1]}",
        b"{\"token_ids\":\x0c[1]}",
        b"",
    ];
    for body in irregular {
        assert_eq!(
            scan_common_shape(body, Vec::new()),
            None,
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

/// A body of the common shape, in random order and spacing, with random values.
fn common_body(rng: &mut SmallRng) -> String {
    const SPACES: [&str; 8] = [" ", "\t", "\n", "\r", "", "", "", "  \n"];
    const WORDS: [&str; 7] = [
        "",
        "m",
        "llama-3",
        "ad\u{e9}pt",
        "\u{1f600}",
        "a b/c",
        "null",
    ];
    let space = |rng: &mut SmallRng| SPACES[rng.random_range(0..SPACES.len())];
    let token = |rng: &mut SmallRng| match rng.random_range(0..5) {
        0 => rng.random_range(0..10u32),
        1 => {
            let digits = rng.random_range(1..10);
            rng.random_range(0..10u32.pow(digits))
        }
        2 => u32::MAX - rng.random_range(0..3u32),
        _ => rng.random(),
    };
    let text = |rng: &mut SmallRng| match rng.random_range(0..=WORDS.len()) {
        0 => "null".to_owned(),
        n => format!("\"{}\"", WORDS[n - 1]),
    };
    let tokens: Vec<String> = (0..rng.random_range(0..6))
        .map(|_| format!("{}{}{}", space(rng), token(rng), space(rng)))
        .collect();
    let mut fields = vec![format!(
        "\"token_ids\"{}:{}[{}]",
        space(rng),
        space(rng),
        tokens.join(",")
    )];
    for key in ["model", "lora_name", "cache_salt"] {
        if rng.random_bool(0.6) {
            fields.push(format!(
                "\"{key}\"{}:{}{}",
                space(rng),
                space(rng),
                text(rng)
            ));
        }
    }
    if rng.random_bool(0.4) {
        let items: Vec<String> = (0..rng.random_range(0..3))
            .map(|_| {
                let mut keys = [
                    format!(
                        "\"identifier\"{}:{}\"{}\"",
                        space(rng),
                        space(rng),
                        WORDS[rng.random_range(0..WORDS.len())]
                    ),
                    format!("\"offset\"{}:{}{}", space(rng), space(rng), token(rng)),
                    format!("\"length\"{}:{}{}", space(rng), space(rng), token(rng)),
                ];
                let first = rng.random_range(0..keys.len());
                keys.swap(0, first);
                format!("{}{{{}}}{}", space(rng), keys.join(","), space(rng))
            })
            .collect();
        let value = match rng.random_range(0..5) {
            0 => "null".to_owned(),
            _ => format!("[{}{}]", items.join(","), space(rng)),
        };
        fields.push(format!(
            "\"mm_features\"{}:{}{value}",
            space(rng),
            space(rng)
        ));
    }
    let first = rng.random_range(0..fields.len());
    fields.swap(0, first);
    let spaced: Vec<String> = fields
        .iter()
        .map(|field| format!("{}{field}{}", space(rng), space(rng)))
        .collect();
    format!("{}{{{}}}{}", space(rng), spaced.join(","), space(rng))
}

#[test]
fn the_scanner_agrees_with_serde_on_generated_and_mutated_bodies() {
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let (mut mutants_read, mut mutants_left) = (0, 0);
    for _ in 0..20_000 {
        let body = common_body(&mut rng);
        let read = scan_common_shape(body.as_bytes(), Vec::new());
        assert!(read.is_some(), "the common shape was left to serde: {body}");
        assert_eq!(parse_any_shape(body.as_bytes()).ok(), read, "{body}");
        for _ in 0..4 {
            let mutant = mutate(&mut rng, body.as_bytes());
            let shown = String::from_utf8_lossy(&mutant);
            match scan_common_shape(&mutant, Vec::new()) {
                Some(read) => {
                    mutants_read += 1;
                    assert_eq!(parse_any_shape(&mutant), Ok(read), "{shown}");
                }
                None => mutants_left += 1,
            }
        }
    }
    // The comparison means something only if both outcomes occurred many times.
    assert!(
        mutants_read > 1_000 && mutants_left > 1_000,
        "{mutants_read} read, {mutants_left} left to serde"
    );
}

#[test]
fn long_values_are_cut_in_messages() {
    let long = format!(r#"{{"token_ids": "{}"}}"#, "é".repeat(100));
    let reason = rejection(&long);
    assert!(reason.ends_with("..."), "{reason}");
    assert!(reason.chars().count() < 130, "{reason}");
}

#[test]
fn a_reused_token_vector_holds_only_the_new_body_tokens() {
    let reused = vec![9; 100];
    let query = scan_common_shape(br#"{"token_ids": [1, 2]}"#, reused).map(|q| q.token_ids);
    assert_eq!(query, Some(vec![1, 2]));
    let empty = scan_common_shape(br#"{"token_ids": []}"#, vec![9; 3]).map(|q| q.token_ids);
    assert_eq!(empty, Some(vec![]));
}
