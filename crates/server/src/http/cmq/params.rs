//! A CMQ request's parameters: an `application/x-www-form-urlencoded` query or body, each name once,
//! numbered lists as `name.1`, `name.2`, ... (`msgBody.n`, `receiptHandle.n`, `msgTag.n`).
//!
//! A batch send is mostly message bodies (16 × 1 KB and more), so the parse is one pass that
//! copies each name and value once into one buffer (`memchr` finds the `&`, `=`, `%` and `+`
//! that matter; a value without escapes is one copy), with the pairs as ranges into it, sorted by
//! name: a lookup is a binary search, and the signature is computed over them in that order
//! (`sign`) without building its text.

use std::ops::Range;

use super::CmqError;

/// At most this many parameters in one request (a batch of 16 with 16 tags each is far below).
const MAX_PARAMS: usize = 1024;

/// A parsed form: every name and value decoded (percent escapes and `+`), valid UTF-8 (invalid
/// sequences replaced, as browsers and `form_urlencoded` do).
pub struct Params {
    text: String,
    /// (name, value) ranges in `text`, sorted by name, each name once.
    pairs: Vec<(Range<usize>, Range<usize>)>,
}

impl Params {
    /// Parses a form; refused if it has too many parameters or a name twice.
    pub fn parse(raw: &[u8]) -> Result<Params, CmqError> {
        let mut text = String::with_capacity(raw.len());
        let mut pairs = Vec::new();
        let mut rest = raw;
        while !rest.is_empty() {
            let end = memchr::memchr(b'&', rest).unwrap_or(rest.len());
            let piece = &rest[..end];
            rest = rest.get(end + 1..).unwrap_or_default();
            if piece.is_empty() {
                continue;
            }
            if pairs.len() == MAX_PARAMS {
                return Err(CmqError::invalid(format!("more than {MAX_PARAMS} parameters")));
            }
            let (name, value) = match memchr::memchr(b'=', piece) {
                Some(i) => (&piece[..i], &piece[i + 1..]),
                None => (piece, &b""[..]),
            };
            let name = decode_into(&mut text, name);
            let value = decode_into(&mut text, value);
            pairs.push((name, value));
        }
        pairs.sort_by(|a, b| text[a.0.clone()].cmp(&text[b.0.clone()]));
        if let Some(twice) = pairs.windows(2).find(|w| text[w[0].0.clone()] == text[w[1].0.clone()]) {
            return Err(CmqError::invalid(format!("parameter '{}' is given more than once", &text[twice[0].0.clone()])));
        }
        Ok(Params { text, pairs })
    }

    /// Every `(name, value)`, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs.iter().map(|(k, v)| (&self.text[k.clone()], &self.text[v.clone()]))
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        let i = self.pairs.binary_search_by(|(k, _)| self.text[k.clone()].cmp(name)).ok()?;
        Some(&self.text[self.pairs[i].1.clone()])
    }

    pub fn required(&self, name: &str) -> Result<&str, CmqError> {
        self.get(name).ok_or_else(|| CmqError::invalid(format!("parameter '{name}' is required")))
    }

    /// An integer parameter within `range`, or `default` when absent (or empty, as the SDK sends
    /// unset optional values).
    pub fn int(&self, name: &str, default: i64, range: std::ops::RangeInclusive<i64>) -> Result<i64, CmqError> {
        let value = match self.get(name).map(str::trim) {
            None | Some("") => return Ok(default),
            Some(v) => v.parse::<i64>().map_err(|_| CmqError::invalid(format!("{name} must be an integer, not '{v}'")))?,
        };
        if !range.contains(&value) {
            return Err(CmqError::invalid(format!("{name} must be from {} to {}, not {value}", range.start(), range.end())));
        }
        Ok(value)
    }

    /// The values of `prefix.1`, `prefix.2`, ... in number order; at most `max` of them.
    pub fn numbered(&self, prefix: &str, max: usize) -> Result<Vec<&str>, CmqError> {
        let mut found: Vec<(u64, &str)> = Vec::new();
        for (k, v) in self.iter() {
            let Some(n) = k.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('.')) else { continue };
            let n: u64 = n.parse().map_err(|_| CmqError::invalid(format!("parameter '{k}': expected {prefix}.N with N a number from 1")))?;
            if n == 0 {
                return Err(CmqError::invalid(format!("parameter '{k}': lists are numbered from 1")));
            }
            found.push((n, v));
        }
        if found.len() > max {
            return Err(CmqError::invalid(format!("at most {max} {prefix}.N parameters in one request, not {}", found.len())));
        }
        found.sort_unstable_by_key(|(n, _)| *n);
        Ok(found.into_iter().map(|(_, v)| v).collect())
    }
}

