//! Every `Method` variant round-trips with the spec's ids, every combination of its bit
//! arguments packs into one octet in spec order, and the decoder knows exactly the spec's ids.

mod common;

use bytes::BytesMut;
use common::*;
use std::collections::HashSet;
use warren_protocol::constants as c;
use warren_protocol::error::FrameError;
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::*;

/// Encode → decode → equal, re-encodes to the same bytes, and the same through a method frame.
fn assert_round_trip(m: &Method) -> BytesMut {
    let sp = spec(m);
    let bytes = encode_method(m);
    let mut head = sp.class_id.to_be_bytes().to_vec();
    head.extend_from_slice(&sp.method_id.to_be_bytes());
    assert_eq!(&bytes[..4], &head[..], "{}: class/method ids on the wire", sp.name);
    let back = Method::decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", sp.name));
    assert_eq!(&back, m, "{}", sp.name);
    assert_eq!(encode_method(&back), bytes, "{}: re-encodes identically", sp.name);

    let mut framed = BytesMut::new();
    frame::write_method(&mut framed, 513, m);
    assert_eq!(framed.len(), bytes.len() + 8);
    match frame::parse_frame(&mut framed, 0) {
        Ok(Some(Frame::Method { channel: 513, method })) => assert_eq!(&method, m),
        other => panic!("{}: {other:?}", sp.name),
    }
    assert!(framed.is_empty(), "{}: frame fully consumed", sp.name);
    bytes
}

#[test]
fn every_variant_round_trips_with_spec_ids_name_and_content_flag() {
    let all = every_method();
    let mut ids = HashSet::new();
    let mut names = HashSet::new();
    for m in &all {
        let sp = spec(m);
        assert!(ids.insert((sp.class_id, sp.method_id)), "two samples of {}", sp.name);
        assert!(names.insert(sp.name));
        assert_eq!((m.class_id(), m.method_id()), (sp.class_id, sp.method_id), "{}", sp.name);
        assert_eq!(m.name(), sp.name);
        assert_eq!(m.has_content(), sp.content, "{}", sp.name);
        assert_round_trip(m);
    }
    // RabbitMQ's 0-9-1 has 66 methods over 8 classes.
    assert_eq!(all.len(), 66);
    let classes: HashSet<u16> = ids.iter().map(|(class, _)| *class).collect();
    let expected = [c::CLASS_CONNECTION, c::CLASS_CHANNEL, c::CLASS_ACCESS, c::CLASS_EXCHANGE, c::CLASS_QUEUE, c::CLASS_BASIC, c::CLASS_CONFIRM, c::CLASS_TX];
    assert_eq!(classes, expected.into_iter().collect());
}

#[test]
fn well_known_ids() {
    let id = |m: Method| (m.class_id(), m.method_id());
    assert_eq!(id(Method::BasicPublish(Default::default())), (60, 40));
    assert_eq!(id(Method::ConfirmSelect(Default::default())), (85, 10));
    assert_eq!(id(Method::TxCommit(Default::default())), (90, 20));
    assert_eq!(id(Method::ConnectionBlocked(Default::default())), (10, 60));
    assert_eq!(id(Method::ExchangeUnbindOk(Default::default())), (40, 51)); // not 41: RabbitMQ's number
    assert_eq!(id(Method::BasicNack(Default::default())), (60, 120));
}

/// The decoder knows exactly the sampled ids: every (class, method) pair in a wide sweep decodes
/// (zero-filled arguments are valid for every method) iff it has a sample. Together with the
/// exhaustive match in `spec`, no variant can be missing from `every_method`.
#[test]
fn decoder_knows_exactly_the_spec_ids() {
    let known: HashSet<(u16, u16)> = every_method().iter().map(|m| (spec(m).class_id, spec(m).method_id)).collect();
    let classes = [0u16, 1, 10, 20, 30, 40, 50, 60, 70, 80, 85, 90, 100, 255, 256, 2570, u16::MAX];
    let methods = (0u16..=300).chain([2560, u16::MAX]);
    let zeros = [0u8; 64];
    for class_id in classes {
        for method_id in methods.clone() {
            let mut payload = class_id.to_be_bytes().to_vec();
            payload.extend_from_slice(&method_id.to_be_bytes());
            payload.extend_from_slice(&zeros);
            match Method::decode(&payload) {
                Ok(m) => {
                    assert!(known.contains(&(class_id, method_id)), "{class_id}.{method_id} decoded as {}", m.name());
                    assert_eq!((m.class_id(), m.method_id()), (class_id, method_id));
                }
                Err(e) => {
                    assert!(!known.contains(&(class_id, method_id)), "{class_id}.{method_id}: {e}");
                    assert_eq!(e, FrameError::UnknownMethod { class_id, method_id });
                    assert_eq!(e.reply_code(), c::NOT_IMPLEMENTED);
                    assert_eq!(e.method_ids(), Some((class_id, method_id)));
                }
            }
        }
    }
}

