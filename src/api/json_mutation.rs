//! Test support for the body parsers' differential tests (`query_body`, `dynamo::requests`):
//! random small edits of a valid JSON body. Never used outside tests.

use rand::rngs::SmallRng;
use rand::Rng;

/// Changes one to three bytes of `body` (insert, replace or remove), favouring bytes that
/// matter to JSON: signs, digits, quotes, escapes, brackets, whitespace, bad UTF-8, `null`.
pub(crate) fn mutate(rng: &mut SmallRng, body: &[u8]) -> Vec<u8> {
    const INTERESTING: &[u8] = b"-+.eE0123456789\"\\,:[]{} \t\n\x00\x0c\x7f\x80\xc3\xa9\xffnulx";
    let mut bytes = body.to_vec();
    for _ in 0..rng.random_range(1..4) {
        let at = rng.random_range(0..=bytes.len());
        let byte = INTERESTING[rng.random_range(0..INTERESTING.len())];
        match rng.random_range(0..3) {
            0 => bytes.insert(at, byte),
            1 if at < bytes.len() => bytes[at] = byte,
            _ if at < bytes.len() => {
                bytes.remove(at);
            }
            _ => bytes.push(byte),
        }
    }
    bytes
}
