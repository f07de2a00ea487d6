//! iSCSI text keys (RFC 7143 §6 "iSCSI Text Mode Negotiation", §13 "Login/Text Operational
//! Text Keys"): parsing `key=value\0` lists, negotiating the operational keys, and CHAP's
//! value encodings (§12.1.4: `0x` hex or `0b` base64).

use thiserror::Error;

/// Longest key name, bytes (§6.1: 63).
pub const MAX_KEY_BYTES: usize = 63;
/// Longest value this target reads, bytes (§6.1: 255 for most keys; CHAP challenges and
/// responses in hex may be longer, §12.1.4 bounds binary values at 8192 bytes).
pub const MAX_VALUE_BYTES: usize = 8192 * 2 + 2;
/// Most keys one text exchange may carry.
pub const MAX_KEYS: usize = 128;

/// A text segment that is not a valid key list.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TextError {
    /// A pair without `=`.
    #[error("text pair without '='")]
    NoEquals,
    /// A key or value beyond the limits, or a key with bad characters.
    #[error("text key or value invalid or too long")]
    Invalid,
    /// More keys than [`MAX_KEYS`].
    #[error("too many text keys")]
    TooMany,
    /// A key sent twice (§6.1: a protocol error).
    #[error("key {0} sent twice")]
    Duplicate(String),
}

/// Parses a text data segment: NUL-terminated `key=value` pairs (a missing final NUL is
/// tolerated, empty pairs from padding are skipped).
///
/// # Errors
/// [`TextError`] for a pair without `=`, an over-long or non-UTF-8 key/value, too many keys,
/// a duplicate key.
pub fn parse(data: &[u8]) -> Result<Vec<(String, String)>, TextError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for pair in data.split(|&b| b == 0) {
        if pair.is_empty() {
            continue;
        }
        let eq = pair
            .iter()
            .position(|&b| b == b'=')
            .ok_or(TextError::NoEquals)?;
        let (k, v) = (&pair[..eq], &pair[eq + 1..]);
        if k.is_empty()
            || k.len() > MAX_KEY_BYTES
            || v.len() > MAX_VALUE_BYTES
            || !k
                .iter()
                .all(|c| c.is_ascii_alphanumeric() || b".-+@_".contains(c))
        {
            return Err(TextError::Invalid);
        }
        let k = String::from_utf8(k.to_vec()).map_err(|_| TextError::Invalid)?;
        let v = String::from_utf8(v.to_vec()).map_err(|_| TextError::Invalid)?;
        if out.iter().any(|(x, _)| *x == k) {
            return Err(TextError::Duplicate(k));
        }
        if out.len() == MAX_KEYS {
            return Err(TextError::TooMany);
        }
        out.push((k, v));
    }
    Ok(out)
}

/// Appends `key=value\0` to `out`.
pub fn put(out: &mut Vec<u8>, key: &str, value: &str) {
    out.extend_from_slice(key.as_bytes());
    out.push(b'=');
    out.extend_from_slice(value.as_bytes());
    out.push(0);
}

/// Parses a numerical value (§6.1 "numerical-value": decimal, or `0x` hex).
pub fn number(v: &str) -> Option<u64> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        v.parse().ok()
    } else {
        None
    }
}

/// Decodes a binary value (§6.1 "binary-value"): `0x`/`0X` hex or `0b`/`0B` base64.
pub fn decode_binary(v: &str) -> Option<Vec<u8>> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        let h = h.as_bytes();
        // An odd digit count: a leading zero is implied.
        let mut out = Vec::with_capacity(h.len().div_ceil(2));
        let mut it = h.iter();
        if h.len() % 2 == 1 {
            out.push(hexval(*it.next()?)?);
        }
        while let (Some(&a), Some(&b)) = (it.next(), it.next()) {
            out.push(hexval(a)? << 4 | hexval(b)?);
        }
        (!out.is_empty()).then_some(out)
    } else if let Some(b) = v.strip_prefix("0b").or_else(|| v.strip_prefix("0B")) {
        base64(b.as_bytes())
    } else {
        None
    }
}

/// Encodes bytes as a `0x` hex binary value.
pub fn encode_hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(2 + b.len() * 2);
    s.push_str("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

fn hexval(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Standard base64 (RFC 4648 §4) with `=` padding.
fn base64(s: &[u8]) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    if s.is_empty() || !s.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for (i, q) in s.chunks(4).enumerate() {
        let last = i == s.len() / 4 - 1;
        let pads = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pads > 2 || (pads > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pads] {
            n = n << 6 | val(c)?;
        }
        n <<= 6 * pads as u32;
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pads]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs_and_refuses_garbage() {
        let kv = parse(b"InitiatorName=iqn.x\0SessionType=Normal\0\0\0").unwrap();
        assert_eq!(kv.len(), 2);
        assert_eq!(kv[1], ("SessionType".into(), "Normal".into()));
        assert_eq!(parse(b"NoEquals\0"), Err(TextError::NoEquals));
        assert!(matches!(parse(b"A=1\0A=2\0"), Err(TextError::Duplicate(_))));
        assert_eq!(parse(b"=1\0"), Err(TextError::Invalid));
        assert_eq!(parse(b"A=\xff\0"), Err(TextError::Invalid));
    }

    #[test]
    fn numbers_and_binary_values() {
        assert_eq!(number("262144"), Some(262144));
        assert_eq!(number("0x10"), Some(16));
        assert_eq!(number("-1"), None);
        assert_eq!(decode_binary("0x0aff"), Some(vec![0x0a, 0xff]));
        assert_eq!(decode_binary("0xabc"), Some(vec![0x0a, 0xbc]));
        assert_eq!(decode_binary("0bAQID"), Some(vec![1, 2, 3]));
        assert_eq!(decode_binary("0bAQI="), Some(vec![1, 2]));
        assert_eq!(decode_binary("0bAQ=="), Some(vec![1]));
        assert_eq!(decode_binary("0xzz"), None);
        assert_eq!(decode_binary("12"), None);
        assert_eq!(encode_hex(&[0, 0xab]), "0x00ab");
    }
}
