//! What the protocol fuzz targets check. Each function takes the fuzzer's bytes, runs the decoders on
//! them, and panics (which libFuzzer reports as a crash) if a decoder panics or breaks a property:
//! - a frame stream decodes to the same frames, whatever the chunks it arrives in;
//! - a decoded value re-encodes to bytes that decode to the same value (method, properties, table);
//! - where two decoders read the same bytes (full decode vs. allocation-free view or validator), they
//!   agree;
//! - every refusal is a protocol error with a reply code and a text.
//!
//! Values are compared by their encoding or their `Debug` form, not `==`: a float field may be NaN.

use bytes::{BufMut, BytesMut};
use warren_protocol::constants as c;
use warren_protocol::error::FrameError;
use warren_protocol::field::{validate_table, FieldTable, FieldValue};
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::Method;
use warren_protocol::properties::{BasicProperties, PropertiesView};

fn assert_protocol_error(e: &FrameError) {
    assert!([c::FRAME_ERROR, c::SYNTAX_ERROR, c::NOT_IMPLEMENTED].contains(&e.reply_code()), "{e:?}");
    assert!(!e.to_string().is_empty());
}

fn encode_method(m: &Method) -> BytesMut {
    let mut out = BytesMut::new();
    m.encode(&mut out);
    out
}

fn encode_table(t: &FieldTable) -> BytesMut {
    let mut out = BytesMut::new();
    t.encode(&mut out);
    out
}

fn encode_props(p: &BasicProperties) -> BytesMut {
    let mut out = BytesMut::new();
    p.encode(&mut out);
    out
}

/// The `frame_max` values a frame stream is decoded with. Not 0 (no limit): the server never uses it, and
/// with it a declared size makes the parser reserve up to 4 GiB for the payload, as it should.
const FRAME_MAXES: [u32; 4] = [64, 4096, 131_072, 1 << 20];

/// How a stream decoding ended: the frames (in `Debug` form, with the bytes each consumed), then
/// either "needs more bytes" (`None`) or the error that stopped it.
#[derive(Debug, PartialEq)]
struct Decoded {
    frames: Vec<(String, usize)>,
    end: Option<FrameError>,
    left_over: usize,
}

/// Parses frames from `buf` until it needs more bytes or fails; returns false on failure.
fn parse_available(buf: &mut BytesMut, frame_max: u32, out: &mut Decoded) -> bool {
    loop {
        let before = buf.len();
        match frame::parse_frame(buf, frame_max) {
            Ok(Some(f)) => {
                assert!(buf.len() < before, "a parsed frame consumes bytes");
                check_frame(&f);
                out.frames.push((format!("{f:?}"), before - buf.len()));
            }
            Ok(None) => {
                assert_eq!(buf.len(), before, "needing more bytes consumes nothing");
                return true;
            }
            Err(e) => {
                assert_protocol_error(&e);
                out.end = Some(e);
                return false;
            }
        }
    }
}

/// What every parsed frame must satisfy.
fn check_frame(f: &Frame) {
    match f {
        Frame::Method { channel, method } => {
            // Re-framed, the method parses back to the same frame.
            let mut again = BytesMut::new();
            frame::write_method(&mut again, *channel, method);
            let reparsed = frame::parse_frame(&mut again, 0).expect("re-framed method parses").expect("complete");
            assert_eq!(format!("{reparsed:?}"), format!("{f:?}"));
            assert!(again.is_empty());
        }
        Frame::Header { header, .. } => {
            assert!(PropertiesView::new(&header.properties).is_ok(), "header frames carry valid properties");
        }
        Frame::Body { .. } | Frame::Heartbeat { .. } => {}
    }
}

