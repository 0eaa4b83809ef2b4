//! A minimal zero-copy msgpack reader: a cursor over `&[u8]` that yields value headers, borrowed
//! strings and skips whole values of any type.
//!
//! It owns bounds checking for every read, so callers never index the buffer. It never builds a
//! value tree, never allocates, and never recurses (skipping nested values is a counter), so
//! hostile nesting or lengths cost at most one pass over the input.

/// Why a read failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadError {
    /// The buffer ends inside a value.
    Truncated,
    /// The byte at this offset is `0xc1`, which msgpack never uses.
    BadMarker(usize),
}

/// A typed read found something else than asked for: another type, an out-of-range int, or
/// bytes that do not form a value. The caller rewinds and skips whatever stands there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Unexpected;

impl From<ReadError> for Unexpected {
    fn from(_: ReadError) -> Self {
        Unexpected
    }
}

/// The head of one msgpack value. For `Str`, `Bin` and `Ext` only the length has been consumed;
/// for `Array` and `Map` the elements follow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Header {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(usize),
    Bin(usize),
    Ext(usize),
    Array(usize),
    Map(usize),
}

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// Moves back to a position returned by `position`.
    pub(crate) fn rewind(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    /// Bytes left; every msgpack value takes at least one, so this caps any element count.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn take(&mut self, len: usize) -> Result<&'a [u8], ReadError> {
        let end = self.pos.checked_add(len).ok_or(ReadError::Truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or(ReadError::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let bytes = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8, ReadError> {
        let byte = *self.buf.get(self.pos).ok_or(ReadError::Truncated)?;
        self.pos += 1;
        Ok(byte)
    }

    fn len8(&mut self) -> Result<usize, ReadError> {
        Ok(usize::from(self.byte()?))
    }

    fn len16(&mut self) -> Result<usize, ReadError> {
        Ok(usize::from(u16::from_be_bytes(self.array()?)))
    }

    fn len32(&mut self) -> Result<usize, ReadError> {
        usize::try_from(u32::from_be_bytes(self.array()?)).map_err(|_| ReadError::Truncated)
    }

    /// Reads the head of the next value.
    pub(crate) fn header(&mut self) -> Result<Header, ReadError> {
        let at = self.pos;
        let marker = self.byte()?;
        Ok(match marker {
            0x00..=0x7f => Header::Uint(u64::from(marker)),
            0x80..=0x8f => Header::Map(usize::from(marker & 0x0f)),
            0x90..=0x9f => Header::Array(usize::from(marker & 0x0f)),
            0xa0..=0xbf => Header::Str(usize::from(marker & 0x1f)),
            0xc0 => Header::Nil,
            0xc1 => return Err(ReadError::BadMarker(at)),
            0xc2 | 0xc3 => Header::Bool,
            0xc4 => Header::Bin(self.len8()?),
            0xc5 => Header::Bin(self.len16()?),
            0xc6 => Header::Bin(self.len32()?),
            0xc7 => self.ext_header(Self::len8)?,
            0xc8 => self.ext_header(Self::len16)?,
            0xc9 => self.ext_header(Self::len32)?,
            0xca => Header::Float(f64::from(f32::from_be_bytes(self.array()?))),
            0xcb => Header::Float(f64::from_be_bytes(self.array()?)),
            0xcc => Header::Uint(u64::from(self.byte()?)),
            0xcd => Header::Uint(u64::from(u16::from_be_bytes(self.array()?))),
            0xce => Header::Uint(u64::from(u32::from_be_bytes(self.array()?))),
            0xcf => Header::Uint(u64::from_be_bytes(self.array()?)),
            0xd0 => Header::Int(i64::from(i8::from_be_bytes(self.array()?))),
            0xd1 => Header::Int(i64::from(i16::from_be_bytes(self.array()?))),
            0xd2 => Header::Int(i64::from(i32::from_be_bytes(self.array()?))),
            0xd3 => Header::Int(i64::from_be_bytes(self.array()?)),
            0xd4 => self.fixext_header(1)?,
            0xd5 => self.fixext_header(2)?,
            0xd6 => self.fixext_header(4)?,
            0xd7 => self.fixext_header(8)?,
            0xd8 => self.fixext_header(16)?,
            0xd9 => Header::Str(self.len8()?),
            0xda => Header::Str(self.len16()?),
            0xdb => Header::Str(self.len32()?),
            0xdc => Header::Array(self.len16()?),
            0xdd => Header::Array(self.len32()?),
            0xde => Header::Map(self.len16()?),
            0xdf => Header::Map(self.len32()?),
            0xe0..=0xff => Header::Int(i64::from(i8::from_be_bytes([marker]))),
        })
    }

    fn ext_header(
        &mut self,
        read_len: fn(&mut Self) -> Result<usize, ReadError>,
    ) -> Result<Header, ReadError> {
        let len = read_len(self)?;
        self.byte()?; // the ext type
        Ok(Header::Ext(len))
    }

    fn fixext_header(&mut self, len: usize) -> Result<Header, ReadError> {
        self.byte()?; // the ext type
        Ok(Header::Ext(len))
    }

    /// Reads an array header.
    pub(crate) fn array_len(&mut self) -> Result<usize, Unexpected> {
        match self.header()? {
            Header::Array(len) => Ok(len),
            _ => Err(Unexpected),
        }
    }

    /// Skips one whole value, however deeply nested, without recursion.
    pub(crate) fn skip_value(&mut self) -> Result<(), ReadError> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            match self.header()? {
                Header::Str(len) | Header::Bin(len) | Header::Ext(len) => {
                    self.take(len)?;
                }
                Header::Array(len) => pending = pending.saturating_add(len),
                Header::Map(len) => pending = pending.saturating_add(len.saturating_mul(2)),
                Header::Nil
                | Header::Bool
                | Header::Uint(_)
                | Header::Int(_)
                | Header::Float(_) => {}
            }
            // Each pending value needs at least one more byte: fail now, not after a long loop.
            if pending > self.remaining() {
                return Err(ReadError::Truncated);
            }
        }
        Ok(())
    }

    /// Skips one whole value and returns its bytes.
    pub(crate) fn raw_value(&mut self) -> Result<&'a [u8], ReadError> {
        let start = self.pos;
        self.skip_value()?;
        Ok(&self.buf[start..self.pos])
    }

    /// Reads a string's bytes (not checked for UTF-8); a fixstr (every map key and medium an
    /// engine sends) is read without the general header.
    pub(crate) fn str(&mut self) -> Result<&'a [u8], Unexpected> {
        if let Some(&marker @ 0xa0..=0xbf) = self.buf.get(self.pos) {
            self.pos += 1;
            return Ok(self.take(usize::from(marker & 0x1f))?);
        }
        match self.header()? {
            Header::Str(len) => Ok(self.take(len)?),
            _ => Err(Unexpected),
        }
    }

    /// Reads a full-width uint (`0xcf` and 8 bytes: how vLLM and TensorRT-LLM send block
    /// hashes); `None`, consuming nothing, for anything else.
    pub(crate) fn full_width_uint(&mut self) -> Option<u64> {
        let [0xcf, value @ ..] = *self.buf.get(self.pos..)?.first_chunk::<9>()? else {
            return None;
        };
        self.pos += 9;
        Some(u64::from_be_bytes(value))
    }

    /// Appends an array of token ids to `tokens`. Any element that is not an int in
    /// `0..=u32::MAX` (SGLang bigram pairs, strings, negatives) is `Unexpected`; so is an array
    /// longer than the bytes left, which every read would end in.
    pub(crate) fn token_ids_into(&mut self, tokens: &mut Vec<u32>) -> Result<(), Unexpected> {
        let len = self.array_len()?;
        if len > self.remaining() {
            return Err(Unexpected);
        }
        let first = tokens.len();
        tokens.resize(first + len, 0);
        // Locals, which the stores into `tokens` cannot alias: kept in registers.
        let (buf, mut pos) = (self.buf, self.pos);
        for slot in &mut tokens[first..] {
            // The hot loop of the whole decoder (half the bytes of a 96-block step): one bounds
            // check and one table lookup per token, no branch on which of the usual encodings
            // it is (a 150k vocabulary mixes uint16 and uint32 at random, which a match
            // mispredicts about every other token).
            if let Some(window) = buf.get(pos..).and_then(<[u8]>::first_chunk::<8>) {
                let read = TOKEN_READS[usize::from(window[0])];
                if read.size > 0 {
                    let word = u64::from_be_bytes(*window);
                    *slot = ((word << read.shift_left) >> read.shift_right) as u32;
                    pos += usize::from(read.size);
                    continue;
                }
            }
            // Another encoding, or the array's last 7 bytes.
            self.pos = pos;
            *slot = match self.header()? {
                Header::Uint(value) => u32::try_from(value).map_err(|_| Unexpected)?,
                Header::Int(value) => u32::try_from(value).map_err(|_| Unexpected)?,
                _ => return Err(Unexpected),
            };
            pos = self.pos;
        }
        self.pos = pos;
        Ok(())
    }

    /// Reads an array of token ids into a new `Vec<u32>` (see `token_ids_into`).
    pub(crate) fn token_ids(&mut self) -> Result<Vec<u32>, Unexpected> {
        let mut tokens = Vec::new();
        self.token_ids_into(&mut tokens)?;
        Ok(tokens)
    }
}

