//! Tokenizer directories as the Hugging Face hub lays them out, made here and now: a small
//! byte-level BPE trained with the `tokenizers` crate on a fixed corpus (the same bytes on every
//! machine), saved with the special tokens and chat templates of real model families. Tests and
//! benchmarks point the indexer's `tokenizer` key at them; nothing is downloaded.
//!
//! `tests/data/tokenize/make_vectors.py` reads the same directories with transformers to make
//! the checked-in token-id vectors, which keep the trained model beside them
//! (`trained_model`): `tests/api/tokenize.rs` compares it, so a change in training is an error
//! that says so, not a silent mismatch.

use std::path::Path;

use anyhow::{Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

/// The special tokens every directory's tokenizer knows: ChatML's, Llama 3's and DeepSeek's.
pub const SPECIAL_TOKENS: [&str; 10] = [
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
];

/// DeepSeek's role markers, added (not special) tokens in its tokenizer as in the real one.
const ROLE_TOKENS: [&str; 2] = ["<｜User｜>", "<｜Assistant｜>"];

/// A model family: its directory name, BOS and EOS, whether a completion prompt gets BOS
/// (the post-processor), and its chat template.
pub struct Family {
    pub name: &'static str,
    pub bos: Option<&'static str>,
    pub eos: &'static str,
    pub template: &'static str,
}

/// The families the tests use. The templates are the public ones of these models (ChatML as
/// vLLM ships it in `examples/template_chatml.jinja`; Llama 3.2's text template, vLLM's
/// `examples/template_llama3.2.jinja`; DeepSeek-R1-Distill's, llama.cpp's
/// `models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja`).
pub const FAMILIES: [Family; 3] = [
    Family {
        name: "chatml",
        bos: None,
        eos: "<|im_end|>",
        template: include_str!("tokenizer_dir/chatml.jinja"),
    },
    Family {
        name: "llama3",
        bos: Some("<|begin_of_text|>"),
        eos: "<|eot_id|>",
        template: include_str!("tokenizer_dir/llama3.2.jinja"),
    },
    Family {
        name: "deepseek-r1",
        bos: Some("<｜begin▁of▁sentence｜>"),
        eos: "<｜end▁of▁sentence｜>",
        template: include_str!("tokenizer_dir/deepseek-r1-distill.jinja"),
    },
];

/// Trains the BPE (about a second) and writes one directory per family under `root`
/// (`root/chatml`, …), each with `tokenizer.json`, `tokenizer_config.json` and, for
/// `deepseek-r1`, the template in `chat_template.jinja` (the others carry it in the config).
pub fn write_all(root: &Path) -> Result<()> {
    let trained = train()?;
    for family in &FAMILIES {
        write_family(&trained, family, &root.join(family.name))?;
    }
    Ok(())
}

/// The trained tokenizer, as JSON (with every special token, no post-processor).
pub fn train() -> Result<String> {
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(2_000)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            SPECIAL_TOKENS
                .iter()
                .map(|token| AddedToken::from(*token, true))
                .collect(),
        )
        .build();
    let mut tokenizer = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<tokenizers::NormalizerWrapper>)
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_post_processor(None::<tokenizers::PostProcessorWrapper>)
        .with_decoder(Some(ByteLevelDecoder::default()))
        .build()
        .map_err(|error| anyhow::anyhow!("building the tokenizer: {error}"))?;
    tokenizer
        .train(&mut trainer, corpus().iter())
        .map_err(|error| anyhow::anyhow!("training the tokenizer: {error}"))?;
    let mut tokenizer = Tokenizer::from(tokenizer);
    tokenizer
        .add_tokens(
            ROLE_TOKENS
                .iter()
                .map(|token| AddedToken::from(*token, false).normalized(false)),
        )
        .map_err(|error| anyhow::anyhow!("adding DeepSeek's role tokens: {error}"))?;
    tokenizer
        .to_string(true)
        .map_err(|error| anyhow::anyhow!("serializing the tokenizer: {error}"))
}

fn write_family(trained: &str, family: &Family, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tokenizer = Tokenizer::from_bytes(trained.as_bytes())
        .map_err(|error| anyhow::anyhow!("reloading the tokenizer: {error}"))?;
    if let Some(bos) = family.bos {
        let id = tokenizer
            .token_to_id(bos)
            .with_context(|| format!("{bos} is not a token"))?;
        let processor = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .map_err(|error| anyhow::anyhow!("{error}"))?
            .special_tokens(vec![(bos, id)])
            .build()
            .map_err(|error| anyhow::anyhow!("{error}"))?;
        tokenizer.with_post_processor(Some(processor));
    }
    let path = dir.join("tokenizer.json");
    tokenizer
        .save(&path, true)
        .map_err(|error| anyhow::anyhow!("writing {}: {error}", path.display()))?;
    let mut config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": family.eos,
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(bos) = family.bos {
        config["bos_token"] = bos.into();
    }
    if family.name == "deepseek-r1" {
        let template = dir.join("chat_template.jinja");
        std::fs::write(&template, family.template)
            .with_context(|| format!("writing {}", template.display()))?;
    } else {
        config["chat_template"] = family.template.into();
    }
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// The training text: a few thousand lines made from fixed word lists (English, accented
/// Latin, Japanese, emoji, code), the same on every machine.
fn corpus() -> Vec<String> {
    const WORDS: [&str; 48] = [
        "the",
        "cache",
        "prefix",
        "block",
        "engine",
        "rank",
        "token",
        "prompt",
        "model",
        "router",
        "request",
        "answer",
        "system",
        "user",
        "assistant",
        "you",
        "are",
        "a",
        "helpful",
        "question",
        "think",
        "reason",
        "because",
        "therefore",
        "index",
        "query",
        "hit",
        "miss",
        "café",
        "naïve",
        "résumé",
        "über",
        "日本語",
        "東京",
        "こんにちは",
        "🙂",
        "🚀",
        "fn",
        "let",
        "mut",
        "return",
        "{",
        "}",
        "();",
        "=>",
        "0",
        "42",
        "3.14",
    ];
    const JOINS: [&str; 6] = [" ", " ", ", ", ". ", "\n", "  "];
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..4_000)
        .map(|_| {
            let length = 4 + next() % 24;
            let mut line = String::new();
            for i in 0..length {
                if i > 0 {
                    line.push_str(JOINS[(next() % JOINS.len() as u64) as usize]);
                }
                line.push_str(WORDS[(next() % WORDS.len() as u64) as usize]);
            }
            line
        })
        .collect()
}
