//! Tokenizing text a piece at a time, with a bounded cache of pieces seen recently.
//!
//! A Hugging Face tokenizer cuts the text at its added tokens first (`<|im_start|>`, `<s>`, …:
//! leftmost-longest over the raw text) and tokenizes each piece between them on its own, so
//! the ids of a rendered chat are the ids of its pieces laid end to end. A multi-turn chat
//! repeats its system prompt and earlier turns request after request: those pieces come from
//! the cache and only the new turn is tokenized. The cut is exact only when no added token
//! strips or normalizes and the pre-tokenizer treats every piece alike (`piecewise_is_exact`);
//! for other tokenizers the whole text is tokenized, and cached whole.
//!
//! Owns: the cut, the cache and its bound. Never: decides what text to tokenize (`model`).

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use parking_lot::Mutex;
use tokenizers::Tokenizer;

/// Pieces shorter than this are tokenized every time: a role name or a newline costs less to
/// tokenize than to look up and copy.
const MIN_CACHED_BYTES: usize = 64;

/// What the cache of one model holds at most: its pieces' text and ids, in bytes.
const CACHE_BUDGET_BYTES: usize = 32 * 1024 * 1024;

/// Longer pieces are not cached: one huge document should not push out every system prompt.
/// A thirty-second of the budget: a retrieval or agent prompt of a few hundred KiB, repeated
/// request after request, is tokenized once (at 64 KiB it was tokenized again each time, ~17 ms
/// for 66 KiB: docs/performance.md "Big request bodies").
const MAX_CACHED_BYTES: usize = CACHE_BUDGET_BYTES / 32;

/// Pre-tokenizers that look at each piece alone, wherever it stands in the text.
const PIECEWISE_PRE_TOKENIZERS: [&str; 9] = [
    "ByteLevel",
    "Split",
    "Digits",
    "Punctuation",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
    "CharDelimiterSplit",
    "UnicodeScripts",
];

/// One model's tokenizer with its piece cache.
pub struct PieceTokenizer {
    tokenizer: Tokenizer,
    /// The added tokens and their ids, when cutting at them is exact.
    cut: Option<(AhoCorasick, Vec<u32>)>,
    cache: Mutex<Cache>,
}

/// Recently tokenized pieces, least recently used first out, within `CACHE_BUDGET_BYTES`.
struct Cache {
    pieces: lru::LruCache<Arc<str>, Arc<[u32]>>,
    bytes: usize,
}

impl Cache {
    fn put(&mut self, text: Arc<str>, ids: Arc<[u32]>) {
        self.bytes += cost(&text, &ids);
        if let Some((text, ids)) = self.pieces.push(text, ids) {
            self.bytes -= cost(&text, &ids);
        }
        while self.bytes > CACHE_BUDGET_BYTES {
            let Some((text, ids)) = self.pieces.pop_lru() else {
                break;
            };
            self.bytes -= cost(&text, &ids);
        }
    }
}

fn cost(text: &str, ids: &[u32]) -> usize {
    text.len() + std::mem::size_of_val(ids)
}

impl PieceTokenizer {
    /// `config` is `tokenizer.json`'s text, for the properties `Tokenizer` does not expose.
    pub fn new(tokenizer: Tokenizer, config: &serde_json::Value) -> anyhow::Result<Self> {
        let cut = if piecewise_is_exact(config) {
            let mut added: Vec<(String, u32)> = tokenizer
                .get_added_tokens_decoder()
                .into_iter()
                .map(|(id, token)| (token.content, id))
                .collect();
            added.sort();
            let automaton = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(added.iter().map(|(content, _)| content))?;
            Some((automaton, added.into_iter().map(|(_, id)| id).collect()))
        } else {
            None
        };
        Ok(PieceTokenizer {
            tokenizer,
            cut,
            cache: Mutex::new(Cache {
                pieces: lru::LruCache::unbounded(),
                bytes: 0,
            }),
        })
    }

    /// The ids of `text` without added special tokens (no BOS), as
    /// `tokenizer(text, add_special_tokens=False)` gives them.
    pub fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) -> tokenizers::Result<()> {
        let Some((automaton, added_ids)) = &self.cut else {
            return self.encode_cached(text, false, ids);
        };
        let mut start = 0;
        for found in automaton.find_iter(text) {
            self.encode_cached(&text[start..found.start()], false, ids)?;
            ids.push(added_ids[found.pattern().as_usize()]);
            start = found.end();
        }
        self.encode_cached(&text[start..], false, ids)
    }

    /// The ids of `text` with the tokenizer's special tokens (e.g. BOS), as
    /// `tokenizer(text)` gives them: tokenized whole, the post-processor decides what it adds.
    pub fn encode_with_specials(&self, text: &str, ids: &mut Vec<u32>) -> tokenizers::Result<()> {
        self.encode_cached(text, true, ids)
    }

    fn encode_cached(
        &self,
        text: &str,
        add_special_tokens: bool,
        ids: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        if text.is_empty() && !add_special_tokens {
            return Ok(());
        }
        // A step of a tokenizing whose client has gone: the rest is not worth its CPU.
        if super::gate::check_cancelled() {
            return Err("the client went away".into());
        }
        let cacheable = (MIN_CACHED_BYTES..=MAX_CACHED_BYTES).contains(&text.len());
        // With specials the key differs from the same text without: mark it.
        let key = |text: &str| -> Arc<str> {
            if add_special_tokens {
                Arc::from(format!("\u{0}specials\u{0}{text}"))
            } else {
                Arc::from(text)
            }
        };
        if cacheable {
            let probe = key(text);
            if let Some(cached) = self.cache.lock().pieces.get(&probe) {
                ids.extend_from_slice(cached);
                return Ok(());
            }
            let encoded = self.tokenizer.encode_fast(text, add_special_tokens)?;
            ids.extend_from_slice(encoded.get_ids());
            self.cache
                .lock()
                .put(probe, Arc::from(encoded.get_ids().to_vec()));
            return Ok(());
        }
        let encoded = self.tokenizer.encode_fast(text, add_special_tokens)?;
        ids.extend_from_slice(encoded.get_ids());
        Ok(())
    }
}

