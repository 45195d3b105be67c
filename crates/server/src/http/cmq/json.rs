//! CMQ's answers written as JSON text directly. A batch receive's answer is mostly message bodies
//! (16 × 1 KB and more): strings are copied a run at a time between the few bytes JSON escapes,
//! found 16 bytes at a step, instead of byte by byte (`serde_json`'s writer was the receive's
//! largest cost).

use serde_json::Value;

/// `{"code":..,"message":..,"requestId":..}` plus `fields`.
pub fn answer(code: i64, message: &str, request_id: u64, fields: &super::Answer) -> String {
    let mut out = String::with_capacity(64 + message.len());
    out.push_str("{\"code\":");
    out.push_str(&code.to_string());
    out.push_str(",\"message\":");
    write_str(&mut out, message);
    out.push_str(",\"requestId\":\"");
    out.push_str(&request_id.to_string());
    out.push('"');
    for (k, v) in fields {
        out.push(',');
        write_field(&mut out, k, v);
    }
    out.push('}');
    out
}

fn write_field(out: &mut String, name: &str, v: &Value) {
    write_str(out, name);
    out.push(':');
    write_value(out, v);
}

fn write_value(out: &mut String, v: &Value) {
    match v {
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_field(out, k, v);
            }
            out.push('}');
        }
        // Numbers, booleans, null: short, and serde_json writes them exactly as JSON wants.
        other => out.push_str(&other.to_string()),
    }
}

/// Whether JSON must escape this byte inside a string.
fn escaped(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// Where the next byte JSON escapes is: 16 bytes are tested at a step without a branch per byte.
fn next_escaped(bytes: &[u8]) -> Option<usize> {
    let mut at = 0;
    for chunk in bytes.chunks_exact(16) {
        if chunk.iter().fold(false, |any, &b| any | escaped(b)) {
            return chunk.iter().position(|&b| escaped(b)).map(|i| at + i);
        }
        at += 16;
    }
    bytes[at..].iter().position(|&b| escaped(b)).map(|i| at + i)
}

fn write_str(out: &mut String, s: &str) {
    out.reserve(s.len() + 2);
    out.push('"');
    let mut rest = s;
    while let Some(i) = next_escaped(rest.as_bytes()) {
        // The escaped bytes are ASCII: `i` is a character boundary.
        out.push_str(&rest[..i]);
        match rest.as_bytes()[i] {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0x08 => out.push_str("\\b"),
            0x0c => out.push_str("\\f"),
            b => out.push_str(&format!("\\u{b:04x}")),
        }
        rest = &rest[i + 1..];
    }
    out.push_str(rest);
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every string, escapes at every position of a 16-byte step included, reads back as it was;
    /// and the text is serde_json's.
    #[test]
    fn strings_round_trip_and_match_serde_json() {
        let mut cases: Vec<String> = vec![String::new(), "plain".into(), "\"quoted\" \\ back".into(), "你好, caf\u{e9} \u{1F600}".into()];
        for special in ['"', '\\', '\n', '\u{0}', '\u{1f}', '\u{7f}', 'é', '\t', '\u{8}', '\u{c}'] {
            for at in 0..40 {
                let mut s: String = "x".repeat(40);
                s.replace_range(at..at + 1, &special.to_string());
                cases.push(s);
            }
        }
        for s in cases {
            let mut out = String::new();
            write_str(&mut out, &s);
            assert_eq!(out, serde_json::to_string(&s).unwrap());
            assert_eq!(serde_json::from_str::<String>(&out).unwrap(), s);
        }
    }

    #[test]
    fn answers_are_json_with_every_field() {
        let mut fields = super::super::Answer::new();
        fields.insert("msgInfoList".into(), serde_json::json!([{"msgBody": "a\"b", "dequeueCount": 2}, {"n": null, "ok": true, "f": 1.5}]));
        let text = answer(7000, "no \"message\"", 12, &fields);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["code"], 7000);
        assert_eq!(v["message"], "no \"message\"");
        assert_eq!(v["requestId"], "12");
        assert_eq!(v["msgInfoList"], fields["msgInfoList"]);
    }
}
