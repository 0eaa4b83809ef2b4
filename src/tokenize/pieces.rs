//! Tokenizing text a piece at a time, with a bounded cache of pieces seen recently.
//!
//! A Hugging Face tokenizer cuts the text at its added tokens first (`<|im_start|>`, `<s>`, …:
//! leftmost-longest over the raw text) and tokenizes each piece between them on its own, so
//! the ids of a rendered chat are the ids of its pieces laid end to end. A multi-turn chat
//! repeats its system prompt and earlier turns request after request: those pieces come from
//! the cache and only the new turn is tokenized. A long piece is cut further into spans between
//! words (`spans`), so a long shared prefix is tokenized once too. The special tokens a
//! completion prompt gets (BOS) are the post-processor's fixed ends, laid around the pieces.
//! Each cut is used only where it is exact: for the pieces, when no added token strips or
//! normalizes and the pre-tokenizer treats every piece alike (`piecewise_is_exact`); for the
//! spans, when `spans::cutting_is_exact`; for the ends, when the post-processor adds the same
//! tokens around every text (`fixed_ends`). Otherwise the text is tokenized, and cached, whole.
//!
//! Owns: the cuts, the cache and its bound. Never: decides what text to tokenize (`model`).

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use parking_lot::Mutex;
use tokenizers::Tokenizer;

use super::spans::{self, SPAN_BYTES};

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
    /// Whether a long piece is cut into spans (only with `cut`).
    spans: bool,
    /// The ids the post-processor puts before and after every text (only with `cut`).
    ends: Option<Ends>,
    cache: Mutex<Cache>,
}