/// Input: `mode | n | n chunk sizes | stream`. `mode` picks `frame_max` (of [`FRAME_MAXES`]); the stream is fed in chunks
/// of the given sizes (each 1..=256 bytes, cycling; one byte at a time if `n` is 0). Decoding the
/// stream in those chunks must give exactly what decoding it whole gives.
pub fn check_frame_stream(input: &[u8]) {
    let [mode, n, rest @ ..] = input else { return };
    let frame_max = FRAME_MAXES[usize::from(*mode) % FRAME_MAXES.len()];
    let n = usize::from(*n % 17).min(rest.len());
    let (sizes, stream) = rest.split_at(n);

    let mut whole = Decoded { frames: Vec::new(), end: None, left_over: 0 };
    let mut buf = BytesMut::from(stream);
    parse_available(&mut buf, frame_max, &mut whole);
    whole.left_over = buf.len();

    let mut chunked = Decoded { frames: Vec::new(), end: None, left_over: 0 };
    let mut buf = BytesMut::new();
    let mut fed = 0;
    let mut i = 0;
    while fed < stream.len() {
        let size = sizes.get(i % sizes.len().max(1)).map_or(1, |&s| usize::from(s) + 1);
        i += 1;
        let end = (fed + size).min(stream.len());
        buf.extend_from_slice(&stream[fed..end]);
        fed = end;
        if !parse_available(&mut buf, frame_max, &mut chunked) {
            break;
        }
    }
    // On an error the rest of the stream is never fed: count it as left over, as in the whole case.
    chunked.left_over = buf.len() + (stream.len() - fed);
    assert_eq!(chunked, whole, "chunked decoding (sizes {sizes:?}) differs from whole decoding");
}

/// Input: a method frame's payload. A decoded method re-encodes to bytes that decode to the same
/// method, no longer than the input (trailing bytes are tolerated, not kept).
pub fn check_method(input: &[u8]) {
    match Method::decode(input) {
        Ok(m) => {
            let once = encode_method(&m);
            assert!(once.len() <= input.len(), "{} re-encodes longer than its input", m.name());
            let again = Method::decode(&once).unwrap_or_else(|e| panic!("re-decode of {}: {e}", m.name()));
            assert_eq!(format!("{again:?}"), format!("{m:?}"));
            assert_eq!(encode_method(&again), once, "method encoding is a fixpoint");
            assert_eq!((m.class_id(), m.method_id()), (u16::from_be_bytes([input[0], input[1]]), u16::from_be_bytes([input[2], input[3]])));
            // In a frame, too.
            let mut f = BytesMut::new();
            frame::write_method(&mut f, 7, &m);
            match frame::parse_frame(&mut f, 0) {
                Ok(Some(Frame::Method { channel: 7, method })) => assert_eq!(format!("{method:?}"), format!("{m:?}")),
                other => panic!("framed {} parses as {other:?}", m.name()),
            }
        }
        Err(e) => {
            assert_protocol_error(&e);
            if let Some(ids) = e.method_ids() {
                assert_eq!(ids, (u16::from_be_bytes([input[0], input[1]]), u16::from_be_bytes([input[2], input[3]])));
            }
        }
    }
}

