//! Prompts as text and chat messages: the model's own tokenizer and template give the ids
//! transformers gives (the checked-in vectors), and `/query` and `/select`, over real HTTP
//! against scripted engine ranks over real ZMQ, score them exactly as their token ids.

use std::net::SocketAddr;
use std::path::Path;

use crate::support::fake_engine::FakeRank;
use crate::support::http_client::{post, wait_for};
use crate::support::start_service;
use kv_indexer::tokenize::{EncodeError, Prompt, Tokenizers};
use kv_indexer::wire::{BlockStored, Event};
use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::running::RunningService;
use kv_indexer_sim::tokenizer_dir;
use serde_json::{json, Value};

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
    assert!(cases.len() >= 18);
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

/// Tokens per block here: the vectors' prompts are 8 to 77 tokens.
const BLOCK: u32 = 4;

/// The vectors' cases, each with the body field its prompt is sent in.
fn cases() -> Vec<Value> {
    vectors()["cases"].as_array().expect("cases").clone()
}

/// The case's prompt as a body: `prompt` text or chat `messages`, with its `model`.
fn text_body(case: &Value) -> Value {
    match case.get("prompt") {
        Some(text) => json!({ "prompt": text, "model": case["model"] }),
        None => json!({ "messages": case["messages"], "model": case["model"] }),
    }
}

fn query(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let reply = post(addr, path, body.to_string().as_bytes());
    (reply.status, reply.json())
}

/// One engine per tokenizer family (named and `model` as the family, `tokenizer` its
/// directory), and `other`, of a model with no tokenizer, holding the same blocks.
struct Engines {
    running: RunningService,
    ranks: Vec<FakeRank>,
    _dirs: tempfile::TempDir,
}

const OTHER: usize = tokenizer_dir::FAMILIES.len();

