//! `parse_frame`: valid frames of each type, incomplete input (nothing consumed), envelope
//! errors (501), frame_max enforced from the header alone, malformed payloads (502), unknown
//! methods (540); and the frame writers, hot-path ones included, produce what it parses.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::*;
use warren_protocol::constants as c;
use warren_protocol::error::FrameError;
use warren_protocol::frame::{self, ContentHeader, Frame};
use warren_protocol::method::*;

const MAX: u32 = 131_072;

/// A raw frame: type, channel, size, payload, end octet.
fn raw_frame(frame_type: u8, channel: u16, payload: &[u8], end: u8) -> BytesMut {
    let mut f = BytesMut::new();
    f.put_u8(frame_type);
    f.put_u16(channel);
    f.put_u32(payload.len() as u32);
    f.put_slice(payload);
    f.put_u8(end);
    f
}

fn parse_one(bytes: &[u8], frame_max: u32) -> Result<Option<Frame>, FrameError> {
    frame::parse_frame(&mut BytesMut::from(bytes), frame_max)
}

/// One valid frame of each type, with what it parses to.
fn samples() -> Vec<(BytesMut, Frame)> {
    let publish = Method::BasicPublish(BasicPublish { reserved_1: 0, exchange: s("ex"), routing_key: s("rk"), mandatory: true, immediate: false });
    let mut method = BytesMut::new();
    frame::write_method(&mut method, 5, &publish);

    let props = encode_props(&all_properties());
    let mut header_payload = BytesMut::new();
    header_payload.put_u16(60);
    header_payload.put_u16(0);
    header_payload.put_u64(11);
    header_payload.put_slice(&props);
    let header = raw_frame(c::FRAME_HEADER, 5, &header_payload, c::FRAME_END);

    let body = raw_frame(c::FRAME_BODY, 5, b"hello world", c::FRAME_END);
    let empty_body = raw_frame(c::FRAME_BODY, 6, b"", c::FRAME_END);
    let mut heartbeat = BytesMut::new();
    frame::write_heartbeat(&mut heartbeat);
    assert_eq!(&heartbeat[..], &[8, 0, 0, 0, 0, 0, 0, 0xce]);

    vec![
        (method, Frame::Method { channel: 5, method: publish }),
        (header, Frame::Header { channel: 5, header: ContentHeader { class_id: 60, body_size: 11, properties: props.freeze() } }),
        (body, Frame::Body { channel: 5, payload: Bytes::from_static(b"hello world") }),
        (empty_body, Frame::Body { channel: 6, payload: Bytes::new() }),
        (heartbeat, Frame::Heartbeat { channel: 0 }),
    ]
}

#[test]
fn valid_frames_of_each_type_parse_and_are_consumed_exactly() {
    for (bytes, expected) in samples() {
        let mut buf = bytes.clone();
        buf.extend_from_slice(b"next"); // the start of the following frame stays put
        assert_eq!(frame::parse_frame(&mut buf, MAX), Ok(Some(expected)));
        assert_eq!(&buf[..], b"next");
    }
}

#[test]
fn a_stream_parses_the_same_fed_whole_or_byte_by_byte() {
    let samples = samples();
    let mut stream = BytesMut::new();
    for (bytes, _) in &samples {
        stream.extend_from_slice(bytes);
    }
    let expected: Vec<Frame> = samples.into_iter().map(|(_, f)| f).collect();

    let mut whole = stream.clone();
    let mut got = Vec::new();
    while let Some(f) = frame::parse_frame(&mut whole, MAX).expect("valid") {
        got.push(f);
    }
    assert_eq!(got, expected);
    assert!(whole.is_empty());

    let mut buf = BytesMut::new();
    let mut got = Vec::new();
    for &byte in stream.iter() {
        buf.put_u8(byte);
        while let Some(f) = frame::parse_frame(&mut buf, MAX).expect("valid") {
            got.push(f);
        }
    }
    assert_eq!(got, expected);
    assert!(buf.is_empty());
}

