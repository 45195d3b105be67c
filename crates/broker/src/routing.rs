//! Binding matchers for topic and headers exchanges.

use warren_protocol::field::{FieldTable, FieldValue};

/// Does a topic binding pattern (`*` = one word, `#` = zero or more words) match a routing key?
///
/// Words are separated by `.`; empty words are words (`a..b` has three). Matching is iterative with
/// backtracking over the last `#` seen, so hostile patterns cannot blow the stack.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    let pat: Vec<&str> = pattern.split('.').collect();
    let words: Vec<&str> = key.split('.').collect();
    // An empty routing key is zero words for the purpose of `#` matching, as in RabbitMQ.
    let words: &[&str] = if key.is_empty() { &[] } else { &words };
    let pat: &[&str] = if pattern.is_empty() { &[] } else { &pat };
    matches_from(pat, words)
}

fn matches_from(pat: &[&str], words: &[&str]) -> bool {
    // Dynamic programming over (pattern position, word position): O(p * w), no recursion.
    let (p, w) = (pat.len(), words.len());
    let mut reach = vec![false; w + 1];
    reach[0] = true;
    for pi in 0..p {
        let mut next = vec![false; w + 1];
        match pat[pi] {
            "#" => {
                // `#` consumes any number of words from any reachable position.
                let mut any = false;
                for wi in 0..=w {
                    any |= reach[wi];
                    next[wi] = any;
                }
            }
            "*" => {
                for wi in 0..w {
                    if reach[wi] {
                        next[wi + 1] = true;
                    }
                }
            }
            literal => {
                for wi in 0..w {
                    if reach[wi] && words[wi] == literal {
                        next[wi + 1] = true;
                    }
                }
            }
        }
        reach = next;
    }
    reach[w]
}

/// Headers-exchange match: `x-match` = `all` (default), `any`, `all-with-x`, `any-with-x`.
/// Binding arguments whose names start with `x-` are ignored unless the `-with-x` variants are used.
/// A binding argument of type void matches when the header is present, whatever its value.
pub fn headers_match(binding: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = binding
        .get("x-match")
        .and_then(FieldValue::as_str)
        .unwrap_or("all");
    let (any, with_x) = match mode {
        "any" => (true, false),
        "any-with-x" => (true, true),
        "all-with-x" => (false, true),
        _ => (false, false),
    };
    let empty = FieldTable::new();
    let headers = headers.unwrap_or(&empty);
    for (key, expected) in binding.iter() {
        if key == "x-match" || (!with_x && key.starts_with("x-")) {
            continue;
        }
        let hit = match headers.get(key) {
            None => false,
            Some(actual) => matches!(expected, FieldValue::Void) || field_eq(expected, actual),
        };
        if any && hit {
            return true;
        }
        if !any && !hit {
            return false;
        }
    }
    // `all` with no criteria matches everything; `any` with no criteria matches nothing.
    !any
}

/// Values compare equal across integer widths (a client may send 5 as 'b' or 'I'), as RabbitMQ's
/// term comparison does for numbers.
fn field_eq(a: &FieldValue, b: &FieldValue) -> bool {
    match (a.as_i64(), b.as_i64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn topic_patterns() {
        let cases = [
            ("a.b.c", "a.b.c", true),
            ("a.*.c", "a.b.c", true),
            ("a.*.c", "a.c", false),
            ("a.#", "a", true),
            ("a.#", "a.b.c", true),
            ("#", "", true),
            ("#", "anything.at.all", true),
            ("*", "", false),
            ("a.#.b", "a.b", true),
            ("a.#.b", "a.x.y.b", true),
            ("a.#.b", "a.x.y.c", false),
            ("#.#", "a", true),
            ("*.*", "a..", false),
            ("a..b", "a..b", true),
            ("*.b.#", "x.b", true),
            ("", "", true),
            ("", "a", false),
        ];
        for (p, k, want) in cases {
            assert_eq!(topic_matches(p, k), want, "pattern {p:?} key {k:?}");
        }
    }

    fn table(pairs: &[(&str, FieldValue)]) -> FieldTable {
        let mut t = FieldTable::new();
        for (k, v) in pairs {
            t.insert(k.to_string(), v.clone());
        }
        t
    }

    #[test]
    fn headers_all_and_any() {
        let s = |v: &str| FieldValue::LongString(Bytes::copy_from_slice(v.as_bytes()));
        let all = table(&[("x-match", s("all")), ("a", s("1")), ("b", FieldValue::I32(2))]);
        let any = table(&[("x-match", s("any")), ("a", s("1")), ("b", FieldValue::I32(2))]);
        let h_both = table(&[("a", s("1")), ("b", FieldValue::I8(2))]);
        let h_one = table(&[("a", s("1"))]);
        assert!(headers_match(&all, Some(&h_both)));
        assert!(!headers_match(&all, Some(&h_one)));
        assert!(headers_match(&any, Some(&h_one)));
        assert!(!headers_match(&any, None));
        assert!(headers_match(&table(&[]), None));
    }
}