/// Whether a tokenizer's ids of a text are the ids of its pieces between added tokens, laid end
/// to end: no added token strips spaces, must stand as a single word or is matched after
/// normalization, and every pre-tokenizer treats each piece alike wherever it stands
/// (Metaspace's "prepend to the first piece only" does not).
fn piecewise_is_exact(config: &serde_json::Value) -> bool {
    let plain_added = config["added_tokens"].as_array().is_some_and(|tokens| {
        tokens.iter().all(|token| {
            ["lstrip", "rstrip", "single_word", "normalized"]
                .iter()
                .all(|flag| token[*flag].as_bool() == Some(false))
        })
    });
    plain_added && pre_tokenizer_is_piecewise(&config["pre_tokenizer"])
}

fn pre_tokenizer_is_piecewise(pre_tokenizer: &serde_json::Value) -> bool {
    if pre_tokenizer.is_null() {
        return true;
    }
    match pre_tokenizer["type"].as_str() {
        Some("Sequence") => pre_tokenizer["pretokenizers"]
            .as_array()
            .is_some_and(|all| all.iter().all(pre_tokenizer_is_piecewise)),
        Some(kind) => PIECEWISE_PRE_TOKENIZERS.contains(&kind),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metaspace_and_stripping_tokens_are_not_cut() {
        let byte_level = serde_json::json!({
            "added_tokens": [{"content": "<s>", "lstrip": false, "rstrip": false,
                              "single_word": false, "normalized": false, "special": true}],
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split"}, {"type": "ByteLevel"}]}
        });
        assert!(piecewise_is_exact(&byte_level));
        let mut metaspace = byte_level.clone();
        metaspace["pre_tokenizer"] = serde_json::json!({"type": "Metaspace"});
        assert!(!piecewise_is_exact(&metaspace));
        let mut stripping = byte_level.clone();
        stripping["added_tokens"][0]["lstrip"] = serde_json::json!(true);
        assert!(!piecewise_is_exact(&stripping));
    }

    /// Random texts of added tokens, words, Unicode, digits and odd whitespace, some pieces
    /// long enough to be cached: cut at added tokens, cold and from the cache, they get the ids
    /// the tokenizer gives the whole text.
    #[test]
    fn pieces_laid_end_to_end_are_the_whole_texts_ids() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};

        let root = tempfile::tempdir().expect("a temporary directory");
        kv_indexer_sim::tokenizer_dir::write_all(root.path()).expect("tokenizer directories");
        let path = root.path().join("chatml/tokenizer.json");
        let text = std::fs::read_to_string(&path).expect("tokenizer.json");
        let config: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let tokenizer = Tokenizer::from_bytes(text.as_bytes()).expect("a tokenizer");
        let pieces = PieceTokenizer::new(tokenizer.clone(), &config).expect("pieces");
        assert!(
            pieces.cut.is_some(),
            "the byte-level BPE is cut at its added tokens"
        );

        let added: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .map(|token| token.content)
            .collect();
        let long = "You are a helpful assistant who answers in full sentences. ".repeat(3);
        let fragments = [
            "hello",
            " world",
            "héllo",
            "你好",
            "🙂",
            "12345",
            " 3.14",
            "\n",
            "\n\n",
            "  ",
            "\t",
            " \r\n",
            "<",
            "|",
            "im_",
            "don't",
            long.as_str(),
        ];
        let mut rng = SmallRng::seed_from_u64(25);
        for round in 0..400 {
            let mut text = String::new();
            for _ in 0..rng.random_range(1..40) {
                if rng.random_ratio(1, 6) {
                    text.push_str(&added[rng.random_range(0..added.len())]);
                } else {
                    text.push_str(fragments[rng.random_range(0..fragments.len())]);
                }
            }
            let whole = tokenizer.encode_fast(text.as_str(), false).expect("encode");
            for pass in ["cold", "cached"] {
                let mut ids = Vec::new();
                pieces.encode_plain(&text, &mut ids).expect("encode");
                assert_eq!(ids, whole.get_ids(), "round {round}, {pass}: {text:?}");
            }
        }
        assert!(
            !pieces.cache.lock().pieces.is_empty(),
            "long pieces were cached"
        );
    }
}
