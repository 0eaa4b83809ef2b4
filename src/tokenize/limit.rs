//! The longest prompt a model can take, in bytes: a prompt past it is refused (413) before it
//! is tokenized, since its engine would refuse it anyway and tokenizing it costs memory.
//!
//! The limit is the model's context (`model_max_length` in `tokenizer_config.json`) times the
//! most bytes of prompt one token can stand for. That bound is read from the vocabulary: a
//! token's text in `tokenizer.json` is never shorter than the bytes it stands for (a byte-level
//! BPE writes each byte as a character of one or two bytes, SentencePiece a space as the
//! three-byte `▁`, byte fallback a byte as `<0x0A>`), so the longest token's text bounds every
//! token. A normalizer that folds Unicode (NFC, NFKC, lowercase) can make a character of up to
//! 4 bytes one byte, so the bound is 4 times the longest token then; a normalizer or
//! pre-tokenizer that can delete text (stripping, whitespace splitting) bounds nothing, and the
//! model gets no limit.
//!
//! Owns: the bound and its reasons. Never: refuses a prompt its engine could take (every
//! factor errs toward a larger limit), or reads a file (`model` hands it the parsed JSON).

use tokenizers::Tokenizer;

use crate::select::MAX_CONTEXT_TOKENS;

/// How many bytes a character can fold from (UTF-8's longest character) into one byte.
const UNICODE_FOLD: usize = 4;

/// A model's longest prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLimit {
    /// The model's context, in tokens.
    pub tokens: u64,
    /// The most bytes one token stands for.
    pub bytes_per_token: usize,
}

impl PromptLimit {
    pub fn bytes(self) -> usize {
        usize::try_from(self.tokens)
            .unwrap_or(usize::MAX)
            .saturating_mul(self.bytes_per_token)
    }

    /// The limit of a tokenizer: `None` when its config names no context (or a placeholder past
    /// any model's, as transformers writes for "unset") or its normalizer can delete text.
    pub fn of(
        config: &serde_json::Value,
        tokenizer_json: &serde_json::Value,
        tokenizer: &Tokenizer,
    ) -> Option<PromptLimit> {
        let tokens = config["model_max_length"]
            .as_u64()
            .filter(|&tokens| tokens > 0 && tokens <= MAX_CONTEXT_TOKENS)?;
        let fold = folds(&tokenizer_json["normalizer"])?;
        if deletes(&tokenizer_json["pre_tokenizer"]) {
            return None;
        }
        let longest = tokenizer
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1);
        Some(PromptLimit {
            tokens,
            bytes_per_token: longest.max(1) * fold,
        })
    }
}

/// How many bytes of prompt a normalizer may fold into one (1 when it never shrinks text),
/// `None` when it may delete text.
fn folds(normalizer: &serde_json::Value) -> Option<usize> {
    if normalizer.is_null() {
        return Some(1);
    }
    match normalizer["type"].as_str()? {
        "Sequence" => normalizer["normalizers"]
            .as_array()?
            .iter()
            .try_fold(1, |most, each| Some(most.max(folds(each)?))),
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(UNICODE_FOLD),
        "Prepend" => Some(1),
        // Llama 2's `▁` for a space: what it writes is never shorter than what it replaces.
        "Replace" => {
            let pattern = normalizer["pattern"]["String"].as_str()?;
            let content = normalizer["content"].as_str()?;
            (content.len() >= pattern.len()).then_some(1)
        }
        _ => None,
    }
}

/// Whether a pre-tokenizer may drop text (whitespace splits drop the whitespace).
fn deletes(pre_tokenizer: &serde_json::Value) -> bool {
    if pre_tokenizer.is_null() {
        return false;
    }
    match pre_tokenizer["type"].as_str() {
        Some("Sequence") => pre_tokenizer["pretokenizers"]
            .as_array()
            .is_none_or(|all| all.iter().any(deletes)),
        Some("Split") => pre_tokenizer["behavior"].as_str() == Some("Removed"),
        Some("ByteLevel" | "Metaspace" | "Digits" | "Punctuation" | "UnicodeScripts") => false,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn folding_normalizers_widen_the_bound_and_deleting_ones_remove_it() {
        assert_eq!(folds(&json!(null)), Some(1));
        assert_eq!(folds(&json!({"type": "NFC"})), Some(4));
        let llama2 = json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
        assert_eq!(folds(&llama2), Some(1));
        let shrinking = json!({"type": "Replace", "pattern": {"String": "  "}, "content": " "});
        assert_eq!(folds(&shrinking), None);
        assert_eq!(folds(&json!({"type": "StripAccents"})), None);
        assert!(!deletes(&json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]})));
        assert!(deletes(&json!({"type": "WhitespaceSplit"})));
        assert!(deletes(&json!({"type": "Split", "behavior": "Removed"})));
    }
}
