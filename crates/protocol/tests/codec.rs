//! The codec through its public API: every method and every field type round-trips exactly, and
//! truncated, oversized, garbled or random input is refused with the right error, never a panic.

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

/// One value of every method, every field non-default (bits both ways across the samples).
fn every_method() -> Vec<Method> {
    use Method as M;
    vec![
        M::ConnectionStart(ConnectionStart { version_major: 0, version_minor: 9, server_properties: table(), mechanisms: b("PLAIN AMQPLAIN"), locales: b("en_US") }),
        M::ConnectionStartOk(ConnectionStartOk { client_properties: table(), mechanism: s("PLAIN"), response: Bytes::from_static(b"\0guest\0guest"), locale: s("en_US") }),
        M::ConnectionSecure(ConnectionSecure { challenge: b("challenge") }),
        M::ConnectionSecureOk(ConnectionSecureOk { response: b("response") }),
        M::ConnectionTune(ConnectionTune { channel_max: 2047, frame_max: 131_072, heartbeat: 60 }),
        M::ConnectionTuneOk(ConnectionTuneOk { channel_max: 1, frame_max: 4096, heartbeat: 0 }),
        M::ConnectionOpen(ConnectionOpen { virtual_host: s("/"), reserved_1: s(""), reserved_2: true }),
        M::ConnectionOpenOk(ConnectionOpenOk { reserved_1: s("x") }),
        M::ConnectionClose(ConnectionClose { reply_code: 320, reply_text: s("CONNECTION_FORCED - bye"), class_id: 60, method_id: 40 }),
        M::ConnectionCloseOk(ConnectionCloseOk {}),
        M::ConnectionBlocked(ConnectionBlocked { reason: s("low on memory") }),
        M::ConnectionUnblocked(ConnectionUnblocked {}),
        M::ConnectionUpdateSecret(ConnectionUpdateSecret { new_secret: b("token"), reason: s("refresh") }),
        M::ConnectionUpdateSecretOk(ConnectionUpdateSecretOk {}),
        M::ChannelOpen(ChannelOpen { reserved_1: s("") }),
        M::ChannelOpenOk(ChannelOpenOk { reserved_1: b("") }),
        M::ChannelFlow(ChannelFlow { active: true }),
        M::ChannelFlowOk(ChannelFlowOk { active: false }),
        M::ChannelClose(ChannelClose { reply_code: 406, reply_text: s("PRECONDITION_FAILED - x"), class_id: 50, method_id: 10 }),
        M::ChannelCloseOk(ChannelCloseOk {}),
        M::AccessRequest(AccessRequest { realm: s("/data"), exclusive: true, passive: false, active: true, write: false, read: true }),
        M::AccessRequestOk(AccessRequestOk { reserved_1: 1 }),
        M::ExchangeDeclare(ExchangeDeclare { reserved_1: 0, exchange: s("ex"), kind: s("topic"), passive: false, durable: true, auto_delete: false, internal: true, nowait: false, arguments: table() }),
        M::ExchangeDeclareOk(ExchangeDeclareOk {}),
        M::ExchangeDelete(ExchangeDelete { reserved_1: 0, exchange: s("ex"), if_unused: true, nowait: false }),
        M::ExchangeDeleteOk(ExchangeDeleteOk {}),
        M::ExchangeBind(ExchangeBind { reserved_1: 0, destination: s("d"), source: s("s"), routing_key: s("a.*"), nowait: true, arguments: table() }),
        M::ExchangeBindOk(ExchangeBindOk {}),
        M::ExchangeUnbind(ExchangeUnbind { reserved_1: 0, destination: s("d"), source: s("s"), routing_key: s("#"), nowait: false, arguments: FieldTable::new() }),
        M::ExchangeUnbindOk(ExchangeUnbindOk {}),
        M::QueueDeclare(QueueDeclare { reserved_1: 0, queue: s("q"), passive: false, durable: true, exclusive: false, auto_delete: true, nowait: false, arguments: table() }),
        M::QueueDeclareOk(QueueDeclareOk { queue: s("amq.gen-abc"), message_count: 42, consumer_count: 3 }),
        M::QueueBind(QueueBind { reserved_1: 0, queue: s("q"), exchange: s("ex"), routing_key: s("k"), nowait: true, arguments: table() }),
        M::QueueBindOk(QueueBindOk {}),
        M::QueuePurge(QueuePurge { reserved_1: 0, queue: s("q"), nowait: true }),
        M::QueuePurgeOk(QueuePurgeOk { message_count: 7 }),
        M::QueueDelete(QueueDelete { reserved_1: 0, queue: s("q"), if_unused: true, if_empty: false, nowait: true }),
        M::QueueDeleteOk(QueueDeleteOk { message_count: 9 }),
        M::QueueUnbind(QueueUnbind { reserved_1: 0, queue: s("q"), exchange: s("ex"), routing_key: s("k"), arguments: table() }),
        M::QueueUnbindOk(QueueUnbindOk {}),
        M::BasicQos(BasicQos { prefetch_size: 0, prefetch_count: 1000, global: true }),
        M::BasicQosOk(BasicQosOk {}),
        M::BasicConsume(BasicConsume { reserved_1: 0, queue: s("q"), consumer_tag: s("ctag"), no_local: false, no_ack: true, exclusive: true, nowait: false, arguments: table() }),
        M::BasicConsumeOk(BasicConsumeOk { consumer_tag: s("amq.ctag-1") }),
        M::BasicCancel(BasicCancel { consumer_tag: s("ctag"), nowait: true }),
        M::BasicCancelOk(BasicCancelOk { consumer_tag: s("ctag") }),
        M::BasicPublish(BasicPublish { reserved_1: 0, exchange: s("amq.direct"), routing_key: s("rk"), mandatory: true, immediate: false }),
        M::BasicReturn(BasicReturn { reply_code: 312, reply_text: s("NO_ROUTE"), exchange: s("ex"), routing_key: s("rk") }),
        M::BasicDeliver(BasicDeliver { consumer_tag: s("ctag"), delivery_tag: u64::MAX, redelivered: true, exchange: s(""), routing_key: s("q") }),
        M::BasicGet(BasicGet { reserved_1: 0, queue: s("q"), no_ack: true }),
        M::BasicGetOk(BasicGetOk { delivery_tag: 5, redelivered: false, exchange: s("ex"), routing_key: s("rk"), message_count: 100 }),
        M::BasicGetEmpty(BasicGetEmpty { reserved_1: s("") }),
        M::BasicAck(BasicAck { delivery_tag: 1 << 40, multiple: true }),
        M::BasicReject(BasicReject { delivery_tag: 3, requeue: true }),
        M::BasicRecoverAsync(BasicRecoverAsync { requeue: true }),
        M::BasicRecover(BasicRecover { requeue: false }),
        M::BasicRecoverOk(BasicRecoverOk {}),
        M::BasicNack(BasicNack { delivery_tag: 8, multiple: false, requeue: true }),
        M::ConfirmSelect(ConfirmSelect { nowait: false }),
        M::ConfirmSelectOk(ConfirmSelectOk {}),
        M::TxSelect(TxSelect {}),
        M::TxSelectOk(TxSelectOk {}),
        M::TxCommit(TxCommit {}),
        M::TxCommitOk(TxCommitOk {}),
        M::TxRollback(TxRollback {}),
        M::TxRollbackOk(TxRollbackOk {}),
    ]
}

