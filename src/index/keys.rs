//! Block keys: our own chained hash of a block's content and identity (`docs.md`, "Block keys").
//!
//! The same code hashes events and queries, so a block stored by any engine and the same tokens
//! in a prompt always meet on one key, whatever the engines' own hash seeds. It never looks at
//! engine hashes and never touches the index.

use std::slice::ChunksExact;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::wire::BlockExtras;

const SEED: u64 = 1337;

/// The key of a block whose predecessor (or LoRA root) is `parent` and whose own tokens hash to
/// `local`.
pub(super) fn chain(parent: u64, local: u64) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.to_le_bytes());
    bytes[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&bytes, SEED)
}

/// The hash of one block's tokens, as little-endian u32 bytes.
fn local_hash(block: &[u32]) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the bytes of a `[u32]` on a little-endian target are its tokens' little-endian
        // bytes: same address, `size_of_val` bytes long, no padding, and `u8` needs no alignment.
        let bytes = unsafe {
            std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), std::mem::size_of_val(block))
        };
        xxh3_64_with_seed(bytes, SEED)
    }
    #[cfg(target_endian = "big")]
    {
        let bytes: Vec<u8> = block.iter().flat_map(|token| token.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, SEED)
    }
}

/// The value a LoRA adapter's first block chains from.
pub(super) fn lora_root(lora_name: &str) -> u64 {
    xxh3_64_with_seed(lora_name.as_bytes(), SEED)
}

/// A multimodal item of a prompt, as a router knows it (vLLM's `MultiModalFeatureSpec`): its
/// identifier and the tokens it spans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmFeature {
    pub identifier: String,
    /// The item's first token.
    pub offset: u32,
    /// Its length in tokens.
    pub length: u32,
}

/// A prompt with everything its blocks' keys cover.
#[derive(Clone, Copy, Debug, Default)]
pub struct Prompt<'a> {
    pub tokens: &'a [u32],
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    /// Multimodal items, in any order.
    pub mm_features: &'a [MmFeature],
}

impl Prompt<'_> {
    /// Nothing but tokens (and maybe an adapter): the keys of the plain chain.
    fn is_plain(&self) -> bool {
        self.cache_salt.is_none() && self.mm_features.is_empty()
    }
}

/// Tags of the extras encoding (`docs.md`, "Block keys"); a query never produces
/// `OPAQUE`, so a block carrying it is never matched.
const MM_ITEM: u8 = 1;
const SALT: u8 = 2;
const LOOKAHEAD: u8 = 3;
const OPAQUE: u8 = 4;

/// Appends the extras encoding of one block to `out` (cleared first): each overlapping
/// multimodal item (tag, identifier, offset from the block's first token), the salt, the
/// lookahead tokens, the opaque inputs, each length-prefixed, in that order.
fn encode_extras<'a>(
    out: &mut Vec<u8>,
    mm_items: impl Iterator<Item = (&'a str, i64)>,
    salt: Option<&str>,
    lookahead: &[u32],
    opaque: &[u8],
) {
    out.clear();
    let field = |out: &mut Vec<u8>, tag: u8, bytes: &[u8]| {
        out.push(tag);
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    };
    for (identifier, offset) in mm_items {
        field(out, MM_ITEM, identifier.as_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
    }
    if let Some(salt) = salt {
        field(out, SALT, salt.as_bytes());
    }
    if !lookahead.is_empty() {
        let tokens: Vec<u8> = lookahead.iter().flat_map(|t| t.to_le_bytes()).collect();
        field(out, LOOKAHEAD, &tokens);
    }
    if !opaque.is_empty() {
        field(out, OPAQUE, opaque);
    }
}

/// Where each block's extras come from.
enum Extras<'t> {
    /// A store's, one entry per block.
    Event(&'t [BlockExtras]),
    /// A prompt's salt and multimodal items (sorted by offset, as engines list them), and the
    /// lookahead its scorer hashes.
    Prompt {
        tokens: &'t [u32],
        salt: Option<&'t str>,
        mm: Vec<&'t MmFeature>,
        lookahead: usize,
    },
}

/// A chain's extras and the scratch to encode them; boxed, so that a plain chain (the common
/// case) carries one pointer for them.
struct ExtrasSource<'t> {
    from: Extras<'t>,
    block_size: usize,
    /// Full blocks of the chain in all, hashed or not.
    total: usize,
    encoded: Vec<u8>,
}