/// Appends `raw` decoded (`+` is a space, `%XX` a byte; a `%` not followed by two hex digits stays
/// as it is) to `text` and returns where it went. Bytes that are not UTF-8 become U+FFFD.
fn decode_into(text: &mut String, raw: &[u8]) -> Range<usize> {
    let start = text.len();
    if memchr::memchr2(b'%', b'+', raw).is_none() {
        push_utf8(text, raw);
        return start..text.len();
    }
    let mut bytes = Vec::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(i) = memchr::memchr2(b'%', b'+', rest) {
        bytes.extend_from_slice(&rest[..i]);
        if rest[i] == b'+' {
            bytes.push(b' ');
            rest = &rest[i + 1..];
            continue;
        }
        match (rest.get(i + 1).and_then(|&h| hex(h)), rest.get(i + 2).and_then(|&l| hex(l))) {
            (Some(h), Some(l)) => {
                bytes.push(h << 4 | l);
                rest = &rest[i + 3..];
            }
            _ => {
                bytes.push(b'%');
                rest = &rest[i + 1..];
            }
        }
    }
    bytes.extend_from_slice(rest);
    push_utf8(text, &bytes);
    start..text.len()
}

fn push_utf8(text: &mut String, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(s) => text.push_str(s),
        Err(_) => text.push_str(&String::from_utf8_lossy(bytes)),
    }
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(raw: &str) -> Result<Params, CmqError> {
        Params::parse(raw.as_bytes())
    }

    #[test]
    fn numbered_lists_come_in_number_order_and_are_bounded() {
        let p = params("msgBody.2=b&msgBody.10=c&msgBody.1=a&queueName=q").unwrap();
        assert_eq!(p.numbered("msgBody", 16).unwrap(), vec!["a", "b", "c"]);
        assert!(p.numbered("msgBody", 2).is_err());
        assert!(p.numbered("receiptHandle", 16).unwrap().is_empty());
        assert!(params("msgBody.x=1").unwrap().numbered("msgBody", 16).is_err());
        assert!(params("msgBody.0=1").unwrap().numbered("msgBody", 16).is_err());
    }

    #[test]
    fn bad_parameters_are_refused_with_a_reason() {
        assert!(params("a=1&a=2").is_err(), "a name twice");
        assert!(params("a=1&b=2&a=3").is_err(), "a name twice, not side by side");
        let p = params("n=12&e=&x=abc&big=99999999999999999999").unwrap();
        assert_eq!(p.int("n", 0, 0..=30).unwrap(), 12);
        assert_eq!(p.int("e", 7, 0..=30).unwrap(), 7);
        assert_eq!(p.int("absent", 7, 0..=30).unwrap(), 7);
        assert!(p.int("n", 0, 0..=10).is_err());
        assert!(p.int("x", 0, 0..=10).is_err());
        assert!(p.int("big", 0, 0..=10).is_err());
        assert!(p.required("absent").unwrap_err().message.contains("absent"));
        let many = (0..2000).map(|i| format!("k{i}=v")).collect::<Vec<_>>().join("&");
        assert!(Params::parse(many.as_bytes()).is_err());
    }

    /// The parse decodes as `form_urlencoded` (what browsers and the SDK's encoder agree on), on
    /// every shape of escape, broken ones and bytes that are not UTF-8 included.
    #[test]
    fn decoding_matches_form_urlencoded() {
        let cases: [&[u8]; 12] = [
            b"a=1&b=x+y&c=%7B%22k%22%3A1%7D",
            b"msgBody=%E4%BD%A0%E5%A5%BD&queueName=q",
            b"a=%&b=%4&c=%zz&d=%4g&e=100%25",
            b"a=%FF%FE&b=\xff\xfe&c=caf\xc3\xa9",
            b"&&a=1&&b&c=&=d",
            b"a+b=c+d&x%3Dy=1%3D2",
            b"k=v=w&l==",
            b"",
            b"a",
            b"%41=%42",
            b"a=++&b=%2B%2b",
            b"a=%e4%bd&b=%a0",
        ];
        for raw in cases {
            let mut expected: Vec<(String, String)> = form_urlencoded::parse(raw).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
            expected.retain(|(k, v)| !(k.is_empty() && v.is_empty()));
            expected.sort();
            expected.dedup_by(|a, b| a.0 == b.0);
            let Ok(p) = Params::parse(raw) else {
                let mut names: Vec<_> = form_urlencoded::parse(raw).map(|(k, _)| k.into_owned()).collect();
                let n = names.len();
                names.sort();
                names.dedup();
                assert_ne!(names.len(), n, "{:?} refused without a repeated name", String::from_utf8_lossy(raw));
                continue;
            };
            let got: Vec<(String, String)> = p.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
            assert_eq!(got, expected, "{:?}", String::from_utf8_lossy(raw));
        }
    }
}