/// How a token in one of the usual encodings is cut out of the 8 bytes from its marker, read as
/// a big-endian u64: `(word << shift_left) >> shift_right`, `size` bytes long. Four-byte
/// aligned, so that an entry is found with a shift rather than a multiply by 3.
#[derive(Clone, Copy)]
#[repr(C, align(4))]
struct TokenRead {
    /// 0: not one of the usual encodings.
    size: u8,
    shift_left: u8,
    shift_right: u8,
}

/// By marker byte: positive fixint, uint8, uint16, uint32.
const TOKEN_READS: [TokenRead; 256] = token_reads();

const fn token_reads() -> [TokenRead; 256] {
    let none = TokenRead {
        size: 0,
        shift_left: 0,
        shift_right: 0,
    };
    let mut table = [none; 256];
    let mut marker = 0;
    while marker < 0x80 {
        table[marker] = TokenRead {
            size: 1,
            shift_left: 0,
            shift_right: 56,
        };
        marker += 1;
    }
    table[0xcc] = TokenRead {
        size: 2,
        shift_left: 8,
        shift_right: 56,
    };
    table[0xcd] = TokenRead {
        size: 3,
        shift_left: 8,
        shift_right: 48,
    };
    table[0xce] = TokenRead {
        size: 5,
        shift_left: 8,
        shift_right: 32,
    };
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_value_steps_over_nested_containers_bin_and_ext() {
        // [{"a": [1, bin(2)]}, fixext4, ext8(3)] then a trailing 0x07.
        let bytes = [
            0x93, 0x81, 0xa1, b'a', 0x92, 0x01, 0xc4, 0x02, 0xaa, 0xbb, 0xd6, 0x05, 1, 2, 3, 4,
            0xc7, 0x03, 0x09, 1, 2, 3, 0x07,
        ];
        let mut reader = Reader::new(&bytes);
        assert_eq!(reader.skip_value(), Ok(()));
        assert_eq!(reader.header(), Ok(Header::Uint(7)));
        assert_eq!(reader.remaining(), 0);
    }

    #[test]
    fn hostile_lengths_fail_fast_as_truncated() {
        let array32_max = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(
            Reader::new(&array32_max).skip_value(),
            Err(ReadError::Truncated)
        );
        assert_eq!(Reader::new(&array32_max).token_ids(), Err(Unexpected));
        let str32_max = [0xdb, 0xff, 0xff, 0xff, 0xff, b'a'];
        assert_eq!(Reader::new(&str32_max).str(), Err(Unexpected));
    }

    #[test]
    fn deep_nesting_does_not_recurse() {
        let mut bytes = vec![0x91; 1_000_000];
        bytes.push(0xc0);
        assert_eq!(Reader::new(&bytes).skip_value(), Ok(()));
    }

    #[test]
    fn unused_marker_is_reported_with_its_offset() {
        let bytes = [0x92, 0x01, 0xc1];
        assert_eq!(
            Reader::new(&bytes).skip_value(),
            Err(ReadError::BadMarker(2))
        );
    }

    #[test]
    fn token_ids_accept_every_int_encoding_in_u32_range() {
        // 5, 200 (u8), 1000 (u16), 150000 (u32), 7 as u64, 9 as i8, 70000 as i32.
        let bytes = [
            0x97, 0x05, 0xcc, 200, 0xcd, 0x03, 0xe8, 0xce, 0x00, 0x02, 0x49, 0xf0, 0xcf, 0, 0, 0,
            0, 0, 0, 0, 7, 0xd0, 9, 0xd2, 0x00, 0x01, 0x11, 0x70,
        ];
        let tokens = Reader::new(&bytes).token_ids();
        assert_eq!(tokens, Ok(vec![5, 200, 1000, 150_000, 7, 9, 70_000]));
    }

    #[test]
    fn token_ids_reject_negatives_pairs_and_oversized_ints() {
        for bytes in [
            &[0x91, 0xff][..],
            &[0x91, 0x92, 0x01, 0x02],
            &[0x91, 0xa1, b'a'],
            &[0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
        ] {
            assert_eq!(
                Reader::new(bytes).token_ids(),
                Err(Unexpected),
                "{bytes:x?}"
            );
        }
    }
}