impl Engines {
    fn start() -> Engines {
        let dirs = tokenizer_dirs();
        let zmq = zmq::Context::new();
        let ranks: Vec<FakeRank> = (0..=OTHER).map(|_| FakeRank::bind(&zmq, 0)).collect();
        let mut engines: Vec<EngineToml> = tokenizer_dir::FAMILIES
            .iter()
            .zip(&ranks)
            .map(|(family, rank)| EngineToml {
                model: Some(family.name.to_owned()),
                tokenizer: Some(dirs.path().join(family.name).display().to_string()),
                ..EngineToml::new(family.name, rank.port)
            })
            .collect();
        engines.push(EngineToml {
            model: Some("other".to_owned()),
            ..EngineToml::new("other", ranks[OTHER].port)
        });
        let running = start_service(&indexer_toml(Some("127.0.0.1:1"), BLOCK, &engines));
        for rank in &ranks {
            rank.wait_subscribed();
        }
        Engines {
            running,
            ranks,
            _dirs: dirs,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.running.http_addr()
    }

    /// Stores the first `blocks` blocks of `ids` (hashes from `first_hash`) on the case's
    /// family's rank and on `other`'s, and waits until both are indexed.
    fn store(&mut self, model: &str, ids: &[u32], blocks: usize, first_hash: u64) {
        let family = tokenizer_dir::FAMILIES
            .iter()
            .position(|family| family.name == model)
            .expect("a family");
        let hashes: Vec<u64> = (first_hash..first_hash + blocks as u64).collect();
        let tokens = ids[..blocks * BLOCK as usize].to_vec();
        for at in [family, OTHER] {
            let stored = BlockStored::new(hashes.clone(), None, tokens.clone(), BLOCK);
            self.ranks[at].publish(vec![Event::Stored(stored)]);
        }
        let addr = self.addr();
        let body = json!({ "token_ids": ids });
        wait_for(10, "the case's blocks on both ranks", || {
            let (_, answer) = query(addr, "/query", &body);
            let scores = answer["scores"].as_array()?;
            let held = |name: &str| {
                scores
                    .iter()
                    .any(|s| s["instance"] == name && s["matched_blocks"] == blocks as u64)
            };
            (held(model) && held("other")).then_some(())
        });
    }
}

#[test]
fn text_and_chat_prompts_score_exactly_their_token_ids_over_http() {
    let mut engines = Engines::start();
    let addr = engines.addr();
    for (at, case) in cases().iter().enumerate() {
        let name = case["name"].as_str().expect("name");
        let model = case["model"].as_str().expect("model");
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
        // All but the last full block cached (at least one): a prefix, not the whole prompt.
        let full = ids.len() / BLOCK as usize;
        let cached = full.saturating_sub(1).max(1);
        engines.store(model, &ids, cached, 1 + 1000 * at as u64);

        let by_ids = json!({ "token_ids": ids, "model": model });
        let (status, expected) = query(addr, "/query", &by_ids);
        assert_eq!(status, 200, "{name}: {expected}");
        let (status, answer) = query(addr, "/query", &text_body(case));
        assert_eq!(status, 200, "{name}: {answer}");
        assert_eq!(answer, expected, "{name}");
        assert_eq!(answer["query_tokens"], ids.len(), "{name}");
        let ranks: Vec<(&Value, &Value)> = answer["scores"]
            .as_array()
            .expect("scores")
            .iter()
            .map(|score| (&score["instance"], &score["matched_blocks"]))
            .collect();
        assert_eq!(
            ranks,
            [(&json!(model), &json!(cached))],
            "{name}: only the model's own rank, never `other`'s same blocks"
        );

        let (status, selected) = query(addr, "/select", &text_body(case));
        assert_eq!(status, 200, "{name}: {selected}");
        let (_, selected_by_ids) = query(addr, "/select", &by_ids);
        assert_eq!(selected, selected_by_ids, "{name}");
        assert_eq!(selected["instance"], model, "{name}");
        assert_eq!(selected["query_tokens"], ids.len(), "{name}");
    }
}

#[test]
fn a_prompt_that_cannot_be_tokenized_is_a_400_naming_its_field() {
    let engines = Engines::start();
    let addr = engines.addr();
    let user = json!([{"role": "user", "content": "hi"}]);
    let refusals = [
        (
            json!({"token_ids": [1, 2], "prompt": "hi", "model": "chatml"}),
            "prompt: given with token_ids; send exactly one of token_ids, prompt, messages",
        ),
        (
            json!({"prompt": "hi", "messages": user, "model": "chatml"}),
            "messages: given with prompt",
        ),
        (
            json!({"model": "chatml"}),
            "token_ids: missing",
        ),
        (
            json!({"prompt": "hi", "model": "other"}),
            "model: no tokenizer for model \"other\"; models with a tokenizer: chatml, deepseek-r1, llama3",
        ),
        (
            json!({"prompt": "hi"}),
            "model: is required to choose a tokenizer when several models have one",
        ),
        (
            json!({"messages": "hi", "model": "chatml"}),
            "messages: expected an array or null, got \"hi\"",
        ),
        (
            json!({"prompt": 7, "model": "chatml"}),
            "prompt: expected a string",
        ),
        (
            json!({"prompt": "hi", "tools": [], "model": "chatml"}),
            "tools: only with messages (a chat prompt)",
        ),
        (
            json!({"messages": [{"content": "hi"}], "model": "chatml"}),
            "messages[0].role: must be a string",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}], "model": "chatml"}),
            "messages[0].content[0].text: must be a string",
        ),
    ];
    for path in ["/query", "/select"] {
        for (body, wanted) in &refusals {
            let (status, answer) = query(addr, path, body);
            assert_eq!(status, 400, "{path} {body}: {answer}");
            let error = answer["error"].as_str().unwrap_or_default();
            assert!(
                error.starts_with(wanted),
                "{path} {body}: {error:?}, wanted {wanted:?}"
            );
        }
    }
}