/// All 2^n settings of a method's n bit arguments round-trip, and they live in one octet whose
/// value is the mask (first bit argument = least significant bit).
#[test]
fn every_bit_combination_round_trips_packed_in_one_octet() {
    let mut combinations = 0;
    for sample in every_method() {
        let sp = spec(&sample);
        let (zero, n) = with_bits(&sample, 0);
        assert_eq!(n, sp.bits, "{}: bit arguments", sp.name);
        let base = encode_method(&zero);
        for mask in 0..(1u32 << n) {
            let (m, _) = with_bits(&sample, mask);
            let bytes = assert_round_trip(&m);
            combinations += 1;
            assert_eq!(bytes.len(), base.len(), "{}: bits take one octet whatever their values", sp.name);
            let diffs: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] != base[i]).collect();
            if mask == 0 {
                continue;
            }
            assert_eq!(diffs.len(), 1, "{} mask {mask:#b}: {}", sp.name, hex(&bytes));
            assert_eq!(u32::from(bytes[diffs[0]]), mask, "{} mask {mask:#b}", sp.name);
        }
    }
    // 3 methods with 5 bits, 1 with 4, 1 with 3, 3 with 2, 17 with 1, 41 with none.
    assert_eq!(combinations, 3 * 32 + 16 + 8 + 3 * 4 + 17 * 2 + 41);
}

#[test]
fn known_wire_layouts() {
    // basic.publish: reserved short, exchange, routing key, then mandatory=bit0, immediate=bit1.
    let m = Method::BasicPublish(BasicPublish { reserved_1: 0, exchange: s("x"), routing_key: s("rk"), mandatory: false, immediate: true });
    assert_eq!(&encode_method(&m)[..], b"\x00\x3c\x00\x28\x00\x00\x01x\x02rk\x02");
    // basic.ack: delivery tag as a long long, then the bit octet.
    let m = Method::BasicAck(BasicAck { delivery_tag: 0x0102030405060708, multiple: true });
    assert_eq!(&encode_method(&m)[..], b"\x00\x3c\x00\x50\x01\x02\x03\x04\x05\x06\x07\x08\x01");
    // connection.tune: short, long, short.
    let m = Method::ConnectionTune(ConnectionTune { channel_max: 2047, frame_max: 131_072, heartbeat: 60 });
    assert_eq!(&encode_method(&m)[..], b"\x00\x0a\x00\x1e\x07\xff\x00\x02\x00\x00\x00\x3c");
    // Field-less methods are just the ids.
    assert_eq!(&encode_method(&Method::TxCommit(TxCommit {}))[..], b"\x00\x5a\x00\x14");
    // queue.declare: the bit octet comes before the arguments table.
    let m = Method::QueueDeclare(QueueDeclare { queue: s("q"), durable: true, nowait: true, ..Default::default() });
    assert_eq!(&encode_method(&m)[..], b"\x00\x32\x00\x0a\x00\x00\x01q\x12\x00\x00\x00\x00");
}

#[test]
fn every_strict_prefix_of_every_method_is_a_syntax_error_naming_the_method() {
    for sample in every_method() {
        let sp = spec(&sample);
        let (m, n) = with_bits(&sample, u32::MAX);
        assert!(n == 0 || with_bits(&m, 0).0 != m);
        let bytes = encode_method(&m);
        for cut in 0..bytes.len() {
            let e = Method::decode(&bytes[..cut]).expect_err(&format!("{} cut at {cut} must not decode", sp.name));
            assert_eq!(e.reply_code(), c::SYNTAX_ERROR, "{} cut at {cut}: {e}", sp.name);
            if cut >= 4 {
                assert_eq!(e.method_ids(), Some((sp.class_id, sp.method_id)), "{} cut at {cut}", sp.name);
                assert!(matches!(e, FrameError::InMethod { name, .. } if name == sp.name));
            } else {
                assert_eq!(e.method_ids(), None);
            }
        }
    }
}

#[test]
fn trailing_bytes_after_the_arguments_are_tolerated() {
    for m in every_method() {
        let mut bytes = encode_method(&m);
        bytes.extend_from_slice(b"\xde\xad\xbe\xef");
        assert_eq!(Method::decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", m.name())), m);
    }
}

#[test]
fn non_utf8_short_strings_are_syntax_errors() {
    // connection.blocked with reason = 3 bytes of invalid UTF-8.
    let e = Method::decode(b"\x00\x0a\x00\x3c\x03\xff\xfe\xfd").expect_err("invalid UTF-8");
    assert_eq!(e.reply_code(), c::SYNTAX_ERROR);
    assert_eq!(e.method_ids(), Some((10, 60)));
    match e {
        FrameError::InMethod { source, .. } => assert!(matches!(*source, FrameError::Syntax { offset: 4, .. }), "{source:?}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn over_long_short_strings_are_cut_at_a_char_boundary() {
    // 255 bytes is the limit and round-trips (see every_method); beyond it the writer cuts
    // rather than writing a corrupt length, never splitting a UTF-8 sequence.
    let m = Method::BasicConsumeOk(BasicConsumeOk { consumer_tag: "é".repeat(200) });
    let bytes = encode_method(&m);
    assert_eq!(bytes[4], 254);
    match Method::decode(&bytes).expect("decodes") {
        Method::BasicConsumeOk(x) => assert_eq!(x.consumer_tag, "é".repeat(127)),
        other => panic!("{other:?}"),
    }
    let m = Method::BasicConsumeOk(BasicConsumeOk { consumer_tag: "a".repeat(1000) });
    assert_eq!(encode_method(&m).len(), 4 + 1 + 255);
}