/// The AMQP 0-9-1 ids of each method (RabbitMQ's spec file), by exhaustive match: a method added to the
/// codec without a test sample here fails to compile.
fn spec_ids(m: &Method) -> (u16, u16) {
    use Method as M;
    match m {
        M::ConnectionStart(_) => (10, 10),
        M::ConnectionStartOk(_) => (10, 11),
        M::ConnectionSecure(_) => (10, 20),
        M::ConnectionSecureOk(_) => (10, 21),
        M::ConnectionTune(_) => (10, 30),
        M::ConnectionTuneOk(_) => (10, 31),
        M::ConnectionOpen(_) => (10, 40),
        M::ConnectionOpenOk(_) => (10, 41),
        M::ConnectionClose(_) => (10, 50),
        M::ConnectionCloseOk(_) => (10, 51),
        M::ConnectionBlocked(_) => (10, 60),
        M::ConnectionUnblocked(_) => (10, 61),
        M::ConnectionUpdateSecret(_) => (10, 70),
        M::ConnectionUpdateSecretOk(_) => (10, 71),
        M::ChannelOpen(_) => (20, 10),
        M::ChannelOpenOk(_) => (20, 11),
        M::ChannelFlow(_) => (20, 20),
        M::ChannelFlowOk(_) => (20, 21),
        M::ChannelClose(_) => (20, 40),
        M::ChannelCloseOk(_) => (20, 41),
        M::AccessRequest(_) => (30, 10),
        M::AccessRequestOk(_) => (30, 11),
        M::ExchangeDeclare(_) => (40, 10),
        M::ExchangeDeclareOk(_) => (40, 11),
        M::ExchangeDelete(_) => (40, 20),
        M::ExchangeDeleteOk(_) => (40, 21),
        M::ExchangeBind(_) => (40, 30),
        M::ExchangeBindOk(_) => (40, 31),
        M::ExchangeUnbind(_) => (40, 40),
        M::ExchangeUnbindOk(_) => (40, 51),
        M::QueueDeclare(_) => (50, 10),
        M::QueueDeclareOk(_) => (50, 11),
        M::QueueBind(_) => (50, 20),
        M::QueueBindOk(_) => (50, 21),
        M::QueuePurge(_) => (50, 30),
        M::QueuePurgeOk(_) => (50, 31),
        M::QueueDelete(_) => (50, 40),
        M::QueueDeleteOk(_) => (50, 41),
        M::QueueUnbind(_) => (50, 50),
        M::QueueUnbindOk(_) => (50, 51),
        M::BasicQos(_) => (60, 10),
        M::BasicQosOk(_) => (60, 11),
        M::BasicConsume(_) => (60, 20),
        M::BasicConsumeOk(_) => (60, 21),
        M::BasicCancel(_) => (60, 30),
        M::BasicCancelOk(_) => (60, 31),
        M::BasicPublish(_) => (60, 40),
        M::BasicReturn(_) => (60, 50),
        M::BasicDeliver(_) => (60, 60),
        M::BasicGet(_) => (60, 70),
        M::BasicGetOk(_) => (60, 71),
        M::BasicGetEmpty(_) => (60, 72),
        M::BasicAck(_) => (60, 80),
        M::BasicReject(_) => (60, 90),
        M::BasicRecoverAsync(_) => (60, 100),
        M::BasicRecover(_) => (60, 110),
        M::BasicRecoverOk(_) => (60, 111),
        M::BasicNack(_) => (60, 120),
        M::ConfirmSelect(_) => (85, 10),
        M::ConfirmSelectOk(_) => (85, 11),
        M::TxSelect(_) => (90, 10),
        M::TxSelectOk(_) => (90, 11),
        M::TxCommit(_) => (90, 20),
        M::TxCommitOk(_) => (90, 21),
        M::TxRollback(_) => (90, 30),
        M::TxRollbackOk(_) => (90, 31),
    }
}