/// A chat whose ids cannot be known exactly (a tool-call turn, an image) is scored as an empty
/// prompt: every rank misses, and `/select` chooses by load alone among the model's ranks, as
/// the route front end routes it.
#[test]
fn a_chat_that_cannot_be_known_exactly_is_scored_as_an_empty_prompt() {
    let mut engines = Engines::start();
    let addr = engines.addr();
    let case = &cases()[0];
    let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
    engines.store("chatml", &ids, 1, 1);
    let mut with_image = case["messages"].clone();
    with_image[1]["content"] = json!([
        {"type": "text", "text": with_image[1]["content"]},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]);
    let mut with_call = case["messages"].clone();
    with_call.as_array_mut().expect("messages").push(json!({
        "role": "assistant", "content": null,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }));
    for messages in [with_image, with_call] {
        let body = json!({"messages": messages, "model": "chatml"});
        let (status, answer) = query(addr, "/query", &body);
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["query_tokens"], 0, "{answer}");
        let held: Vec<&Value> = answer["scores"]
            .as_array()
            .expect("scores")
            .iter()
            .filter(|score| score["matched_blocks"] != 0)
            .collect();
        assert!(held.is_empty(), "a miss, never a hit: {answer}");
        let (status, selected) = query(addr, "/select", &body);
        assert_eq!(status, 200, "{selected}");
        assert_eq!(
            selected["instance"], "chatml",
            "the model's own rank: {selected}"
        );
        assert_eq!(selected["query_tokens"], 0, "{selected}");
    }
}

#[test]
fn a_template_that_fails_makes_the_chat_unreadable_not_refused() {
    let root = tempfile::tempdir().expect("a temporary directory");
    let dir = chatml_copy(root.path(), "refusing");
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start\nwith the user: ' ~ messages[0]['content']) }}{% endif %}{{ messages[0]['content'] }}",
    )
    .expect("write");
    let tokenizer =
        kv_indexer::tokenize::ModelTokenizer::load(&dir).unwrap_or_else(|e| panic!("{e:#}"));
    let mut ids = Vec::new();
    let error = tokenizer
        .encode_chat(
            &json!([{"role": "system", "content": "café"}]),
            None,
            &mut ids,
        )
        .expect_err("the template refuses");
    let EncodeError::Unreadable(why) = error else {
        panic!("{error:?}");
    };
    // One line of printable ASCII: it goes into an HTTP header.
    assert!(
        why.contains("Conversation must start\\nwith the user: caf\\u{e9}"),
        "{why}"
    );
    assert!(
        why.bytes().all(|b| b == b' ' || b.is_ascii_graphic()),
        "{why}"
    );
    tokenizer
        .encode_chat(&json!([{"role": "user", "content": "hi"}]), None, &mut ids)
        .expect("rendered");
    assert!(!ids.is_empty());
}

/// A copy of the ChatML tokenizer directory in `root/name`, for a test to break or change
/// (the families are trained once per `root`).
fn chatml_copy(root: &Path, name: &str) -> std::path::PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("a directory");
    let families = root.join("families");
    if !families.exists() {
        tokenizer_dir::write_all(&families).expect("tokenizer directories");
    }
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(root.join("families/chatml").join(file), dir.join(file)).expect("copy");
    }
    dir
}

fn load_error(dir: &Path) -> String {
    match kv_indexer::tokenize::ModelTokenizer::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(error) => format!("{error:#}"),
    }
}

