//! The `/query` fast path: the common body shape read in one pass over the bytes. It accepts
//! nothing serde would reject or read differently (`tests` compares the two on generated and
//! mutated bodies), and answers `None`, never an error, for anything else.

use super::QueryRequest;
use crate::index::MmFeature;

/// Reads the common body shape in one pass over the bytes, faster than serde (`bench_http`
/// prints both parses' times):
/// an object with `token_ids` (an array of plain decimal integers: no sign, fraction, exponent
/// or leading zero, each at most `u32::MAX`) and optionally `model`, `lora_name` and
/// `cache_salt` (a string without escapes, or null) and `mm_features` (null, or an array of
/// objects with exactly `identifier`, a string without escapes, and `offset` and `length`, plain
/// integers, in any order), each key at most once, in any order, with any JSON whitespace.
/// `None` for anything else, including every error: the caller then asks serde. The tokens are
/// read into `tokens`, cleared first.
pub(super) fn scan_common_shape(body: &[u8], mut tokens: Vec<u32>) -> Option<QueryRequest> {
    let mut scan = Scanner { body, at: 0 };
    let (mut token_ids, mut model, mut lora_name, mut cache_salt) = (None, None, None, None);
    let mut mm_features = None;
    scan.require(b'{')?;
    loop {
        let key = scan.plain_string()?;
        scan.require(b':')?;
        // A repeated key means "the last one wins" to serde; rare enough to leave to it.
        match key {
            b"token_ids" if token_ids.is_none() => {
                token_ids = Some(scan.token_ids(std::mem::take(&mut tokens))?)
            }
            b"model" if model.is_none() => model = Some(scan.string_or_null()?),
            b"lora_name" if lora_name.is_none() => lora_name = Some(scan.string_or_null()?),
            b"cache_salt" if cache_salt.is_none() => cache_salt = Some(scan.string_or_null()?),
            b"mm_features" if mm_features.is_none() => mm_features = Some(scan.mm_features()?),
            _ => return None,
        }
        match scan.next_byte()? {
            b',' => continue,
            b'}' => break,
            _ => return None,
        }
    }
    scan.skip_whitespace();
    if scan.at != body.len() {
        return None;
    }
    Some(QueryRequest {
        token_ids: token_ids?,
        model: model.flatten(),
        lora_name: lora_name.flatten(),
        cache_salt: cache_salt.flatten(),
        mm_features: mm_features.unwrap_or_default(),
        text: None,
    })
}

/// A cursor over the body for [`scan_common_shape`]; every method answers `None` for whatever
/// is not the common shape.
struct Scanner<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Scanner<'a> {
    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.body.get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte that is not whitespace, consumed.
    fn next_byte(&mut self) -> Option<u8> {
        self.skip_whitespace();
        let byte = *self.body.get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    fn require(&mut self, wanted: u8) -> Option<()> {
        (self.next_byte()? == wanted).then_some(())
    }

    /// A string's bytes between its quotes, if it holds no escape and no control character
    /// (which JSON forbids unescaped).
    fn plain_string(&mut self) -> Option<&'a [u8]> {
        self.require(b'"')?;
        let rest = self.body.get(self.at..)?;
        let length = rest
            .iter()
            .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)?;
        let (text, closing) = rest.split_at(length);
        (closing.first() == Some(&b'"')).then_some(())?;
        self.at += length + 1;
        Some(text)
    }

    /// A `null`, consumed; what follows it is the caller's to check.
    fn null(&mut self) -> bool {
        self.skip_whitespace();
        let null = self
            .body
            .get(self.at..)
            .is_some_and(|rest| rest.starts_with(b"null"));
        if null {
            self.at += 4;
        }
        null
    }

    /// A `[`, and whether a `]` closes it at once (both consumed then).
    fn open_array(&mut self) -> Option<bool> {
        self.require(b'[')?;
        self.skip_whitespace();
        let empty = self.body.get(self.at) == Some(&b']');
        self.at += usize::from(empty);
        Some(empty)
    }

    fn string_or_null(&mut self) -> Option<Option<String>> {
        if self.null() {
            return Some(None);
        }
        let text = std::str::from_utf8(self.plain_string()?).ok()?;
        Some(Some(text.to_owned()))
    }

    fn token_ids(&mut self, mut tokens: Vec<u32>) -> Option<Vec<u32>> {
        tokens.clear();
        if self.open_array()? {
            return Some(tokens);
        }
        loop {
            self.skip_whitespace();
            tokens.push(self.token()?);
            // Most bodies put the comma right after the number: look there before skipping.
            let separator = match self.body.get(self.at) {
                Some(b',') => {
                    self.at += 1;
                    b','
                }
                _ => self.next_byte()?,
            };
            match separator {
                b',' => continue,
                b']' => return Some(tokens),
                _ => return None,
            }
        }
    }

    /// `null` (no items) or `[{"identifier": .., "offset": .., "length": ..}, ...]`.
    fn mm_features(&mut self) -> Option<Vec<MmFeature>> {
        let mut features = Vec::new();
        if self.null() || self.open_array()? {
            return Some(features);
        }
        loop {
            features.push(self.mm_feature()?);
            match self.next_byte()? {
                b',' => continue,
                b']' => return Some(features),
                _ => return None,
            }
        }
    }

    fn mm_feature(&mut self) -> Option<MmFeature> {
        self.require(b'{')?;
        let (mut identifier, mut offset, mut length) = (None, None, None);
        loop {
            let key = self.plain_string()?;
            self.require(b':')?;
            match key {
                b"identifier" if identifier.is_none() => {
                    self.skip_whitespace();
                    identifier = Some(std::str::from_utf8(self.plain_string()?).ok()?.to_owned());
                }
                b"offset" if offset.is_none() => {
                    self.skip_whitespace();
                    offset = Some(self.token()?);
                }
                b"length" if length.is_none() => {
                    self.skip_whitespace();
                    length = Some(self.token()?);
                }
                _ => return None,
            }
            match self.next_byte()? {
                b',' => continue,
                b'}' => break,
                _ => return None,
            }
        }
        Some(MmFeature {
            identifier: identifier?,
            offset: offset?,
            length: length?,
        })
    }

    /// A plain decimal integer in `0..=u32::MAX`; what follows it is the caller's to check.
    /// The token loop is most of a long JSON query's CPU: up to 7 digits (every id of today's
    /// vocabularies) are read 8 bytes at a time (`swar_digits`), longer numbers digit by digit.
    #[inline(always)]
    fn token(&mut self) -> Option<u32> {
        let rest = self.body.get(self.at..)?;
        let (value, digits) = match rest.first_chunk::<8>().map(|eight| swar_digits(*eight)) {
            Some((value, digits)) if digits < 8 => (u64::from(value), digits),
            _ => digit_by_digit(rest),
        };
        // "0" is the only number JSON lets start with a zero; u32::MAX has 10 digits.
        if digits == 0 || digits > 10 || (digits > 1 && rest[0] == b'0') {
            return None;
        }
        self.at += digits;
        u32::try_from(value).ok()
    }
}

