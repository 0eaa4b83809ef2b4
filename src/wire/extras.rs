//! The block-identity fields of a BlockStored (`docs.md`, "Block keys"; `docs/protocol.md`) →
//! `BlockExtras` per block: vLLM's `extra_keys` and `lookahead_token_ids`, SGLang's `cache_salt`,
//! TensorRT-LLM's `mm_keys`.
//!
//! Owns the reading of what an engine mixes into a block's hash: which entries a prompt can
//! reproduce (LoRA name, multimodal item and offset, cache salt, lookahead tokens) and which it
//! cannot (kept as opaque bytes, so that the block is never matched: a false hit sends a request
//! to a rank that recomputes it, a miss only costs a better choice). It never fails an event for
//! an entry it does not understand.

use super::batch::Skip;
use super::msgpack::{Header, Reader};
use super::{BlockExtras, MmPlacement};

/// An event's identity fields as read, in any key order; interpreted once the whole event (its
/// block count, LoRA name and parent) is known.
#[derive(Default)]
pub(super) struct RawIdentity<'a> {
    /// vLLM `extra_keys`: per block nil or
    /// `[lora_name?, [identifier, offset]..., salt?, digest...]`.
    pub(super) extra_keys: Option<&'a [u8]>,
    /// vLLM `lookahead_token_ids`: nil, or per block the tokens after it that its hash covers.
    pub(super) lookahead: Option<&'a [u8]>,
    /// TensorRT-LLM `mm_keys`: per block a list of multimodal keys.
    pub(super) mm_keys: Option<&'a [u8]>,
    /// SGLang's event-wide `cache_salt`.
    pub(super) cache_salt: Option<String>,
    /// Whatever stood as SGLang's `cache_salt` that is not a string or nil.
    pub(super) odd_salt: Option<&'a [u8]>,
}

impl RawIdentity<'_> {
    /// The blocks' extras: empty when every block is plain.
    pub(super) fn extras(
        &self,
        blocks: usize,
        lora_name: Option<&str>,
        starts_chain: bool,
    ) -> Result<Vec<BlockExtras>, Skip> {
        // The common store: `extra_keys` all nil and nothing else (no allocation per block).
        if self.extra_keys.is_none_or(all_nil)
            && self.lookahead.is_none_or(all_nil)
            && self.mm_keys.is_none_or(all_nil)
            && self.cache_salt.is_none()
            && self.odd_salt.is_none()
        {
            return Ok(Vec::new());
        }
        let mut extras = vec![BlockExtras::default(); blocks];
        if let Some(raw) = self.extra_keys {
            per_block(raw, &mut extras, |reader, block| {
                extra_keys(reader, block, lora_name)
            })?;
        }
        if let Some(raw) = self.lookahead {
            per_block(raw, &mut extras, |reader, block| {
                block.lookahead = reader.token_ids()?;
                Ok(())
            })?;
        }
        if let Some(raw) = self.mm_keys {
            // TensorRT-LLM's key digests and offsets are not vLLM's identifiers and offsets, and
            // no router input names them yet: such blocks are kept out of every match.
            per_block(raw, &mut extras, |reader, block| {
                let raw = reader.raw_value()?;
                if !matches!(raw, [0x90] | [0xc0]) {
                    block.opaque.extend_from_slice(raw);
                }
                Ok(())
            })?;
        }
        if let (Some(odd), true, Some(first)) = (self.odd_salt, starts_chain, extras.first_mut()) {
            first.opaque.extend_from_slice(odd);
        }
        Ok(finish(extras, self.cache_salt.as_deref(), starts_chain))
    }
}

/// Puts an event-wide salt on the chain's first block and drops the list if every block is
/// plain. vLLM salts a chain's first block; SGLang sends the salt with every event of the
/// request, and the chain already carries it after the first.
pub(super) fn finish(
    mut extras: Vec<BlockExtras>,
    event_salt: Option<&str>,
    starts_chain: bool,
) -> Vec<BlockExtras> {
    if let (Some(salt), true, Some(first)) = (event_salt, starts_chain, extras.first_mut()) {
        first.cache_salt.get_or_insert_with(|| salt.to_owned());
    }
    if extras.iter().all(BlockExtras::is_plain) {
        extras.clear();
    }
    extras
}