#[test]
fn every_strict_prefix_needs_more_and_consumes_nothing() {
    let mut all: Vec<BytesMut> = samples().into_iter().map(|(b, _)| b).collect();
    for m in every_method() {
        let mut f = BytesMut::new();
        frame::write_method(&mut f, 1, &m);
        all.push(f);
    }
    for f in all {
        for cut in 0..f.len() {
            let mut partial = BytesMut::from(&f[..cut]);
            assert_eq!(frame::parse_frame(&mut partial, MAX), Ok(None), "cut {cut} of {}", hex(&f));
            assert_eq!(&partial[..], &f[..cut], "nothing consumed");
        }
    }
}

#[test]
fn a_bad_frame_end_is_a_frame_error() {
    for (bytes, _) in samples() {
        for end in [0x00, 0xcd, 0xcf, 0xff] {
            let mut bad = bytes.clone();
            let last = bad.len() - 1;
            bad[last] = end;
            let e = parse_one(&bad, MAX).expect_err("bad end");
            assert_eq!(e, FrameError::BadFrameEnd { found: end });
            assert_eq!(e.reply_code(), c::FRAME_ERROR);
        }
    }
}

#[test]
fn unknown_frame_types_are_frame_errors_from_the_header_alone() {
    for frame_type in 0..=255u8 {
        let bytes = raw_frame(frame_type, 0, b"", c::FRAME_END);
        let known = [c::FRAME_METHOD, c::FRAME_HEADER, c::FRAME_BODY, c::FRAME_HEARTBEAT].contains(&frame_type);
        let result = parse_one(&bytes[..7], MAX); // no payload, no end octet yet
        if known {
            assert_eq!(result, Ok(None), "type {frame_type}");
        } else {
            let e = result.expect_err("unknown type");
            assert_eq!(e, FrameError::UnknownFrameType { frame_type });
            assert_eq!(e.reply_code(), c::FRAME_ERROR);
        }
    }
}

#[test]
fn frame_max_is_enforced_from_the_seven_byte_header() {
    for frame_max in [c::FRAME_MIN_SIZE, MAX] {
        let limit = frame_max - c::FRAME_OVERHEAD; // largest payload allowed
        // At the limit: accepted (needs more until complete, then parses).
        let at_limit = raw_frame(c::FRAME_BODY, 1, &vec![7u8; limit as usize], c::FRAME_END);
        assert_eq!(at_limit.len(), frame_max as usize);
        assert_eq!(parse_one(&at_limit[..7], frame_max), Ok(None));
        assert!(matches!(parse_one(&at_limit, frame_max), Ok(Some(Frame::Body { .. }))));
        // One byte over, and far over: refused with only the header in hand.
        for size in [limit + 1, limit * 2, u32::MAX - 8, u32::MAX] {
            let mut head = BytesMut::new();
            head.put_u8(c::FRAME_METHOD);
            head.put_u16(1);
            head.put_u32(size);
            let e = frame::parse_frame(&mut head, frame_max).expect_err("too large");
            assert!(matches!(e, FrameError::TooLarge { frame_max: m, .. } if m == frame_max), "{e:?}");
            assert_eq!(e.reply_code(), c::FRAME_ERROR);
            assert!(head.capacity() < 1 << 20, "no room reserved for a refused frame");
        }
    }
    // frame_max 0 means no limit.
    let big = raw_frame(c::FRAME_BODY, 1, &vec![0u8; 300_000], c::FRAME_END);
    assert!(matches!(parse_one(&big, 0), Ok(Some(Frame::Body { .. }))));
    assert!(matches!(parse_one(&big, MAX), Err(FrameError::TooLarge { .. })));
}

#[test]
fn truncated_method_arguments_inside_a_whole_frame_are_syntax_errors() {
    for m in every_method() {
        let (m, _) = with_bits(&m, u32::MAX);
        let args = encode_method(&m);
        for cut in 0..args.len() {
            let e = parse_one(&raw_frame(c::FRAME_METHOD, 1, &args[..cut], c::FRAME_END), MAX)
                .expect_err(&format!("{} cut at {cut}", m.name()));
            assert_eq!(e.reply_code(), c::SYNTAX_ERROR, "{} cut at {cut}: {e}", m.name());
        }
    }
}

