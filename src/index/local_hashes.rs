//! Keys from blocks' local hashes, for routers that hash a prompt's blocks themselves (the
//! Dynamo API's `POST /query_by_hash`).
//!
//! Owns one rule: a prompt whose block `i` has local hash `h_i` (xxh3-64, seed 1337, of the
//! block's tokens as little-endian u32: Dynamo's `compute_block_hash_for_seq` and our own
//! `keys::local_hash`) has the keys `/query` computes from its tokens. Never sees tokens, LoRA
//! roots, salts or multimodal items: a router hashing those in cannot be matched this way.

use super::keys::chain;

/// The chained keys of a prompt given its blocks' local hashes: the first key is the first
/// local hash, each next one chains from the key before it, as `block_keys` does.
pub fn keys_of_local_hashes(local_hashes: &[u64]) -> Vec<u64> {
    let mut keys = Vec::with_capacity(local_hashes.len());
    let mut previous = None;
    for &local in local_hashes {
        let key = previous.map_or(local, |parent| chain(parent, local));
        keys.push(key);
        previous = Some(key);
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::keys_of_local_hashes;
    use crate::index::block_keys;

    #[test]
    fn local_hashes_chain_to_the_keys_of_the_tokens() {
        let tokens: Vec<u32> = (0..5 * 16).map(|t| t * 7 + 3).collect();
        // A one-block prompt's only key is its block's local hash.
        let local: Vec<u64> = tokens
            .chunks(16)
            .map(|block| block_keys(block, 16, None)[0])
            .collect();
        assert_eq!(keys_of_local_hashes(&local), block_keys(&tokens, 16, None));
        assert_eq!(keys_of_local_hashes(&[]), Vec::<u64>::new());
    }

    #[test]
    fn the_local_hash_is_dynamos_xxh3_seed_1337_of_little_endian_tokens() {
        let block: Vec<u32> = (1..=16).collect();
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            block_keys(&block, 16, None),
            vec![xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 1337)]
        );
    }
}