/// Input: raw content-header properties (flag words, then the property list). The full decode and
/// the allocation-free view agree on every property the view reads; a decoded value re-encodes to a
/// fixpoint; in a header frame the same bytes are accepted or refused alike.
pub fn check_properties(input: &[u8]) {
    let full = BasicProperties::decode(input);
    let view = PropertiesView::new(input);
    match &full {
        Ok(p) => {
            let v = view.as_ref().unwrap_or_else(|e| panic!("decode accepts, view refuses: {e}"));
            assert_eq!(v.delivery_mode(), p.delivery_mode);
            assert_eq!(v.priority(), p.priority);
            assert_eq!(v.expiration(), p.expiration.as_deref());
            assert_eq!(v.user_id(), p.user_id.as_deref().map(str::as_bytes));
            assert_eq!(v.timestamp(), p.timestamp);
            let view_headers = v.headers().map(|h| encode_table(&h.expect("headers the decoder accepted")));
            assert_eq!(view_headers, p.headers.as_ref().map(encode_table));
            assert_eq!(v.reply_to(), p.reply_to.as_deref().map(str::as_bytes));
            // Direct reply-to rewrites the property in the raw bytes: the rest must stay as it was.
            if let Some(rewritten) = v.with_reply_to(input, "amq.rabbitmq.reply-to.fuzz") {
                let q = BasicProperties::decode(&rewritten).expect("rewritten properties decode");
                let want = BasicProperties { reply_to: Some("amq.rabbitmq.reply-to.fuzz".into()), ..p.clone() };
                assert_eq!(format!("{q:?}"), format!("{want:?}"), "with_reply_to changed more than reply-to");
            }
            let once = encode_props(p);
            let again = BasicProperties::decode(&once).expect("re-decode");
            assert_eq!(format!("{again:?}"), format!("{p:?}"));
            assert_eq!(encode_props(&again), once, "properties encoding is a fixpoint");
        }
        Err(e) => assert_protocol_error(e),
    }
    if let Err(e) = &view {
        assert_protocol_error(e);
        assert!(full.is_err(), "view refuses ({e}), decoder accepts");
    }
    // The frame parser validates properties with the view.
    let mut payload = BytesMut::new();
    payload.put_u16(c::CLASS_BASIC);
    payload.put_u16(0);
    payload.put_u64(3);
    payload.put_slice(input);
    let mut f = BytesMut::new();
    f.put_u8(c::FRAME_HEADER);
    f.put_u16(1);
    f.put_u32(payload.len() as u32);
    f.put_slice(&payload);
    f.put_u8(c::FRAME_END);
    match frame::parse_frame(&mut f, 0) {
        Ok(Some(Frame::Header { header, .. })) => {
            assert!(view.is_ok(), "frame accepts properties the view refuses");
            assert_eq!(&header.properties[..], input);
        }
        Ok(other) => panic!("header frame parses as {other:?}"),
        Err(e) => {
            assert_protocol_error(&e);
            assert!(view.is_err(), "frame refuses properties the view accepts: {e}");
        }
    }
}

/// Whether a value holds a `t` (boolean) anywhere: those re-encode as 0 or 1 whatever byte was read.
fn has_bool(v: &FieldValue) -> bool {
    match v {
        FieldValue::Bool(_) => true,
        FieldValue::Table(t) => t.iter().any(|(_, v)| has_bool(v)),
        FieldValue::Array(items) => items.iter().any(has_bool),
        _ => false,
    }
}

/// Calls every accessor (they must not panic on any value).
fn touch(v: &FieldValue) {
    let _ = (v.as_i64(), v.as_str(), v.as_bool(), v.as_table().map(FieldTable::len), v.as_array().map(<[_]>::len));
    if let FieldValue::Table(t) = v {
        t.iter().for_each(|(_, v)| touch(v));
    }
    if let FieldValue::Array(items) = v {
        items.iter().for_each(touch);
    }
}

/// Input: a field table in wire form (4-byte length, then pairs; trailing bytes are ignored).
/// decode -> encode -> decode gives the same table; the encoding is as long as what was read and,
/// but for booleans (any non-zero byte reads as true), byte for byte the same; the allocation-free
/// validator agrees with the decoder.
pub fn check_field_table(input: &[u8]) {
    let decoded = FieldTable::decode(input);
    match &decoded {
        Ok(t) => {
            let once = encode_table(t);
            let read = 4 + u32::from_be_bytes([input[0], input[1], input[2], input[3]]) as usize;
            assert_eq!(once.len(), read, "a table re-encodes to as many bytes as it was read from");
            if !t.iter().any(|(_, v)| has_bool(v)) {
                assert_eq!(&once[..], &input[..read], "a table without booleans re-encodes byte for byte");
            }
            let again = FieldTable::decode(&once).expect("re-decode");
            assert_eq!(format!("{again:?}"), format!("{t:?}"));
            assert_eq!(encode_table(&again), once, "table encoding is a fixpoint");
            assert!(validate_table(&input[..read]).is_ok(), "decoder accepts, validator refuses");
            t.iter().for_each(|(_, v)| touch(v));
        }
        Err(e) => assert_protocol_error(e),
    }
    match validate_table(input) {
        Ok(()) => {
            // The validator does not check key UTF-8; that is the only thing the decoder may add.
            if let Err(e) = &decoded {
                assert!(matches!(e, FrameError::Syntax { detail, .. } if detail.contains("UTF-8")), "validator accepts, decoder: {e}");
            }
        }
        Err(e) => assert_protocol_error(&e),
    }
}