fn encode(m: &Method) -> BytesMut {
    let mut out = BytesMut::new();
    m.encode(&mut out);
    out
}

#[test]
fn every_method_round_trips_with_spec_ids() {
    let all = every_method();
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
    for m in every_method() {
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
    for m in every_method() {
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

/// A field table holding `depth` nested tables (`F`) or arrays (`A`).
fn nested(letter: u8, depth: usize) -> Vec<u8> {
    let with_len = |bytes: Vec<u8>| {
        let mut out = (bytes.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&bytes);
        out
    };
    if letter == b'F' {
        let mut table = with_len(vec![]);
        for _ in 0..depth {
            let mut entry = vec![1u8, b'k', b'F'];
            entry.extend_from_slice(&table);
            table = with_len(entry);
        }
        table
    } else {
        let mut array = vec![b'V'];
        for _ in 0..depth {
            let mut a = vec![b'A'];
            a.extend_from_slice(&with_len(array));
            array = a;
        }
        let mut entry = vec![1u8, b'a'];
        entry.extend_from_slice(&array);
        with_len(entry)
    }
}

#[test]
fn tables_nested_beyond_the_limit_are_refused_not_a_stack_overflow() {
    for letter in [b'F', b'A'] {
        let shallow = nested(letter, 10);
        assert!(FieldTable::decode(&shallow).is_ok(), "{} depth 10 is fine", letter as char);
        assert!(warren_protocol::field::validate_table(&shallow).is_ok());
        // 10,000 levels: a recursive decoder without a limit would overflow the stack.
        let deep = nested(letter, 10_000);
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
