//! KVEventBatch payloads (msgpack) → `EventBatch`: both event encodings (tagged arrays and
//! tagged maps) of every released engine version.
//!
//! It owns the per-event failure policy: an event that is unknown, unindexable or malformed is
//! skipped and counted, never allowed to lose the rest of its batch. It never fails a batch for
//! anything but a payload that is not a batch (or ends inside one).

use super::extras::RawIdentity;
use super::msgpack::{Header, ReadError, Reader, Unexpected};
use super::spare::Spare;
use super::{BlockRemoved, BlockStored, DecodeError, Event, EventBatch, SpecKind};

/// Why one event is skipped. Only its fact matters to the caller: the batch counts it.
pub(super) struct Skip;

impl From<ReadError> for Skip {
    fn from(_: ReadError) -> Self {
        Skip
    }
}

impl From<Unexpected> for Skip {
    fn from(_: Unexpected) -> Self {
        Skip
    }
}

impl From<ReadError> for DecodeError {
    fn from(error: ReadError) -> Self {
        match error {
            ReadError::Truncated => DecodeError::Truncated,
            ReadError::BadMarker(offset) => DecodeError::BadMarker { offset },
        }
    }
}

/// Decodes a KVEventBatch payload. Unknown or unindexable events are skipped and counted in
/// `EventBatch::skipped`; only a payload that is not a batch at all is an error.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    decode_with(payload, &mut Spare::default())
}

/// `decode_batch`, its buffers taken from `spare` (new ones when it has none).
pub(super) fn decode_with(payload: &[u8], spare: &mut Spare) -> Result<EventBatch, DecodeError> {
    let mut reader = Reader::new(payload);
    let len = match reader.header()? {
        Header::Array(len) => len,
        _ => return Err(DecodeError::NotAnArray),
    };
    if len < 2 {
        return Err(DecodeError::TooShort(len));
    }
    let ts = match reader.header()? {
        Header::Float(ts) => ts,
        Header::Uint(ts) => ts as f64,
        Header::Int(ts) => ts as f64,
        _ => return Err(DecodeError::BadTimestamp),
    };
    let event_count = match reader.header()? {
        Header::Array(count) => count,
        _ => return Err(DecodeError::BadEvents),
    };
    let mut events = spare.events();
    events.reserve(event_count.min(reader.remaining()));
    let mut skipped = 0u32;
    for _ in 0..event_count {
        let start = reader.position();
        match decode_event(&mut reader, spare) {
            Ok(event) => events.push(event),
            Err(Skip) => {
                reader.rewind(start);
                reader.skip_value()?;
                skipped = skipped.saturating_add(1);
            }
        }
    }
    // Anything after the rank (later versions' additions) is tolerated unread.
    let dp_rank = if len >= 3 {
        match reader.header()? {
            Header::Nil => None,
            Header::Uint(rank) => Some(u32::try_from(rank).map_err(|_| DecodeError::BadDpRank)?),
            Header::Int(rank) => Some(u32::try_from(rank).map_err(|_| DecodeError::BadDpRank)?),
            _ => return Err(DecodeError::BadDpRank),
        }
    } else {
        None
    };
    Ok(EventBatch {
        ts,
        dp_rank,
        events,
        skipped,
    })
}

