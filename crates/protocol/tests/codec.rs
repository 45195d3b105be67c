//! The codec through its public API: every method and every field type round-trips exactly, and
//! truncated, oversized, garbled or random input is refused with the right error, never a panic.

mod common;

use bytes::{Bytes, BytesMut};
use rand::{Rng, SeedableRng};
use warren_protocol::error::FrameError;
use warren_protocol::field::{Decimal, FieldTable, FieldValue};
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::*;
use warren_protocol::properties::{BasicProperties, PropertiesView};

fn table() -> FieldTable {
    let mut t = FieldTable::new();
    t.insert("x-match".into(), FieldValue::LongString(Bytes::from_static(b"all")));
    t.insert("n".into(), FieldValue::I32(-7));
    t
}

fn s(v: &str) -> String {
    v.to_string()
}

fn b(v: &str) -> Bytes {
    Bytes::copy_from_slice(v.as_bytes())
}

/// The spec's (class id, method id) of a method (the shared exhaustive table in `common`).
fn spec_ids(m: &Method) -> (u16, u16) {
    let spec = common::spec(m);
    (spec.class_id, spec.method_id)
}

fn encode(m: &Method) -> BytesMut {
    let mut out = BytesMut::new();
    m.encode(&mut out);
    out
}

#[test]
fn every_method_round_trips_with_spec_ids() {
    let all = common::every_method();
    assert_eq!(all.len(), 66, "one sample per method");
    let mut seen = std::collections::HashSet::new();
    for m in &all {
        assert!(seen.insert(spec_ids(m)), "duplicate sample for {}", m.name());
        assert_eq!((m.class_id(), m.method_id()), spec_ids(m), "{}", m.name());
        let bytes = encode(m);
        assert_eq!(&bytes[..4], &[(m.class_id() >> 8) as u8, m.class_id() as u8, (m.method_id() >> 8) as u8, m.method_id() as u8]);
        let back = Method::decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", m.name()));
        assert_eq!(&back, m);
        assert_eq!(encode(&back), bytes, "{} re-encodes identically", m.name());
        // Inside a frame, too.
        let mut framed = BytesMut::new();
        frame::write_method(&mut framed, 7, m);
        match frame::parse_frame(&mut framed, 0) {
            Ok(Some(Frame::Method { channel: 7, method })) => assert_eq!(&method, m),
            other => panic!("{}: {other:?}", m.name()),
        }
        assert!(framed.is_empty());
    }
}

#[test]
fn bits_pack_into_one_octet_in_spec_order() {
    let m = Method::QueueDeclare(QueueDeclare { reserved_1: 0, queue: s("q"), passive: true, durable: false, exclusive: true, auto_delete: false, nowait: true, arguments: FieldTable::new() });
    let bytes = encode(&m);
    // class, method, reserved short, shortstr "q", then one octet of bits: passive=1, exclusive=4, nowait=16.
    assert_eq!(bytes[4..9], [0, 0, 1, b'q', 0b10101]);
}

fn every_field_type() -> FieldTable {
    let mut nested = FieldTable::new();
    nested.insert("deep".into(), FieldValue::Array(vec![FieldValue::Void, FieldValue::Table(table())]));
    let mut t = FieldTable::new();
    let values = vec![
        ("t", FieldValue::Bool(true)),
        ("f", FieldValue::Bool(false)),
        ("b", FieldValue::I8(i8::MIN)),
        ("B", FieldValue::U8(u8::MAX)),
        ("s", FieldValue::I16(i16::MIN)),
        ("u", FieldValue::U16(u16::MAX)),
        ("I", FieldValue::I32(i32::MIN)),
        ("i", FieldValue::U32(u32::MAX)),
        ("l", FieldValue::I64(i64::MIN)),
        ("L", FieldValue::U64(u64::MAX)),
        ("fl", FieldValue::F32(-1.5)),
        ("d", FieldValue::F64(1e300)),
        ("D", FieldValue::Decimal(Decimal { scale: 2, value: 314 })),
        ("S", FieldValue::LongString(Bytes::from_static(b"text \xc3\xa9"))),
        ("S-binary", FieldValue::LongString(Bytes::from_static(b"\xff\x00\xfe"))),
        ("S-empty", FieldValue::LongString(Bytes::new())),
        ("x", FieldValue::ByteArray(Bytes::from_static(b"\x00\x01\x02"))),
        ("T", FieldValue::Timestamp(1_700_000_000)),
        ("V", FieldValue::Void),
        ("A", FieldValue::Array(vec![FieldValue::I32(1), FieldValue::LongString(b("two")), FieldValue::Array(vec![]), FieldValue::Table(nested.clone())])),
        ("F", FieldValue::Table(nested)),
        ("F-empty", FieldValue::Table(FieldTable::new())),
    ];
    for (k, v) in values {
        t.0.push((k.to_string(), v));
    }
    // Order and duplicate keys are kept as sent.
    t.0.push(("t".to_string(), FieldValue::Bool(false)));
    t
}