/// The special tokens a completion prompt gets around its own ids (a BOS before them, say).
#[derive(Debug, PartialEq)]
struct Ends {
    before: Vec<u32>,
    after: Vec<u32>,
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
    /// Its truncation and padding are dropped, as transformers drops them on every call that
    /// does not ask for them (vLLM's do not).
    pub fn new(mut tokenizer: Tokenizer, config: &serde_json::Value) -> anyhow::Result<Self> {
        tokenizer
            .with_truncation(None)
            .map_err(|error| anyhow::anyhow!("dropping its truncation: {error}"))?;
        tokenizer.with_padding(None);
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
        let spans = cut.is_some() && spans::cutting_is_exact(&tokenizer, config);
        let ends = cut.as_ref().and_then(|_| fixed_ends(&tokenizer, config));
        Ok(PieceTokenizer {
            tokenizer,
            cut,
            spans,
            ends,
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
            self.encode_piece(&text[start..found.start()], ids)?;
            ids.push(added_ids[found.pattern().as_usize()]);
            start = found.end();
        }
        self.encode_piece(&text[start..], ids)
    }

    /// The ids of `text` with the tokenizer's special tokens (e.g. BOS), as
    /// `tokenizer(text)` gives them: its pieces between the post-processor's fixed ends, else
    /// tokenized whole.
    pub fn encode_with_specials(&self, text: &str, ids: &mut Vec<u32>) -> tokenizers::Result<()> {
        let Some(ends) = &self.ends else {
            return self.encode_cached(text, true, ids);
        };
        ids.extend_from_slice(&ends.before);
        self.encode_plain(text, ids)?;
        ids.extend_from_slice(&ends.after);
        Ok(())
    }

    /// A piece between added tokens: span by span when it is long and spans are exact.
    fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) -> tokenizers::Result<()> {
        if !self.spans || piece.len() < 2 * SPAN_BYTES {
            return self.encode_cached(piece, false, ids);
        }
        spans::spans(piece, SPAN_BYTES).try_for_each(|span| self.encode_cached(span, false, ids))
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
            if let Some(cached) = self.cache.lock().pieces.get(&*probe) {
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

/// The ids the post-processor puts around every text, when it is one that adds fixed tokens
/// (a template, BERT's or RoBERTa's, byte-level's none) and probe texts show them fixed.
fn fixed_ends(tokenizer: &Tokenizer, config: &serde_json::Value) -> Option<Ends> {
    if !post_processor_is_fixed(&config["post_processor"]) {
        return None;
    }
    let both = |text: &str| -> Option<(Vec<u32>, Vec<u32>)> {
        let with = tokenizer.encode_fast(text, true).ok()?;
        let plain = tokenizer.encode_fast(text, false).ok()?;
        Some((with.get_ids().to_vec(), plain.get_ids().to_vec()))
    };
    let (with, plain) = both("hello")?;
    let at = (0..=with.len().checked_sub(plain.len())?)
        .find(|&at| with[at..at + plain.len()] == *plain)?;
    let ends = Ends {
        before: with[..at].to_vec(),
        after: with[at + plain.len()..].to_vec(),
    };
    ["", "Hello world, 42 times.", " x y z"]
        .iter()
        .all(|probe| {
            both(probe).is_some_and(|(with, plain)| {
                with == [ends.before.as_slice(), &plain, &ends.after].concat()
            })
        })
        .then_some(ends)
}

fn post_processor_is_fixed(processor: &serde_json::Value) -> bool {
    every_step_among(
        processor,
        "processors",
        &[
            "TemplateProcessing",
            "ByteLevel",
            "BertProcessing",
            "RobertaProcessing",
        ],
    )
}

fn pre_tokenizer_is_piecewise(pre_tokenizer: &serde_json::Value) -> bool {
    every_step_among(pre_tokenizer, "pretokenizers", &PIECEWISE_PRE_TOKENIZERS)
}

/// Whether `component` of `tokenizer.json` (a normalizer, pre-tokenizer, post-processor) is
/// absent, of one of `kinds`, or a `Sequence` (its steps under `steps`) of such.
pub(super) fn every_step_among(component: &serde_json::Value, steps: &str, kinds: &[&str]) -> bool {
    if component.is_null() {
        return true;
    }
    match component["type"].as_str() {
        Some("Sequence") => component[steps]
            .as_array()
            .is_some_and(|all| all.iter().all(|step| every_step_among(step, steps, kinds))),
        Some(kind) => kinds.contains(&kind),
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

    fn load_family(root: &std::path::Path, name: &str) -> (Tokenizer, PieceTokenizer) {
        let path = root.join(name).join("tokenizer.json");
        let text = std::fs::read_to_string(&path).expect("tokenizer.json");
        let config: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let tokenizer = Tokenizer::from_bytes(text.as_bytes()).expect("a tokenizer");
        let pieces = PieceTokenizer::new(tokenizer.clone(), &config).expect("pieces");
        (tokenizer, pieces)
    }

    /// Random texts of added tokens, words, Unicode, digits and odd whitespace, some pieces
    /// long enough to be cached and some long enough to be cut into spans: cut, cold and from
    /// the cache, they get the ids the tokenizer gives the whole text, with and without the
    /// special tokens, in each family of the simulated engines (ChatML has no BOS, Llama 3 and
    /// DeepSeek have one).
    #[test]
    fn pieces_laid_end_to_end_are_the_whole_texts_ids() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};

        let root = tempfile::tempdir().expect("a temporary directory");
        kv_indexer_sim::tokenizer_dir::write_all(root.path()).expect("tokenizer directories");
        for family in ["chatml", "llama3", "deepseek-r1"] {
            let (tokenizer, pieces) = load_family(root.path(), family);
            assert!(
                pieces.cut.is_some() && pieces.spans && pieces.ends.is_some(),
                "{family}: the byte-level BPE is cut at its added tokens and into spans, and \
                 its BOS is a fixed end"
            );
            let added: Vec<String> = tokenizer
                .get_added_tokens_decoder()
                .into_values()
                .map(|token| token.content)
                .collect();
            let long = "You are a helpful assistant who answers in full sentences. ".repeat(3);
            // Past two spans, so that it is cut: one text in eight holds it once.
            let document =
                "Section 12 of the manual, don't skip it: naïve readers 42. ".repeat(150);
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
            let mut with_document = 0;
            for round in 0..200 {
                let mut text = String::new();
                let document_after = rng.random_ratio(1, 8).then(|| rng.random_range(0..40));
                for at in 0..rng.random_range(1..40) {
                    if document_after == Some(at) {
                        text.push_str(&document);
                        with_document += 1;
                    }
                    if rng.random_ratio(1, 6) {
                        text.push_str(&added[rng.random_range(0..added.len())]);
                    } else {
                        text.push_str(fragments[rng.random_range(0..fragments.len())]);
                    }
                }
                for specials in [false, true] {
                    let whole = tokenizer
                        .encode_fast(text.as_str(), specials)
                        .expect("encode");
                    for pass in ["cold", "cached"] {
                        let mut ids = Vec::new();
                        if specials {
                            pieces
                                .encode_with_specials(&text, &mut ids)
                                .expect("encode");
                        } else {
                            pieces.encode_plain(&text, &mut ids).expect("encode");
                        }
                        assert_eq!(
                            ids,
                            whole.get_ids(),
                            "{family}, round {round}, {pass}, specials {specials}: {text:?}"
                        );
                    }
                }
            }
            assert!(
                with_document > 10,
                "{family}: {with_document} texts were cut into spans"
            );
        }
    }

    /// A second prompt that repeats the first's long prefix (a completion prompt, no added
    /// token in it) tokenizes only its spans past the prefix: the cache grows by those alone.
    #[test]
    fn a_repeated_long_prefix_is_tokenized_once() {
        let root = tempfile::tempdir().expect("a temporary directory");
        kv_indexer_sim::tokenizer_dir::write_all(root.path()).expect("tokenizer directories");
        let (tokenizer, pieces) = load_family(root.path(), "llama3");
        let prefix: String = (0..800)
            .map(|step| format!("Step {step} of the agent's instructions and its tools. "))
            .collect();
        let first = format!("{prefix}What is the first question?");
        let second = format!("{prefix}And a second one, entirely different.");
        let spans_of = |text: &str| spans::spans(text, SPAN_BYTES).count();
        assert!(spans_of(&first) > 10);

        let mut ids = Vec::new();
        pieces
            .encode_with_specials(&first, &mut ids)
            .expect("encode");
        let cached = pieces.cache.lock().pieces.len();
        assert_eq!(cached, spans_of(&first));
        ids.clear();
        pieces
            .encode_with_specials(&second, &mut ids)
            .expect("encode");
        let whole = tokenizer
            .encode_fast(second.as_str(), true)
            .expect("encode");
        assert_eq!(ids, whole.get_ids());
        assert_eq!(
            pieces.cache.lock().pieces.len(),
            cached + 1,
            "only the span holding the new question was tokenized"
        );
    }

    #[test]
    fn only_a_post_processor_of_fixed_ends_is_laid_around_the_pieces() {
        let json = |value: &str| serde_json::from_str::<serde_json::Value>(value).expect("JSON");
        assert!(post_processor_is_fixed(&serde_json::Value::Null));
        assert!(post_processor_is_fixed(&json(
            r#"{"type": "Sequence", "processors": [{"type": "ByteLevel"},
                {"type": "TemplateProcessing"}]}"#
        )));
        assert!(!post_processor_is_fixed(&json(
            r#"{"type": "SomethingNew"}"#
        )));
        assert!(!post_processor_is_fixed(&json(
            r#"{"type": "Sequence", "processors": [{"type": "SomethingNew"}]}"#
        )));
    }

