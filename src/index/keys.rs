//! Block keys: our own chained hash of a block's content (`docs/design.md`, "The key function").
//!
//! The same code hashes events and queries, so a block stored by any engine and the same tokens
//! in a prompt always meet on one key, whatever the engines' own hash seeds. It never looks at
//! engine hashes and never touches the index.

use std::slice::ChunksExact;

use xxhash_rust::xxh3::xxh3_64_with_seed;

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

/// The keys of consecutive full blocks, computed one at a time (a query stops hashing where its
/// search stops).
pub(super) struct KeyChain<'t> {
    blocks: ChunksExact<'t, u32>,
    /// What the next block chains from: the previous key, or the parent's key / LoRA root for the
    /// first block; `None` makes the first key the block's local hash.
    previous: Option<u64>,
}

impl<'t> KeyChain<'t> {
    /// Keys of `tokens`' full blocks. `block_size` must be non-zero.
    pub(super) fn new(tokens: &'t [u32], block_size: usize, chained_from: Option<u64>) -> Self {
        KeyChain {
            blocks: tokens.chunks_exact(block_size),
            previous: chained_from,
        }
    }

    /// The chain of a prompt (or of an event without parent) for an optional LoRA adapter.
    pub(super) fn for_prompt(tokens: &'t [u32], block_size: usize, lora: Option<&str>) -> Self {
        Self::new(tokens, block_size, lora.map(lora_root))
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
        let local = local_hash(block);
        let key = match self.previous {
            Some(previous) => chain(previous, local),
            None => local,
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