#[test]
fn every_field_type_round_trips_byte_exact() {
    let t = every_field_type();
    let mut out = BytesMut::new();
    t.encode(&mut out);
    let back = FieldTable::decode(&out).expect("decodes");
    assert_eq!(back, t);
    let mut again = BytesMut::new();
    back.encode(&mut again);
    assert_eq!(again, out);
    assert!(warren_protocol::field::validate_table(&out).is_ok());
    // Through a method's arguments too.
    let m = Method::QueueDeclare(QueueDeclare { queue: s("q"), arguments: t, ..Default::default() });
    assert_eq!(Method::decode(&encode(&m)).expect("decodes"), m);
}

#[test]
fn type_letters_are_rabbitmqs() {
    let cases: Vec<(FieldValue, &[u8])> = vec![
        (FieldValue::Bool(true), b"t\x01"),
        (FieldValue::I8(-1), b"b\xff"),
        (FieldValue::U8(1), b"B\x01"),
        (FieldValue::I16(-2), b"s\xff\xfe"),
        (FieldValue::U16(2), b"u\x00\x02"),
        (FieldValue::I32(3), b"I\x00\x00\x00\x03"),
        (FieldValue::U32(4), b"i\x00\x00\x00\x04"),
        (FieldValue::I64(5), b"l\x00\x00\x00\x00\x00\x00\x00\x05"),
        (FieldValue::Timestamp(6), b"T\x00\x00\x00\x00\x00\x00\x00\x06"),
        (FieldValue::Void, b"V"),
        (FieldValue::Decimal(Decimal { scale: 1, value: 7 }), b"D\x01\x00\x00\x00\x07"),
        (FieldValue::LongString(b("ab")), b"S\x00\x00\x00\x02ab"),
        (FieldValue::ByteArray(b("ab")), b"x\x00\x00\x00\x02ab"),
    ];
    for (v, wire) in cases {
        let mut t = FieldTable::new();
        t.insert("k".into(), v.clone());
        let mut out = BytesMut::new();
        t.encode(&mut out);
        assert_eq!(&out[6..], wire, "{v:?}"); // after length u32 and key "k"
    }
}

fn all_properties() -> BasicProperties {
    BasicProperties {
        content_type: Some(s("application/json")),
        content_encoding: Some(s("gzip")),
        headers: Some(every_field_type()),
        delivery_mode: Some(2),
        priority: Some(9),
        correlation_id: Some(s("corr")),
        reply_to: Some(s("replies")),
        expiration: Some(s("60000")),
        message_id: Some(s("id-1")),
        timestamp: Some(1_700_000_000),
        kind: Some(s("order.created")),
        user_id: Some(s("guest")),
        app_id: Some(s("app")),
        cluster_id: Some(s("cluster")),
    }
}

/// The properties with only the `i`-th one set (0..14), in spec order.
fn only(i: usize) -> BasicProperties {
    let all = all_properties();
    let mut p = BasicProperties::default();
    match i {
        0 => p.content_type = all.content_type,
        1 => p.content_encoding = all.content_encoding,
        2 => p.headers = all.headers,
        3 => p.delivery_mode = all.delivery_mode,
        4 => p.priority = all.priority,
        5 => p.correlation_id = all.correlation_id,
        6 => p.reply_to = all.reply_to,
        7 => p.expiration = all.expiration,
        8 => p.message_id = all.message_id,
        9 => p.timestamp = all.timestamp,
        10 => p.kind = all.kind,
        11 => p.user_id = all.user_id,
        12 => p.app_id = all.app_id,
        13 => p.cluster_id = all.cluster_id,
        _ => unreachable!(),
    }
    p
}