impl ExtrasSource<'_> {
    /// The hash of block `index`'s extras, `None` when it has none.
    fn hash(&mut self, index: usize) -> Option<u64> {
        match &self.from {
            Extras::Event(extras) => {
                let extras = extras.get(index)?;
                if extras.is_plain() {
                    return None;
                }
                let mm = extras
                    .mm_items
                    .iter()
                    .map(|item| (item.identifier.as_str(), item.offset));
                encode_extras(
                    &mut self.encoded,
                    mm,
                    extras.cache_salt.as_deref(),
                    &extras.lookahead,
                    &extras.opaque,
                );
            }
            Extras::Prompt {
                tokens,
                salt,
                mm,
                lookahead,
            } => {
                let start = (index * self.block_size) as u64;
                let end = start + self.block_size as u64;
                let overlapping = mm
                    .iter()
                    .filter(|f| {
                        u64::from(f.offset) < end
                            && u64::from(f.offset) + u64::from(f.length) > start
                    })
                    .map(|f| (f.identifier.as_str(), i64::from(f.offset) - start as i64));
                let following = tokens
                    .get(end as usize..end as usize + lookahead)
                    .unwrap_or_default();
                let salt = if index == 0 { *salt } else { None };
                encode_extras(&mut self.encoded, overlapping, salt, following, &[]);
            }
        }
        (!self.encoded.is_empty()).then(|| xxh3_64_with_seed(&self.encoded, SEED))
    }
}

/// The keys of consecutive full blocks, computed one at a time (a query stops hashing where its
/// search stops).
pub(super) struct KeyChain<'t> {
    blocks: ChunksExact<'t, u32>,
    /// What the next block chains from: the previous key, or the parent's key / LoRA root for the
    /// first block; `None` makes the first key the block's content hash.
    previous: Option<u64>,
    /// `None`: plain blocks, keyed by the chain of token hashes alone.
    extras: Option<Box<ExtrasSource<'t>>>,
}

impl<'t> KeyChain<'t> {
    /// Keys of `tokens`' full blocks. `block_size` must be non-zero.
    pub(super) fn new(tokens: &'t [u32], block_size: usize, chained_from: Option<u64>) -> Self {
        KeyChain {
            blocks: tokens.chunks_exact(block_size),
            previous: chained_from,
            extras: None,
        }
    }

    fn with_extras(mut self, from: Extras<'t>, block_size: usize) -> Self {
        self.extras = Some(Box::new(ExtrasSource {
            from,
            block_size,
            total: self.blocks.len(),
            encoded: Vec::new(),
        }));
        self
    }

    /// The keys of a store's blocks, with their extras (empty, or one entry per block).
    pub(super) fn for_event(
        tokens: &'t [u32],
        block_size: usize,
        chained_from: Option<u64>,
        extras: &'t [BlockExtras],
    ) -> Self {
        let chain = Self::new(tokens, block_size, chained_from);
        if extras.is_empty() {
            return chain;
        }
        chain.with_extras(Extras::Event(extras), block_size)
    }

    /// The chain of a prompt (or of an event without parent) for an optional LoRA adapter.
    pub(super) fn for_prompt(tokens: &'t [u32], block_size: usize, lora: Option<&str>) -> Self {
        Self::new(tokens, block_size, lora.map(lora_root))
    }