#[test]
fn loading_names_the_file_of_every_problem() {
    let root = tempfile::tempdir().expect("a temporary directory");
    let missing = root.path().join("missing");
    std::fs::create_dir_all(&missing).expect("a directory");
    let error = load_error(&missing);
    assert!(
        error.starts_with(&format!(
            "{}: cannot read",
            missing.join("tokenizer.json").display()
        )),
        "{error}"
    );

    let bad_template = chatml_copy(root.path(), "bad-template");
    std::fs::write(bad_template.join("chat_template.jinja"), "{% for m in %}").expect("write");
    let error = load_error(&bad_template);
    assert!(
        error.contains(
            &bad_template
                .join("chat_template.jinja")
                .display()
                .to_string()
        ),
        "{error}"
    );

    let unknown_token = chatml_copy(root.path(), "unknown-token");
    let config_path = unknown_token.join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("read")).expect("JSON");
    config["eos_token"] = json!("<|no such token|>");
    std::fs::write(&config_path, config.to_string()).expect("write");
    assert_eq!(
        load_error(&unknown_token),
        format!(
            "{}: eos_token \"<|no such token|>\" is not a token of tokenizer.json",
            config_path.display()
        )
    );
}

#[test]
fn a_chat_template_file_wins_over_the_configs_template() {
    let root = tempfile::tempdir().expect("a temporary directory");
    let dir = chatml_copy(root.path(), "own-template");
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ 'Q: ' + messages[0]['content'] | trim }}\n",
    )
    .expect("write");
    let tokenizer =
        kv_indexer::tokenize::ModelTokenizer::load(&dir).unwrap_or_else(|e| panic!("{e:#}"));
    let messages = json!([{"role": "user", "content": "  hello there "}]);
    let (mut chat, mut text) = (Vec::new(), Vec::new());
    tokenizer
        .encode_chat(&messages, None, &mut chat)
        .expect("rendered");
    // ChatML has no BOS: the prompt's ids are the plain text's (trim_blocks ate the newline).
    tokenizer
        .encode_prompt("Q: hello there", &mut text)
        .expect("tokenized");
    assert_eq!(chat, text);
}

#[test]
fn a_tokenizer_that_does_not_load_rejects_the_reload_and_the_old_one_stays() {
    let root = tempfile::tempdir().expect("a temporary directory");
    let dir = chatml_copy(root.path(), "chatml");
    let zmq = zmq::Context::new();
    let rank = FakeRank::bind(&zmq, 0);
    let engine = |tokenizer: &Path| EngineToml {
        model: Some("chatml".to_owned()),
        tokenizer: Some(tokenizer.display().to_string()),
        ..EngineToml::new("chatml", rank.port)
    };
    let file = |tokenizer: &Path| indexer_toml(Some("127.0.0.1:1"), BLOCK, &[engine(tokenizer)]);
    let running = start_service(&file(&dir));
    let addr = running.http_addr();
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (status, before) = query(addr, "/query", &chat);
    assert_eq!(status, 200, "{before}");

    let gone = root.path().join("gone");
    std::fs::write(running.config_path(), file(&gone)).expect("rewrite the file");
    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.status, 400, "{}", reply.text());
    let problems = reply.json()["problems"].to_string();
    assert!(
        problems.contains(&gone.join("tokenizer.json").display().to_string()),
        "{problems}"
    );
    assert_eq!(
        query(addr, "/query", &chat),
        (200, before.clone()),
        "the old tokenizer stays"
    );

    let changed = chatml_copy(root.path(), "changed");
    std::fs::write(
        changed.join("chat_template.jinja"),
        "{{ messages[0]['content'] }}",
    )
    .expect("write");
    std::fs::write(running.config_path(), file(&changed)).expect("rewrite the file");
    let reply = post(addr, "/reload", b"");
    assert_eq!(reply.status, 200, "{}", reply.text());
    let (status, after) = query(addr, "/query", &chat);
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        after["query_tokens"],
        json!(tokens_of("hi", &changed)),
        "the new template"
    );
    assert_ne!(after["query_tokens"], before["query_tokens"]);
}

/// How many tokens the plain text `text` is for the tokenizer in `dir`.
fn tokens_of(text: &str, dir: &Path) -> usize {
    let tokenizer =
        kv_indexer::tokenize::ModelTokenizer::load(dir).unwrap_or_else(|e| panic!("{e:#}"));
    let mut ids = Vec::new();
    tokenizer.encode_prompt(text, &mut ids).expect("tokenized");
    ids.len()
}