#[test]
fn properties_all_none_and_each_alone_round_trip_and_view_agrees() {
    let mut cases = vec![all_properties(), BasicProperties::default()];
    cases.extend((0..14).map(only));
    for (n, p) in cases.iter().enumerate() {
        let mut out = BytesMut::new();
        p.encode(&mut out);
        let back = BasicProperties::decode(&out).unwrap_or_else(|e| panic!("case {n}: {e}"));
        assert_eq!(&back, p, "case {n}");
        let mut again = BytesMut::new();
        back.encode(&mut again);
        assert_eq!(again, out, "case {n} re-encodes identically");
        let view = PropertiesView::new(&out).expect("view");
        assert_eq!(view.delivery_mode(), p.delivery_mode, "case {n}");
        assert_eq!(view.priority(), p.priority, "case {n}");
        assert_eq!(view.expiration(), p.expiration.as_deref(), "case {n}");
        assert_eq!(view.user_id(), p.user_id.as_deref().map(str::as_bytes), "case {n}");
        assert_eq!(view.timestamp(), p.timestamp, "case {n}");
        assert_eq!(view.headers().map(|h| h.expect("headers decode")), p.headers, "case {n}");
    }
    // Flag bits in spec order: content-type is bit 15, cluster-id bit 2.
    let mut out = BytesMut::new();
    only(0).encode(&mut out);
    assert_eq!(&out[..2], &[0x80, 0x00]);
    out.clear();
    only(13).encode(&mut out);
    assert_eq!(&out[..2], &[0x00, 0x04]);
}

fn sample_frames() -> Vec<BytesMut> {
    let mut frames = Vec::new();
    for m in common::every_method() {
        let mut f = BytesMut::new();
        frame::write_method(&mut f, 3, &m);
        frames.push(f);
    }
    let mut props = BytesMut::new();
    all_properties().encode(&mut props);
    let mut content = BytesMut::new();
    frame::write_content(&mut content, 3, 60, &props, b"hello body", 131_072);
    // write_content emits a header frame then a body frame: split them.
    let header_len = 7 + u32::from_be_bytes([content[3], content[4], content[5], content[6]]) as usize + 1;
    frames.push(content.split_to(header_len));
    frames.push(content);
    let mut hb = BytesMut::new();
    frame::write_heartbeat(&mut hb);
    frames.push(hb);
    frames
}

#[test]
fn every_strict_prefix_of_a_frame_asks_for_more_and_consumes_nothing() {
    for f in sample_frames() {
        for cut in 0..f.len() {
            let mut partial = BytesMut::from(&f[..cut]);
            assert_eq!(frame::parse_frame(&mut partial, 131_072), Ok(None), "cut {cut} of {f:?}");
            assert_eq!(partial.len(), cut, "nothing consumed");
        }
        let mut whole = f.clone();
        assert!(matches!(frame::parse_frame(&mut whole, 131_072), Ok(Some(_))));
        assert!(whole.is_empty());
    }
}

#[test]
fn frame_envelope_errors_have_the_right_reply_codes() {
    let mut m = BytesMut::new();
    frame::write_method(&mut m, 1, &Method::ConfirmSelect(ConfirmSelect { nowait: false }));
    // Bad frame end.
    let mut bad_end = m.clone();
    let last = bad_end.len() - 1;
    bad_end[last] = 0x00;
    let e = frame::parse_frame(&mut bad_end, 131_072).expect_err("bad end");
    assert!(matches!(e, FrameError::BadFrameEnd { found: 0 }));
    assert_eq!(e.reply_code(), 501);
    // Unknown frame type.
    let mut unknown = m.clone();
    unknown[0] = 42;
    let e = frame::parse_frame(&mut unknown, 131_072).expect_err("type");
    assert_eq!(e.reply_code(), 501);
    // Oversized: refused from the 7-byte header alone, before the payload arrives.
    let mut huge = BytesMut::from(&[1u8, 0, 1, 0x7f, 0xff, 0xff, 0xff][..]);
    let e = frame::parse_frame(&mut huge, 131_072).expect_err("too large");
    assert!(matches!(e, FrameError::TooLarge { .. }));
    assert_eq!(e.reply_code(), 501);
    // Unknown method.
    let mut um = BytesMut::new();
    um.extend_from_slice(&[1, 0, 1, 0, 0, 0, 4, 0, 60, 0, 99, 0xce]);
    let e = frame::parse_frame(&mut um, 131_072).expect_err("unknown method");
    assert_eq!(e.reply_code(), 540);
    assert_eq!(e.method_ids(), Some((60, 99)));
}