    /// The chain of a prompt as an engine hashing `lookahead` following tokens sees it: a block
    /// is keyed only when that many tokens follow it.
    pub(super) fn for_scoring(prompt: &Prompt<'t>, block_size: usize, lookahead: usize) -> Self {
        if prompt.is_plain() && lookahead == 0 {
            return Self::for_prompt(prompt.tokens, block_size, prompt.lora_name);
        }
        let keyed = prompt.tokens.len().saturating_sub(lookahead) / block_size * block_size;
        let chain = Self::for_prompt(&prompt.tokens[..keyed], block_size, prompt.lora_name);
        let mut mm: Vec<&MmFeature> = prompt.mm_features.iter().collect();
        mm.sort_by_key(|feature| feature.offset);
        let from = Extras::Prompt {
            tokens: prompt.tokens,
            salt: prompt.cache_salt,
            mm,
            lookahead,
        };
        chain.with_extras(from, block_size)
    }

    /// Full blocks not yet hashed.
    pub(super) fn remaining(&self) -> usize {
        self.blocks.len()
    }
}

impl Iterator for KeyChain<'_> {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        let block = self.blocks.next()?;
        let mut content = local_hash(block);
        if let Some(extras) = &mut self.extras {
            let index = extras.total - self.blocks.len() - 1;
            if let Some(extras) = extras.hash(index) {
                content = chain(content, extras);
            }
        }
        let key = match self.previous {
            Some(previous) => chain(previous, content),
            None => content,
        };
        self.previous = Some(key);
        Some(key)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.blocks.len(), Some(self.blocks.len()))
    }
}

/// A prompt's keys, hashed on demand and kept.
pub(super) struct LazyKeys<'t> {
    chain: KeyChain<'t>,
    keys: Vec<u64>,
}

impl<'t> LazyKeys<'t> {
    pub(super) fn new(chain: KeyChain<'t>) -> Self {
        LazyKeys {
            keys: Vec::with_capacity(chain.remaining()),
            chain,
        }
    }

    /// Keys hashed beforehand.
    pub(super) fn precomputed(keys: &[u64]) -> Self {
        LazyKeys {
            chain: KeyChain::new(&[], 1, None),
            keys: keys.to_vec(),
        }
    }

    /// Full blocks in the prompt.
    pub(super) fn len(&self) -> usize {
        self.keys.len() + self.chain.remaining()
    }

    /// Key `i`, hashing up to it if needed. `i` must be below `len()`.
    pub(super) fn get(&mut self, i: usize) -> u64 {
        while self.keys.len() <= i {
            match self.chain.next() {
                Some(key) => self.keys.push(key),
                None => break,
            }
        }
        self.keys[i]
    }
}

#[cfg(test)]
mod tests {
    use super::{chain, lora_root};
    use crate::index::block_keys;

    #[test]
    fn keys_match_the_known_answers() {
        assert_eq!(
            block_keys(&[1, 2, 3, 4], 4, None),
            vec![14643705804678351452]
        );
        let tokens: Vec<u32> = (1..=8).collect();
        assert_eq!(
            block_keys(&tokens, 4, None),
            vec![14643705804678351452, 4945711292740353085]
        );
        // Trailing tokens that do not fill a block are ignored.
        assert_eq!(block_keys(&(1..=10).collect::<Vec<_>>(), 4, None).len(), 2);
    }

    #[test]
    fn lora_keys_differ_from_base_keys_and_between_adapters() {
        let tokens: Vec<u32> = (1..=8).collect();
        let base = block_keys(&tokens, 4, None);
        let a = block_keys(&tokens, 4, Some("a"));
        let b = block_keys(&tokens, 4, Some("b"));
        let second_local = block_keys(&tokens[4..], 4, None)[0];
        assert_eq!(a[0], chain(lora_root("a"), base[0]));
        assert_eq!(a[1], chain(a[0], second_local));
        assert_eq!(base[1], chain(base[0], second_local));
        assert!(base.iter().all(|k| !a.contains(k) && !b.contains(k)));
        assert!(a.iter().all(|k| !b.contains(k)));
    }
}
