//! `--live-text`: the workloads' prompts as text, for routers that take no token ids
//! (sglang-router 0.3.2 answers 422 to a `prompt` of ids). Each token id becomes one word that
//! the simulated tokenizer (`kv_indexer_sim::tokenizer_dir`, ChatML's, no BOS) reads as exactly
//! one token, so a prompt keeps its length and two prompts share a text prefix where they
//! shared ids: the engines (and our front ends, given the same `tokenizer`) cache and match
//! as they would have on the ids.
//!
//! Owns: the tokenizer directory of a run and the id → word mapping. Never: a word the
//! tokenizer splits.

use std::path::PathBuf;

use anyhow::{anyhow, ensure, Result};
use kv_indexer_sim::tokenizer_dir;
use tokenizers::Tokenizer;

/// The family the engines serve: no BOS, so a completion's tokens are its words.
const FAMILY: &str = "chatml";

/// The written tokenizer directories (removed on drop) and the words.
pub struct TextPrompts {
    dir: tempfile::TempDir,
    words: Vec<String>,
}

impl TextPrompts {
    /// Trains and writes the tokenizer (about a second) and finds its one-token words.
    pub fn new() -> Result<TextPrompts> {
        let dir = tempfile::tempdir()?;
        tokenizer_dir::write_all(dir.path())?;
        let path = dir.path().join(FAMILY).join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&path)
            .map_err(|error| anyhow!("reading {}: {error}", path.display()))?;
        let mut words: Vec<String> = tokenizer
            .get_vocab(false)
            .into_keys()
            .filter_map(|token| {
                let word = token.strip_prefix('Ġ')?;
                (!word.is_empty() && word.chars().all(|c| c.is_ascii_alphabetic()))
                    .then(|| format!(" {word}"))
            })
            .filter(|word| {
                tokenizer
                    .encode(word.as_str(), false)
                    .is_ok_and(|encoding| encoding.get_ids().len() == 1)
            })
            .collect();
        // The vocabulary's order is a hash map's: sorted, the mapping is the same every run.
        words.sort();
        ensure!(
            words.len() >= 16,
            "the simulated tokenizer has {} one-token words",
            words.len()
        );
        Ok(TextPrompts { dir, words })
    }

    /// The directory to give the engines and the indexer as the model's `tokenizer`.
    pub fn tokenizer(&self) -> PathBuf {
        self.dir.path().join(FAMILY)
    }

    /// `ids` as text, one word each.
    pub fn text(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&id| self.words[id as usize % self.words.len()].as_str())
            .collect()
    }
}