#[test]
fn unknown_methods_are_not_implemented() {
    for (class_id, method_id) in [(60u16, 99u16), (60, 0), (99, 10), (0, 0), (40, 41), (30, 12), (85, 12), (90, 40), (u16::MAX, u16::MAX)] {
        let mut payload = class_id.to_be_bytes().to_vec();
        payload.extend_from_slice(&method_id.to_be_bytes());
        payload.extend_from_slice(b"args");
        let e = parse_one(&raw_frame(c::FRAME_METHOD, 1, &payload, c::FRAME_END), MAX).expect_err("unknown");
        assert_eq!(e, FrameError::UnknownMethod { class_id, method_id });
        assert_eq!(e.reply_code(), c::NOT_IMPLEMENTED);
        assert_eq!(e.method_ids(), Some((class_id, method_id)));
    }
}

#[test]
fn malformed_header_frames_are_syntax_errors() {
    let props = encode_props(&all_properties());
    let mut payload = BytesMut::new();
    payload.put_u16(60);
    payload.put_u16(0);
    payload.put_u64(5);
    payload.put_slice(&props);
    // Cut anywhere: shorter than the fixed 12 bytes, or properties cut short.
    for cut in 0..payload.len() {
        let e = parse_one(&raw_frame(c::FRAME_HEADER, 1, &payload[..cut], c::FRAME_END), MAX).expect_err("cut header");
        assert_eq!(e.reply_code(), c::SYNTAX_ERROR, "cut {cut}: {e}");
    }
    // Headers table with an unknown field type.
    let mut bad = payload[..12].to_vec();
    bad.extend_from_slice(b"\x20\x00\x00\x00\x00\x03\x01kZ");
    let e = parse_one(&raw_frame(c::FRAME_HEADER, 1, &bad, c::FRAME_END), MAX).expect_err("bad headers");
    assert_eq!(e.reply_code(), c::SYNTAX_ERROR);
}

#[test]
fn body_payloads_are_not_copied() {
    let mut buf = raw_frame(c::FRAME_BODY, 1, &[42u8; 1000], c::FRAME_END);
    let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    match frame::parse_frame(&mut buf, MAX) {
        Ok(Some(Frame::Body { payload, .. })) => {
            assert_eq!(payload.len(), 1000);
            assert!(range.contains(&(payload.as_ptr() as usize)), "payload points into the read buffer");
        }
        other => panic!("{other:?}"),
    }
}

/// Parses every frame in `out` (all must be complete and valid).
fn parse_all(mut out: BytesMut, frame_max: u32) -> Vec<Frame> {
    let mut frames = Vec::new();
    while let Some(f) = frame::parse_frame(&mut out, frame_max).expect("valid") {
        frames.push(f);
    }
    assert!(out.is_empty());
    frames
}

