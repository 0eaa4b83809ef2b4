//! Prompts as text and chat messages: the model's own tokenizer and template give the ids
//! transformers gives (the checked-in vectors), and `/query` scores them as their token ids.

use std::path::Path;

use kv_indexer::tokenize::{Prompt, Tokenizers};
use kv_indexer_sim::tokenizer_dir;

/// Writes the tokenizer directories for `make_vectors.py`:
/// `KV_INDEXER_TOKENIZER_DIRS=/tmp/tok cargo test --test tokenize -- --ignored write_tokenizer_dirs`.
#[test]
#[ignore = "writes the tokenizer directories for tests/data/tokenize/make_vectors.py"]
fn write_tokenizer_dirs() {
    let root = std::env::var("KV_INDEXER_TOKENIZER_DIRS").expect("KV_INDEXER_TOKENIZER_DIRS");
    tokenizer_dir::write_all(Path::new(&root)).unwrap_or_else(|e| panic!("{e:#}"));
}

/// The checked-in vectors (`tests/data/tokenize/make_vectors.py`).
fn vectors() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenize/vectors.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The tokenizer directories in a fresh temporary directory, trained as the vectors' were.
fn tokenizer_dirs() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("a temporary directory");
    tokenizer_dir::write_all(root.path()).unwrap_or_else(|e| panic!("{e:#}"));
    let trained: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.path().join("chatml/tokenizer.json")).expect("written"),
    )
    .expect("JSON");
    assert_eq!(
        trained["model"],
        vectors()["trained_model"],
        "training no longer makes the model the vectors were made with: run make_vectors.py again"
    );
    root
}

#[test]
fn every_case_gets_the_ids_transformers_gives() {
    let dirs = tokenizer_dirs();
    let families: Vec<(&str, std::path::PathBuf)> = tokenizer_dir::FAMILIES
        .iter()
        .map(|family| (family.name, dirs.path().join(family.name)))
        .collect();
    let tokenizers = Tokenizers::load(
        families.iter().map(|(name, dir)| (*name, dir.as_path())),
        &Tokenizers::default(),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let vectors = vectors();
    let cases = vectors["cases"].as_array().expect("cases");
    assert!(cases.len() >= 12);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let prompt = match case["prompt"].as_str() {
            Some(text) => Prompt::Text(text),
            None => Prompt::Chat {
                messages: &case["messages"],
                tools: None,
            },
        };
        let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
        // Twice: the second time the pieces come from the cache.
        for round in 0..2 {
            let mut ids = Vec::new();
            tokenizers
                .encode(case["model"].as_str(), &prompt, &mut ids)
                .unwrap_or_else(|e| panic!("{name}: {e:?}"));
            assert_eq!(ids, expected, "{name} (round {round})");
        }
    }
}
