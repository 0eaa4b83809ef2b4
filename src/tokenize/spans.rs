//! Where a long piece of text (the text between two added tokens) is cut into spans, so that
//! prompts repeating a long prefix (an agent's instructions and tools, a retrieved document,
//! a completion prompt grown turn by turn) tokenize only what follows it: each span is cached
//! on its own (`pieces`), and the cut depends only on the text before it, so two prompts that
//! share a prefix share its spans up to the last cut within it.
//!
//! A span ends at the first space at least `SPAN_BYTES` past its start that stands between an
//! ASCII letter or digit and an ASCII letter (`…word word…`): the byte-level and whitespace
//! pre-tokenizers start a new word there, and a word is tokenized alone, so the spans' ids laid
//! end to end are the piece's. Cutting is used only for a tokenizer shown to agree
//! (`cutting_is_exact`): a normalizer that reads characters where they stand (or none), and
//! probe texts cut at every such space give the ids of the whole.
//!
//! Owns: the cut and that check. Never: caches, or decides which text is tokenized.

use tokenizers::Tokenizer;

use super::pieces::every_step_among;

/// The least a span holds: small enough that a prompt's new part drags little of its shared
/// prefix along, large enough that looking a span up costs far less than tokenizing it
/// (docs/performance.md "Big request bodies").
pub const SPAN_BYTES: usize = 4096;

/// Normalizers that read each character where it stands: cutting between two ASCII characters
/// changes nothing they do (`Prepend`, `Strip` and `Replace` look at a piece's ends or across
/// characters, and are not here).
const LOCAL_NORMALIZERS: [&str; 7] = [
    "NFC",
    "NFD",
    "NFKC",
    "NFKD",
    "Lowercase",
    "StripAccents",
    "BertNormalizer",
];

/// The spans of `text`, each at least `min_bytes` long except the last.
pub fn spans(text: &str, min_bytes: usize) -> impl Iterator<Item = &str> {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= text.len() {
            return None;
        }
        let end = span_end(text.as_bytes(), start, min_bytes);
        let span = &text[start..end];
        start = end;
        Some(span)
    })
}

/// The first cut at `start + min_bytes` or after, else the end of the text. A cut is at a
/// space, which is never inside a UTF-8 character, so every span is a `str`.
fn span_end(bytes: &[u8], start: usize, min_bytes: usize) -> usize {
    let from = (start + min_bytes).max(start + 1);
    (from..bytes.len().saturating_sub(1))
        .find(|&at| {
            bytes[at] == b' '
                && bytes[at - 1].is_ascii_alphanumeric()
                && bytes[at + 1].is_ascii_alphabetic()
        })
        .unwrap_or(bytes.len())
}

/// Whether `tokenizer` (with `config`, its `tokenizer.json`) gives a text's ids as its spans'
/// laid end to end: its normalizer is local, and texts of words, numbers, contractions,
/// punctuation, odd whitespace and non-ASCII, cut at every place a span may end, are tokenized
/// as they are whole.
pub fn cutting_is_exact(tokenizer: &Tokenizer, config: &serde_json::Value) -> bool {
    normalizer_is_local(&config["normalizer"]) && probes_agree(tokenizer)
}

fn normalizer_is_local(normalizer: &serde_json::Value) -> bool {
    every_step_among(normalizer, "normalizers", &LOCAL_NORMALIZERS)
}

/// Every pair of fragments and a few sentences, each joined by spaces where a cut falls.
fn probes_agree(tokenizer: &Tokenizer) -> bool {
    const FRAGMENTS: [&str; 16] = [
        "hello",
        "World",
        "don't",
        "it's",
        "x",
        "a1",
        "b2c",
        "12345",
        "3.14",
        "(note)",
        "end.",
        "héllo",
        "naïve",
        "你好",
        "\tindented",
        "line\n",
    ];
    let pairs = FRAGMENTS
        .iter()
        .flat_map(|a| FRAGMENTS.iter().map(move |b| format!("{a} {b} {a}")));
    let sentences = [
        "The quick brown fox jumps over the lazy dog 42 times, doesn't it?".to_string(),
        "  two  spaces and\n\nnew lines then words a b c d e f g".to_string(),
        "snake_case and CamelCase and x86 and 1st place and é è ê".to_string(),
    ];
    pairs.chain(sentences).all(|text| {
        let whole = tokenizer.encode_fast(text.as_str(), false);
        let mut cut = Vec::new();
        let each = spans(&text, 0).try_for_each(|span| {
            let encoded = tokenizer.encode_fast(span, false)?;
            cut.extend_from_slice(encoded.get_ids());
            tokenizers::Result::Ok(())
        });
        matches!((whole, each), (Ok(whole), Ok(())) if whole.get_ids() == cut.as_slice())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_ends_at_the_first_space_between_words_past_its_least_length() {
        let text = "aaaa bbbb 12 cc, dd ee";
        let cut: Vec<&str> = spans(text, 0).collect();
        assert_eq!(cut, ["aaaa", " bbbb 12", " cc, dd", " ee"]);
        let cut: Vec<&str> = spans(text, 8).collect();
        assert_eq!(cut, ["aaaa bbbb 12", " cc, dd ee"]);
        assert_eq!(spans(text, 100).collect::<Vec<_>>(), [text]);
        assert_eq!(spans("", 0).count(), 0);
        let no_place: Vec<&str> = spans("你好 你好  x  ", 0).collect();
        assert_eq!(no_place, ["你好 你好  x  "]);
    }

    /// The cut of a prefix is the cut of every text that starts with it, up to its last span.
    #[test]
    fn two_texts_sharing_a_prefix_share_its_spans() {
        let prefix = "word ".repeat(3_000);
        let first = format!("{prefix}the first question");
        let second = format!("{prefix}another question entirely");
        let first: Vec<&str> = spans(&first, SPAN_BYTES).collect();
        let second: Vec<&str> = spans(&second, SPAN_BYTES).collect();
        assert!(first.len() >= 3);
        assert_eq!(first[..first.len() - 1], second[..second.len() - 1]);
    }

    #[test]
    fn only_normalizers_that_read_characters_where_they_stand_are_local() {
        let json = |value: &str| serde_json::from_str::<serde_json::Value>(value).expect("JSON");
        assert!(normalizer_is_local(&serde_json::Value::Null));
        assert!(normalizer_is_local(&json(
            r#"{"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}"#
        )));
        for refused in [
            r#"{"type": "Prepend", "prepend": "▁"}"#,
            r#"{"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Strip"}]}"#,
            r#"{"type": "Replace", "pattern": {"String": " "}, "content": "▁"}"#,
        ] {
            assert!(!normalizer_is_local(&json(refused)), "{refused}");
        }
    }
}