/// One entry of a block's `extra_keys`, whatever the encoding it came in.
pub(super) enum ExtraKey<'a> {
    Text(&'a str),
    Item(MmPlacement),
    /// Anything else, as its raw encoding.
    Other(&'a [u8]),
}

/// Adds the entry at `position` of a block's `extra_keys`
/// (`[lora_name?, [identifier, offset]..., salt?, digest...]`) to the block.
pub(super) fn add_extra_key(
    block: &mut BlockExtras,
    position: usize,
    key: ExtraKey<'_>,
    lora_name: Option<&str>,
) {
    match key {
        // vLLM lists the adapter first on every block; the key's chain root covers it.
        ExtraKey::Text(name) if position == 0 && lora_name == Some(name) => {}
        ExtraKey::Text(salt) if block.cache_salt.is_none() => {
            block.cache_salt = Some(salt.to_owned());
        }
        ExtraKey::Text(other) => block.opaque.extend_from_slice(other.as_bytes()),
        ExtraKey::Item(item) => block.mm_items.push(item),
        ExtraKey::Other(raw) => block.opaque.extend_from_slice(raw),
    }
}

/// Nil, or a list of nils only.
fn all_nil(raw: &[u8]) -> bool {
    let mut reader = Reader::new(raw);
    match reader.header() {
        Ok(Header::Nil) => true,
        Ok(Header::Array(len)) => {
            reader.remaining() == len && raw[raw.len() - len..].iter().all(|&byte| byte == 0xc0)
        }
        _ => false,
    }
}

/// Reads `raw` (nil, or one entry per block) into `extras` with `read`, which sees each block's
/// entry unless it is nil. A list that does not line up with the blocks, or an entry `read`
/// cannot take, makes the blocks concerned opaque.
fn per_block(
    raw: &[u8],
    extras: &mut [BlockExtras],
    mut read: impl FnMut(&mut Reader, &mut BlockExtras) -> Result<(), Skip>,
) -> Result<(), Skip> {
    let mut reader = Reader::new(raw);
    let len = match reader.header()? {
        Header::Nil => return Ok(()),
        Header::Array(len) => len,
        _ => return opaque_all(raw, extras),
    };
    if len != extras.len() {
        return opaque_all(raw, extras);
    }
    for block in extras.iter_mut() {
        let start = reader.position();
        if reader.header()? == Header::Nil {
            continue;
        }
        reader.rewind(start);
        if read(&mut reader, block).is_err() {
            reader.rewind(start);
            block.opaque.extend_from_slice(reader.raw_value()?);
        }
    }
    Ok(())
}

fn opaque_all(raw: &[u8], extras: &mut [BlockExtras]) -> Result<(), Skip> {
    for block in extras {
        block.opaque.extend_from_slice(raw);
    }
    Ok(())
}

/// One block's `extra_keys` entry: `[lora_name?, [identifier, offset]..., salt?, digest...]`.
fn extra_keys(
    reader: &mut Reader,
    block: &mut BlockExtras,
    lora_name: Option<&str>,
) -> Result<(), Skip> {
    let len = reader.array_len()?;
    for position in 0..len {
        let start = reader.position();
        let key = match reader.header()? {
            Header::Str(len) => std::str::from_utf8(reader.take(len)?)
                .ok()
                .map(ExtraKey::Text),
            Header::Array(2) => mm_placement(reader).map(ExtraKey::Item),
            // A prompt-embedding digest: its bytes.
            Header::Bin(len) => Some(ExtraKey::Other(reader.take(len)?)),
            _ => None,
        };
        let key = match key {
            Some(key) => key,
            None => {
                reader.rewind(start);
                ExtraKey::Other(reader.raw_value()?)
            }
        };
        add_extra_key(block, position, key, lora_name);
    }
    Ok(())
}

/// `[identifier, offset]` after its array header; `None` for any other pair.
fn mm_placement(reader: &mut Reader) -> Option<MmPlacement> {
    let identifier = std::str::from_utf8(reader.str().ok()?).ok()?.to_owned();
    let offset = match reader.header().ok()? {
        Header::Uint(offset) => i64::try_from(offset).ok()?,
        Header::Int(offset) => offset,
        _ => return None,
    };
    Some(MmPlacement { identifier, offset })
}