    #[test]
    fn a_tokenizer_whose_truncation_or_padding_would_change_a_prompt_keeps_it_whole() {
        let root = tempfile::tempdir().expect("a temporary directory");
        kv_indexer_sim::tokenizer_dir::write_all(root.path()).expect("tokenizer directories");
        let path = root.path().join("chatml/tokenizer.json");
        let text = std::fs::read_to_string(&path).expect("tokenizer.json");
        let mut config: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        config["truncation"] = serde_json::json!({
            "direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0
        });
        config["padding"] = serde_json::json!({
            "strategy": {"Fixed": 4096}, "direction": "Right", "pad_to_multiple_of": null,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "<s>"
        });
        let truncating = Tokenizer::from_bytes(config.to_string().as_bytes()).expect("a tokenizer");
        let pieces = PieceTokenizer::new(truncating, &config).expect("pieces");
        let prompt = "word ".repeat(100);
        let mut ids = Vec::new();
        pieces
            .encode_with_specials(&prompt, &mut ids)
            .expect("encode");
        let untruncated = Tokenizer::from_bytes(text.as_bytes()).expect("a tokenizer");
        let whole = untruncated.encode_fast(prompt, true).expect("encode");
        assert!(whole.get_ids().len() > 8);
        assert_eq!(ids, whole.get_ids());
    }
}
