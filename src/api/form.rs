//! A query string's `name=value` pairs as HTML forms encode them (`%XX` of UTF-8 bytes, `+` a
//! space: what Python's `requests` and browsers send), for the parsers that take options from
//! the URL (`query_body`'s binary body, `select_body`), and the one percent-decoder of the
//! APIs (the snapshot path's engine name too).
//!
//! Owns: splitting a query string into pairs (empty pairs skipped, a name without `=` has the
//! empty value), decoding a name or a value, and refusing a parameter given twice. Never:
//! decides which names a parser knows, or passes on a broken escape as text.

use super::BadBody;

/// One `name=value` of a query string, as sent.
pub(super) struct FormPair<'q> {
    /// The whole pair, which a refusal quotes and a parser may pass on untouched.
    pub(super) text: &'q str,
    name: &'q str,
    value: &'q str,
}

/// The pairs of `query_string` (the URL after `?`), in order.
pub(super) fn form_pairs(query_string: &str) -> impl Iterator<Item = FormPair<'_>> {
    query_string
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|text| {
            let (name, value) = text.split_once('=').unwrap_or((text, ""));
            FormPair { text, name, value }
        })
}

impl FormPair<'_> {
    /// The name, decoded.
    pub(super) fn name(&self) -> Result<String, BadBody> {
        form_decode(self.name, self.text)
    }

    /// Puts the decoded value in `slot`, the parameter `name`'s: a parameter given twice is
    /// refused (a typo or a second value would silently ask something else).
    pub(super) fn fill(&self, slot: &mut Option<String>, name: String) -> Result<(), BadBody> {
        if slot.is_some() {
            return Err(BadBody::RepeatedParameter(name));
        }
        *slot = Some(form_decode(self.value, self.text)?);
        Ok(())
    }
}

/// One name or value of `pair` decoded; a broken escape or bytes that are not UTF-8 are
/// refused with the pair as sent.
fn form_decode(text: &str, pair: &str) -> Result<String, BadBody> {
    percent_decode(&text.replace('+', " "))
        .ok_or_else(|| BadBody::NotPercentEncoded(pair.to_owned()))
}

/// `%XX` escapes decoded; `None` for a broken escape (a `%` not followed by two hex digits:
/// no sign, no space) or bytes that are not UTF-8. The `percent-encoding` crate decodes; it
/// passes a broken escape through as it is, so they are refused here first.
pub fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let escapes_whole = bytes.iter().enumerate().all(|(at, &byte)| {
        byte != b'%'
            || bytes
                .get(at + 1..at + 3)
                .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    if !escapes_whole {
        return None;
    }
    // Into a buffer of the text's size: `decode_utf8` grows its own from a few bytes, several
    // allocations for a short value (docs/performance.md "Why the percent-encoding crate").
    let mut decoded = Vec::with_capacity(bytes.len());
    decoded.extend(percent_encoding::percent_decode(bytes));
    String::from_utf8(decoded).ok()
}

#[cfg(test)]
mod tests {
    use super::percent_decode;

    #[test]
    fn percent_escapes_are_decoded_and_broken_ones_refused() {
        assert_eq!(percent_decode("vllm%20a%2Fb").as_deref(), Some("vllm a/b"));
        assert_eq!(
            percent_decode("plain-name_1").as_deref(),
            Some("plain-name_1")
        );
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(percent_decode("%+f"), None, "a sign is not a hex digit");
        assert_eq!(percent_decode("%-f"), None);
        assert_eq!(percent_decode("% f"), None);
        assert_eq!(percent_decode("%%41"), None);
        assert_eq!(percent_decode("100%"), None);
        assert_eq!(percent_decode("%41%e2%82%AC").as_deref(), Some("A€"));
    }
}