/// The leading decimal digits of `rest` (at most 11: an 11th refuses the number and keeps the
/// value far from overflow) and their count.
fn digit_by_digit(rest: &[u8]) -> (u64, usize) {
    let (mut value, mut digits) = (0u64, 0usize);
    for &byte in rest.iter().take(11) {
        let digit = byte.wrapping_sub(b'0');
        if digit > 9 {
            break;
        }
        value = value * 10 + u64::from(digit);
        digits += 1;
    }
    (value, digits)
}

/// How many of these 8 bytes are leading ASCII digits, and their value: the bytes as one
/// little-endian word, the first byte that is not a digit found by its high bit after `- '0'`
/// (set for a byte below '0', by the borrow) or `+ 0x46` (set for a byte above '9'), the digits
/// then combined pairwise by three multiplications (simdjson's eight-digit parse). Borrows and
/// carries only move up, to bytes after the first non-digit, which are not read.
#[inline(always)]
fn swar_digits(eight: [u8; 8]) -> (u32, usize) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let word = u64::from_le_bytes(eight);
    let values = word.wrapping_sub(ONES * u64::from(b'0'));
    let not_digit = (values | word.wrapping_add(ONES * 0x46)) & (ONES * 0x80);
    let digits = (not_digit.trailing_zeros() / 8) as usize;
    if digits == 0 || digits == 8 {
        return (0, digits);
    }
    // The digits moved to the top bytes, zeros below them: leading zeros of an 8-digit number.
    let mut value = (values << (8 * (8 - digits))) & (ONES * 0x0f);
    value = value.wrapping_mul(1 + (10 << 8)) >> 8;
    value = (value & 0x00ff_00ff_00ff_00ff).wrapping_mul(1 + (100 << 16)) >> 16;
    value = (value & 0x0000_ffff_0000_ffff).wrapping_mul(1 + (10_000 << 32)) >> 32;
    (value as u32, digits)
}

#[cfg(test)]
mod tests {
    use super::{digit_by_digit, swar_digits};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn eight_bytes_at_a_time_read_what_the_digit_loop_reads() {
        // Digits, the bytes just outside '0'..='9', and what follows a token in JSON.
        const BYTES: &[u8] = b"0123456789/:, ]\t\x00\xff\xb9\xc9-.e";
        let mut rng = SmallRng::seed_from_u64(0x5a4);
        for _ in 0..200_000 {
            let digits = rng.random_range(0..=8);
            let eight: [u8; 8] = std::array::from_fn(|at| match at < digits {
                true => b'0' + rng.random_range(0..10u8),
                false => BYTES[rng.random_range(0..BYTES.len())],
            });
            let (value, read) = digit_by_digit(&eight);
            match swar_digits(eight) {
                (_, 8) => assert_eq!(read, 8, "{eight:?}"),
                (swar, swar_read) => {
                    assert_eq!((u64::from(swar), swar_read), (value, read), "{eight:?}")
                }
            }
        }
    }
}