/// Decodes one event. On `Err` the reader may stand anywhere inside it: the caller rewinds.
fn decode_event(reader: &mut Reader, spare: &mut Spare) -> Result<Event, Skip> {
    match reader.header()? {
        Header::Array(len) => decode_array_event(reader, len, spare),
        Header::Map(len) => decode_map_event(reader, len, spare),
        _ => Err(Skip),
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

fn kind(tag: &[u8]) -> Result<Kind, Skip> {
    match tag {
        b"BlockStored" => Ok(Kind::Stored),
        b"BlockRemoved" => Ok(Kind::Removed),
        b"AllBlocksCleared" => Ok(Kind::Cleared),
        _ => Err(Skip),
    }
}

/// `["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
/// extra_keys, group_idx, kv_cache_spec_kind, sliding_window]` and its shorter and longer
/// versions; `["BlockRemoved", hashes, medium, group_idx]`; `["AllBlocksCleared", medium?]`.
fn decode_array_event(reader: &mut Reader, len: usize, spare: &mut Spare) -> Result<Event, Skip> {
    if len == 0 {
        return Err(Skip);
    }
    match kind(reader.str()?)? {
        Kind::Stored => {
            if len < 5 {
                return Err(Skip);
            }
            let block_hashes = hashes(reader, spare)?;
            let parent = optional_hash(reader)?;
            let token_ids = tokens(reader, spare)?;
            let block_size = block_size(reader)?;
            let mut stored = BlockStored::new(block_hashes, parent, token_ids, block_size);
            let mut identity = RawIdentity::default();
            for position in 5..len {
                match position {
                    6 => stored.medium = optional_string(reader, spare)?,
                    7 => (stored.lora_name, identity.cache_salt) = lora_name(reader, spare)?,
                    8 => identity.extra_keys = Some(reader.raw_value()?),
                    9 => stored.group_idx = optional_u32(reader)?,
                    10 => stored.kind = optional_kind(reader)?,
                    11 => stored.sliding_window = optional_u32(reader)?,
                    _ => reader.skip_value()?,
                }
            }
            stored.extras = identity.extras(
                stored.block_hashes.len(),
                stored.lora_name.as_deref(),
                stored.parent.is_none(),
            )?;
            Ok(Event::Stored(stored))
        }
        Kind::Removed => {
            if len < 2 {
                return Err(Skip);
            }
            let mut removed = BlockRemoved {
                block_hashes: hashes(reader, spare)?,
                medium: None,
                group_idx: None,
            };
            for position in 2..len {
                match position {
                    2 => removed.medium = optional_string(reader, spare)?,
                    3 => removed.group_idx = optional_u32(reader)?,
                    _ => reader.skip_value()?,
                }
            }
            Ok(Event::Removed(removed))
        }
        Kind::Cleared => {
            let mut medium = None;
            for position in 1..len {
                match position {
                    1 => medium = optional_string(reader, spare)?,
                    _ => reader.skip_value()?,
                }
            }
            Ok(Event::Cleared { medium })
        }
    }
}

/// `{"type": ..., ...}` with keys in any order, unknown keys skipped, absent optionals `None`.
fn decode_map_event(reader: &mut Reader, len: usize, spare: &mut Spare) -> Result<Event, Skip> {
    let mut kind_seen = None;
    let mut block_hashes = None;
    let mut parent = None;
    let mut token_ids = None;
    let mut block_size_seen = None;
    let mut lora_name_seen = None;
    let mut medium = None;
    let mut group_idx = None;
    let mut kind_of_group = None;
    let mut sliding_window = None;
    let mut identity = RawIdentity::default();
    for _ in 0..len {
        match reader.str()? {
            b"type" => kind_seen = Some(kind(reader.str()?)?),
            b"block_hashes" => block_hashes = Some(hashes(reader, spare)?),
            b"parent_block_hash" => parent = optional_hash(reader)?,
            b"token_ids" => token_ids = Some(tokens(reader, spare)?),
            b"block_size" => block_size_seen = Some(block_size(reader)?),
            b"lora_name" => {
                let (name, salt) = lora_name(reader, spare)?;
                lora_name_seen = name;
                identity.cache_salt = identity.cache_salt.or(salt);
            }
            b"medium" => medium = optional_string(reader, spare)?,
            b"group_idx" => group_idx = optional_u32(reader)?,
            b"kv_cache_spec_kind" => kind_of_group = optional_kind(reader)?,
            b"kv_cache_spec_sliding_window" => sliding_window = optional_u32(reader)?,
            b"extra_keys" => identity.extra_keys = Some(reader.raw_value()?),
            b"lookahead_token_ids" => identity.lookahead = Some(reader.raw_value()?),
            b"mm_keys" => identity.mm_keys = Some(reader.raw_value()?),
            b"cache_salt" => {
                let start = reader.position();
                if let Ok(salt) = optional_string(reader, spare) {
                    // A nil here must not erase a salt the `{cache_salt}` map in `lora_name`
                    // gave: the two are read in whatever order the map has them.
                    identity.cache_salt = salt.or(identity.cache_salt.take());
                } else {
                    reader.rewind(start);
                    identity.odd_salt = Some(reader.raw_value()?);
                }
            }
            _ => reader.skip_value()?,
        }
    }
    match kind_seen.ok_or(Skip)? {
        Kind::Stored => {
            let block_hashes = block_hashes.ok_or(Skip)?;
            let extras = identity.extras(
                block_hashes.len(),
                lora_name_seen.as_deref(),
                parent.is_none(),
            )?;
            Ok(Event::Stored(BlockStored {
                block_hashes,
                parent,
                token_ids: token_ids.ok_or(Skip)?,
                block_size: block_size_seen.ok_or(Skip)?,
                lora_name: lora_name_seen,
                medium,
                group_idx,
                kind: kind_of_group,
                sliding_window,
                extras,
            }))
        }
        Kind::Removed => Ok(Event::Removed(BlockRemoved {
            block_hashes: block_hashes.ok_or(Skip)?,
            medium,
            group_idx,
        })),
        Kind::Cleared => Ok(Event::Cleared { medium }),
    }
}

/// A block hash: uint, signed int (bit-cast) or bytes (last 8 bytes big-endian).
fn hash(reader: &mut Reader) -> Result<u64, Skip> {
    match reader.header()? {
        Header::Uint(value) => Ok(value),
        Header::Int(value) => Ok(value as u64),
        Header::Bin(len) => Ok(hash_of_bytes(reader.take(len)?)),
        _ => Err(Skip),
    }
}

fn hash_of_bytes(bytes: &[u8]) -> u64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter()
        .fold(0u64, |acc, &byte| (acc << 8) | u64::from(byte))
}

fn hashes(reader: &mut Reader, spare: &mut Spare) -> Result<Vec<u64>, Skip> {
    let len = reader.array_len()?;
    let mut hashes = spare.hashes();
    hashes.reserve(len.min(reader.remaining()));
    for _ in 0..len {
        let hash = match reader.full_width_uint() {
            Some(hash) => hash,
            None => hash(reader)?,
        };
        hashes.push(hash);
    }
    Ok(hashes)
}

fn tokens(reader: &mut Reader, spare: &mut Spare) -> Result<Vec<u32>, Skip> {
    let mut tokens = spare.tokens();
    reader.token_ids_into(&mut tokens)?;
    Ok(tokens)
}

fn optional_hash(reader: &mut Reader) -> Result<Option<u64>, Skip> {
    let start = reader.position();
    if reader.header()? == Header::Nil {
        return Ok(None);
    }
    reader.rewind(start);
    hash(reader).map(Some)
}

/// Tokens per block; a negative or oversized value makes the event unindexable.
fn block_size(reader: &mut Reader) -> Result<u32, Skip> {
    match reader.header()? {
        Header::Uint(value) => u32::try_from(value).map_err(|_| Skip),
        Header::Int(value) => u32::try_from(value).map_err(|_| Skip),
        _ => Err(Skip),
    }
}

fn optional_u32(reader: &mut Reader) -> Result<Option<u32>, Skip> {
    match reader.header()? {
        Header::Nil => Ok(None),
        Header::Uint(value) => u32::try_from(value).map(Some).map_err(|_| Skip),
        Header::Int(value) => u32::try_from(value).map(Some).map_err(|_| Skip),
        _ => Err(Skip),
    }
}

/// A group's `kv_cache_spec_kind`: nil or a name, read without allocating.
fn optional_kind(reader: &mut Reader) -> Result<Option<SpecKind>, Skip> {
    match reader.header()? {
        Header::Nil => Ok(None),
        Header::Str(len) => Ok(Some(SpecKind::of_name(reader.take(len)?))),
        _ => Err(Skip),
    }
}

fn optional_string(reader: &mut Reader, spare: &mut Spare) -> Result<Option<String>, Skip> {
    match reader.header()? {
        Header::Nil => Ok(None),
        Header::Str(len) => {
            // The media every store and remove names, without a UTF-8 pass: they are in
            // every event, so the pass would be paid on every one.
            let text = match reader.take(len)? {
                b"GPU" => "GPU",
                b"CPU" => "CPU",
                bytes => std::str::from_utf8(bytes).map_err(|_| Skip)?,
            };
            Ok(Some(spare.text(text)))
        }
        _ => Err(Skip),
    }
}

/// `lora_name`: a string or nil; SGLang 0.5.18–0.5.19 put a `{cache_salt}` map in its place,
/// which names no adapter but salts the request. Returns (adapter, salt).
fn lora_name(
    reader: &mut Reader,
    spare: &mut Spare,
) -> Result<(Option<String>, Option<String>), Skip> {
    let start = reader.position();
    let Header::Map(len) = reader.header()? else {
        reader.rewind(start);
        return Ok((optional_string(reader, spare)?, None));
    };
    let mut salt = None;
    for _ in 0..len {
        match reader.str()? {
            b"cache_salt" => salt = optional_string(reader, spare)?,
            _ => reader.skip_value()?,
        }
    }
    Ok((None, salt))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_hash_uses_the_last_eight_bytes_big_endian() {
        let long: Vec<u8> = (0..32).collect();
        assert_eq!(hash_of_bytes(&long), 0x18191a1b1c1d1e1f);
        assert_eq!(hash_of_bytes(&[0x01, 0x02]), 0x0102);
        assert_eq!(hash_of_bytes(&[]), 0);
    }

    #[test]
    fn not_a_batch_is_an_error_naming_why() {
        assert_eq!(decode_batch(&[]), Err(DecodeError::Truncated));
        assert_eq!(
            decode_batch(&[0x81, 0x01, 0x02]),
            Err(DecodeError::NotAnArray)
        );
        assert_eq!(decode_batch(&[0x91, 0x01]), Err(DecodeError::TooShort(1)));
        assert_eq!(
            decode_batch(&[0x92, 0xa1, b'x', 0x90]),
            Err(DecodeError::BadTimestamp)
        );
        assert_eq!(
            decode_batch(&[0x92, 0x01, 0x01]),
            Err(DecodeError::BadEvents)
        );
        assert_eq!(
            decode_batch(&[0x93, 0x01, 0x90, 0xff]),
            Err(DecodeError::BadDpRank)
        );
        assert_eq!(
            decode_batch(&[0x92, 0x01, 0x91]),
            Err(DecodeError::Truncated)
        );
    }

    #[test]
    fn int_timestamp_and_trailing_elements_are_accepted() {
        let batch = decode_batch(&[0x94, 0x05, 0x90, 0x02, 0xa1, b'x']);
        assert_eq!(
            batch,
            Ok(EventBatch {
                ts: 5.0,
                dp_rank: Some(2),
                events: vec![],
                skipped: 0
            })
        );
    }

    #[test]
    fn malformed_events_of_any_shape_are_skipped_and_the_rest_kept() {
        // events: [7, {"type": 1}, ["BlockStored"], {nested junk}, ["AllBlocksCleared"]]
        let payload = [
            0x92, 0x00, 0x95, 0x07, 0x81, 0xa4, b't', b'y', b'p', b'e', 0x01, 0x91, 0xab, b'B',
            b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e', b'd', 0x81, 0x91, 0xc4, 0x01,
            0x00, 0xd6, 0x01, 1, 2, 3, 4, 0x91, 0xb0, b'A', b'l', b'l', b'B', b'l', b'o', b'c',
            b'k', b's', b'C', b'l', b'e', b'a', b'r', b'e', b'd',
        ];
        let batch = decode_batch(&payload);
        assert_eq!(
            batch.map(|b| (b.events, b.skipped)),
            Ok((vec![Event::Cleared { medium: None }], 4))
        );
    }

    #[test]
    fn negative_block_size_makes_the_event_unindexable() {
        // ["BlockStored", [1], nil, [1], -4]
        let mut payload = vec![0x92, 0x00, 0x91, 0x95, 0xab];
        payload.extend_from_slice(b"BlockStored");
        payload.extend_from_slice(&[0x91, 0x01, 0xc0, 0x91, 0x01, 0xfc]);
        let batch = decode_batch(&payload);
        assert_eq!(batch.map(|b| (b.events.len(), b.skipped)), Ok((0, 1)));
    }

    /// A map-form store whose salt stands in SGLang's `{cache_salt}` map under `lora_name`,
    /// beside a nil `cache_salt` key, in either order.
    fn store_with_salt_in_lora_name(nil_salt_last: bool) -> Vec<u8> {
        use rmp::encode::*;
        let mut out = Vec::new();
        let key = |out: &mut Vec<u8>, k: &str| write_str(out, k).expect("vec");
        write_array_len(&mut out, 3).expect("vec");
        write_f64(&mut out, 1.0).expect("vec");
        write_array_len(&mut out, 1).expect("vec");
        write_map_len(&mut out, 7).expect("vec");
        key(&mut out, "type");
        write_str(&mut out, "BlockStored").expect("vec");
        key(&mut out, "block_hashes");
        write_array_len(&mut out, 1).expect("vec");
        write_uint(&mut out, 7).expect("vec");
        key(&mut out, "parent_block_hash");
        write_nil(&mut out).expect("vec");
        key(&mut out, "token_ids");
        write_array_len(&mut out, 16).expect("vec");
        for token in 0..16 {
            write_uint(&mut out, token).expect("vec");
        }
        key(&mut out, "block_size");
        write_uint(&mut out, 16).expect("vec");
        let nil_salt = |out: &mut Vec<u8>| {
            write_str(out, "cache_salt").expect("vec");
            write_nil(out).expect("vec");
        };
        if !nil_salt_last {
            nil_salt(&mut out);
        }
        key(&mut out, "lora_name");
        write_map_len(&mut out, 1).expect("vec");
        key(&mut out, "cache_salt");
        write_str(&mut out, "carol").expect("vec");
        if nil_salt_last {
            nil_salt(&mut out);
        }
        write_uint(&mut out, 0).expect("vec");
        out
    }

    #[test]
    fn a_nil_cache_salt_key_keeps_the_salt_of_a_lora_name_map_in_either_order() {
        for nil_salt_last in [false, true] {
            let batch = decode_batch(&store_with_salt_in_lora_name(nil_salt_last));
            let Ok(EventBatch { events, .. }) = batch else {
                panic!("not decoded: {batch:?}");
            };
            let [Event::Stored(stored)] = &events[..] else {
                panic!("one store expected: {events:?}");
            };
            let salt = stored.extras.first().and_then(|b| b.cache_salt.as_deref());
            assert_eq!(salt, Some("carol"), "nil salt last: {nil_salt_last}");
        }
    }
}