#[test]
fn truncated_method_arguments_inside_a_whole_frame_are_syntax_errors() {
    for m in common::every_method() {
        let bytes = encode(&m);
        for cut in 4..bytes.len() {
            match Method::decode(&bytes[..cut]) {
                Err(e) => {
                    assert_eq!(e.reply_code(), 502, "{} cut at {cut}: {e}", m.name());
                    assert_eq!(e.method_ids(), Some(spec_ids(&m)));
                }
                // A cut that only drops trailing bits/zero-length fields can still decode.
                Ok(_) => {}
            }
        }
        // Framed: a method frame whose payload is cut still parses as a frame, then fails as a method.
        if bytes.len() > 5 {
            let mut f = BytesMut::new();
            let payload = &bytes[..bytes.len() - 1];
            f.extend_from_slice(&[1, 0, 1]);
            f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            f.extend_from_slice(payload);
            f.extend_from_slice(&[0xce]);
            if let Err(e) = frame::parse_frame(&mut f, 131_072) {
                assert_eq!(e.reply_code(), 502, "{}", m.name());
            }
        }
    }
}

#[test]
fn random_bytes_and_mutations_never_panic() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let frames = sample_frames();
    let mut tables = BytesMut::new();
    every_field_type().encode(&mut tables);
    let mut props = BytesMut::new();
    all_properties().encode(&mut props);
    for i in 0..20_000 {
        // Random garbage.
        let len = rng.gen_range(0..300);
        let junk: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        let _ = Method::decode(&junk);
        let _ = FieldTable::decode(&junk);
        let _ = BasicProperties::decode(&junk);
        let _ = PropertiesView::new(&junk).map(|v| v.headers());
        let _ = warren_protocol::field::validate_table(&junk);
        let mut buf = BytesMut::from(&junk[..]);
        let _ = frame::parse_frame(&mut buf, 131_072);
        // Bit flips and cuts of valid encodings.
        let base: &[u8] = match i % 3 {
            0 => &frames[rng.gen_range(0..frames.len())],
            1 => &tables,
            _ => &props,
        };
        let mut mutated = base.to_vec();
        for _ in 0..rng.gen_range(1..4) {
            if mutated.is_empty() {
                break;
            }
            let at = rng.gen_range(0..mutated.len());
            mutated[at] ^= 1 << rng.gen_range(0..8);
        }
        mutated.truncate(rng.gen_range(0..=mutated.len()));
        let mut buf = BytesMut::from(&mutated[..]);
        while let Ok(Some(_)) = frame::parse_frame(&mut buf, 131_072) {}
        let _ = FieldTable::decode(&mutated);
        let _ = BasicProperties::decode(&mutated);
        let _ = PropertiesView::new(&mutated).map(|v| v.headers());
    }
}

#[test]
fn tables_nested_beyond_the_limit_are_refused_not_a_stack_overflow() {
    for letter in [b'F', b'A'] {
        let shallow = common::nested_wire(letter, 10);
        assert!(FieldTable::decode(&shallow).is_ok(), "{} depth 10 is fine", letter as char);
        assert!(warren_protocol::field::validate_table(&shallow).is_ok());
        // 10,000 levels: a recursive decoder without a limit would overflow the stack.
        let deep = common::nested_wire(letter, 10_000);
        assert!(FieldTable::decode(&deep).is_err(), "{}", letter as char);
        assert!(warren_protocol::field::validate_table(&deep).is_err(), "{}", letter as char);
    }
}

#[test]
fn content_frames_split_at_frame_max_and_reassemble() {
    let body: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
    let mut props = BytesMut::new();
    only(3).encode(&mut props);
    let mut out = BytesMut::new();
    frame::write_content(&mut out, 2, 60, &props, &body, 4096);
    let mut got = Vec::new();
    let mut header = None;
    while let Some(f) = frame::parse_frame(&mut out, 4096).expect("valid") {
        match f {
            Frame::Header { channel: 2, header: h } => header = Some(h),
            Frame::Body { channel: 2, payload } => {
                assert!(payload.len() <= 4096 - 8);
                got.extend_from_slice(&payload);
            }
            other => panic!("{other:?}"),
        }
    }
    let h = header.expect("a header frame");
    assert_eq!((h.class_id, h.body_size), (60, body.len() as u64));
    assert_eq!(&h.properties[..], &props[..]);
    assert_eq!(got, body);
}