/// Header frame and reassembled body from a content sequence.
fn content(frames: &[Frame], channel: u16, frame_max: u32) -> (ContentHeader, Vec<u8>) {
    let mut body = Vec::new();
    let mut header = None;
    for f in frames {
        match f {
            Frame::Header { channel: ch, header: h } if *ch == channel && header.is_none() => header = Some(h.clone()),
            Frame::Body { channel: ch, payload } if *ch == channel && header.is_some() => {
                assert!(!payload.is_empty(), "no empty body frames");
                assert!(payload.len() + 8 <= frame_max as usize, "body frame over frame_max");
                body.extend_from_slice(payload);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    (header.expect("a header frame"), body)
}

#[test]
fn write_content_splits_bodies_at_frame_max() {
    let props = encode_props(&subset(&all_properties(), 0b1000_0000_1000)); // delivery-mode, message-id
    let frame_max = c::FRAME_MIN_SIZE;
    let chunk = (frame_max - c::FRAME_OVERHEAD) as usize;
    for len in [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk, 3 * chunk + 17] {
        let body: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
        let mut out = BytesMut::new();
        frame::write_content(&mut out, 9, 60, &props, &body, frame_max);
        let frames = parse_all(out, frame_max);
        assert_eq!(frames.len(), 1 + len.div_ceil(chunk), "len {len}");
        let (h, got) = content(&frames, 9, frame_max);
        assert_eq!((h.class_id, h.body_size), (60, len as u64));
        assert_eq!(&h.properties[..], &props[..]);
        assert_eq!(got, body, "len {len}");
    }
}

/// The hot-path writers must produce exactly what write_method + write_content produce.
#[test]
fn hot_path_writers_match_the_generic_ones() {
    let props = encode_props(&all_properties());
    let body = vec![0xabu8; 10_000];
    let frame_max = c::FRAME_MIN_SIZE;
    let long = "é".repeat(200); // over 255 bytes: both paths must cut it the same way
    for (tag, redelivered, exchange) in [(1u64, false, ""), (u64::MAX, true, "amq.topic"), (1 << 33, true, long.as_str())] {
        let mut fast = BytesMut::new();
        frame::write_basic_deliver(&mut fast, 3, "ctag", tag, redelivered, exchange, "rk", &props, &body, frame_max);
        let mut slow = BytesMut::new();
        let m = Method::BasicDeliver(BasicDeliver { consumer_tag: s("ctag"), delivery_tag: tag, redelivered, exchange: s(exchange), routing_key: s("rk") });
        frame::write_method(&mut slow, 3, &m);
        frame::write_content(&mut slow, 3, 60, &props, &body, frame_max);
        assert_eq!(fast, slow, "basic.deliver");

        let mut fast = BytesMut::new();
        frame::write_basic_get_ok(&mut fast, 3, tag, redelivered, exchange, "rk", 77, &props, &body, frame_max);
        let mut slow = BytesMut::new();
        let m = Method::BasicGetOk(BasicGetOk { delivery_tag: tag, redelivered, exchange: s(exchange), routing_key: s("rk"), message_count: 77 });
        frame::write_method(&mut slow, 3, &m);
        frame::write_content(&mut slow, 3, 60, &props, &body, frame_max);
        assert_eq!(fast, slow, "basic.get-ok");

        let mut fast = BytesMut::new();
        frame::write_basic_return(&mut fast, 3, 312, "NO_ROUTE", exchange, "rk", &props, &body, frame_max);
        let mut slow = BytesMut::new();
        let m = Method::BasicReturn(BasicReturn { reply_code: 312, reply_text: s("NO_ROUTE"), exchange: s(exchange), routing_key: s("rk") });
        frame::write_method(&mut slow, 3, &m);
        frame::write_content(&mut slow, 3, 60, &props, &body, frame_max);
        assert_eq!(fast, slow, "basic.return");

        let mut fast = BytesMut::new();
        frame::write_basic_ack(&mut fast, 3, tag, redelivered);
        let mut slow = BytesMut::new();
        frame::write_method(&mut slow, 3, &Method::BasicAck(BasicAck { delivery_tag: tag, multiple: redelivered }));
        assert_eq!(fast, slow, "basic.ack");
    }
    // And what they write parses back.
    let mut out = BytesMut::new();
    frame::write_basic_deliver(&mut out, 3, "ctag", 5, true, "ex", "rk", &props, &body, frame_max);
    let frames = parse_all(out, frame_max);
    assert!(matches!(&frames[0], Frame::Method { channel: 3, method: Method::BasicDeliver(d) } if d.delivery_tag == 5 && d.redelivered));
    let (h, got) = content(&frames[1..], 3, frame_max);
    assert_eq!(h.body_size, body.len() as u64);
    assert_eq!(got, body);
}

/// `write_basic_deliver_head` + the body + FRAME_END is `write_basic_deliver`, for a body that fits
/// one frame; longer ones do not qualify.
#[test]
fn deliver_head_and_spliced_body_match_the_whole_deliver() {
    let props = encode_props(&all_properties());
    let frame_max = c::FRAME_MIN_SIZE;
    for len in [1usize, 1000, (frame_max - c::FRAME_OVERHEAD) as usize] {
        let body = vec![0x5au8; len];
        assert!(frame::fits_one_body_frame(len, frame_max));
        let mut whole = BytesMut::new();
        frame::write_basic_deliver(&mut whole, 3, "ctag", 7, true, "ex", "rk", &props, &body, frame_max);
        let mut spliced = BytesMut::new();
        frame::write_basic_deliver_head(&mut spliced, 3, "ctag", 7, true, "ex", "rk", &props, len);
        spliced.extend_from_slice(&body);
        spliced.extend_from_slice(&[c::FRAME_END]);
        assert_eq!(whole, spliced, "body of {len} bytes");
    }
    assert!(!frame::fits_one_body_frame((frame_max - c::FRAME_OVERHEAD) as usize + 1, frame_max));
    assert!(!frame::fits_one_body_frame(0, frame_max), "an empty body has no body frame");
    assert!(frame::fits_one_body_frame(10 << 20, 0), "frame_max 0: no limit");
}
