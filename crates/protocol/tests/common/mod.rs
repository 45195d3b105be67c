//! Samples shared by the codec test files: one value of every method, a table using every
//! field type, and basic properties with every property set.
#![allow(dead_code)]

use bytes::{Bytes, BytesMut};
use warren_protocol::field::{Decimal, FieldTable, FieldValue};
use warren_protocol::method::*;
use warren_protocol::properties::BasicProperties;

pub fn s(v: &str) -> String {
    v.to_string()
}

pub fn b(v: &[u8]) -> Bytes {
    Bytes::copy_from_slice(v)
}

pub fn table(pairs: Vec<(&str, FieldValue)>) -> FieldTable {
    FieldTable(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

pub fn encode_table(t: &FieldTable) -> BytesMut {
    let mut out = BytesMut::new();
    t.encode(&mut out);
    out
}

pub fn encode_method(m: &Method) -> BytesMut {
    let mut out = BytesMut::new();
    m.encode(&mut out);
    out
}

pub fn encode_props(p: &BasicProperties) -> BytesMut {
    let mut out = BytesMut::new();
    p.encode(&mut out);
    out
}

/// A small but non-trivial table, like the `arguments` or `client_properties` clients send.
pub fn args() -> FieldTable {
    table(vec![
        ("x-message-ttl", FieldValue::I32(60_000)),
        ("x-dead-letter-exchange", FieldValue::LongString(b(b"dlx"))),
        ("x-max-priority", FieldValue::U8(10)),
        (
            "capabilities",
            FieldValue::Table(table(vec![
                ("publisher_confirms", FieldValue::Bool(true)),
                ("basic.nack", FieldValue::Bool(false)),
                ("list", FieldValue::Array(vec![FieldValue::I64(-1), FieldValue::Void])),
            ])),
        ),
    ])
}

/// A table holding every field type at its edge values, nested tables and arrays included.
pub fn every_type_table() -> FieldTable {
    let inner = table(vec![
        ("deep", FieldValue::Array(vec![FieldValue::Void, FieldValue::Table(args()), FieldValue::Array(vec![])])),
        ("", FieldValue::LongString(Bytes::new())), // empty key
    ]);
    let mut every = vec![
        ("t-true", FieldValue::Bool(true)),
        ("t-false", FieldValue::Bool(false)),
        ("b-min", FieldValue::I8(i8::MIN)),
        ("b-max", FieldValue::I8(i8::MAX)),
        ("B-min", FieldValue::U8(0)),
        ("B-max", FieldValue::U8(u8::MAX)),
        ("s-min", FieldValue::I16(i16::MIN)),
        ("s-max", FieldValue::I16(i16::MAX)),
        ("u-min", FieldValue::U16(0)),
        ("u-max", FieldValue::U16(u16::MAX)),
        ("I-min", FieldValue::I32(i32::MIN)),
        ("I-max", FieldValue::I32(i32::MAX)),
        ("i-min", FieldValue::U32(0)),
        ("i-max", FieldValue::U32(u32::MAX)),
        ("l-min", FieldValue::I64(i64::MIN)),
        ("l-max", FieldValue::I64(i64::MAX)),
        ("L-min", FieldValue::U64(0)),
        ("L-max", FieldValue::U64(u64::MAX)),
        ("f-min", FieldValue::F32(f32::MIN)),
        ("f-max", FieldValue::F32(f32::MAX)),
        ("f-tiny", FieldValue::F32(f32::MIN_POSITIVE)),
        ("f-subnormal", FieldValue::F32(f32::from_bits(1))),
        ("f-neg-zero", FieldValue::F32(-0.0)),
        ("f-inf", FieldValue::F32(f32::NEG_INFINITY)),
        ("d-min", FieldValue::F64(f64::MIN)),
        ("d-max", FieldValue::F64(f64::MAX)),
        ("d-eps", FieldValue::F64(f64::EPSILON)),
        ("d-inf", FieldValue::F64(f64::INFINITY)),
        ("d-pi", FieldValue::F64(std::f64::consts::PI)),
        ("D-zero", FieldValue::Decimal(Decimal { scale: 0, value: 0 })),
        ("D-max", FieldValue::Decimal(Decimal { scale: u8::MAX, value: u32::MAX })),
        ("S-empty", FieldValue::LongString(Bytes::new())),
        ("S-utf8", FieldValue::LongString(b("héllo wörld 日本 🐇".as_bytes()))),
        ("S-binary", FieldValue::LongString(b(b"\xff\xfe\x00\xc3\x28\x80"))),
        ("S-long", FieldValue::LongString(Bytes::from(vec![b'z'; 300]))), // longer than a short string
        ("x-empty", FieldValue::ByteArray(Bytes::new())),
        ("x", FieldValue::ByteArray(b(&[0, 1, 2, 0xff]))),
        ("T-zero", FieldValue::Timestamp(0)),
        ("T-max", FieldValue::Timestamp(u64::MAX)),
        ("V", FieldValue::Void),
        ("A-empty", FieldValue::Array(vec![])),
        ("F-empty", FieldValue::Table(FieldTable::new())),
        ("F", FieldValue::Table(inner.clone())),
        ("k".repeat(255).leak(), FieldValue::Bool(true)), // longest key
        ("clé-日本", FieldValue::I8(1)),                   // non-ASCII key
        ("t-true", FieldValue::Bool(false)),               // duplicate key: kept, in order
    ];
    // An array holding one of every type, the array itself included.
    let all: Vec<FieldValue> = every.iter().map(|(_, v)| v.clone()).collect();
    every.push(("A-all", FieldValue::Array(all.clone())));
    every.push(("A-nested", FieldValue::Array(vec![FieldValue::Array(all), FieldValue::Table(inner)])));
    table(every)
}

/// One value of every method, every field non-default (reserved fields included), bits mixed.
pub fn every_method() -> Vec<Method> {
    use Method as M;
    let long = "r".repeat(255); // longest short string
    vec![
        M::ConnectionStart(ConnectionStart { version_major: 1, version_minor: 9, server_properties: args(), mechanisms: b(b"PLAIN AMQPLAIN"), locales: b(b"en_US") }),
        M::ConnectionStartOk(ConnectionStartOk { client_properties: every_type_table(), mechanism: s("PLAIN"), response: b(b"\0guest\0\xffpw"), locale: s("en_US") }),
        M::ConnectionSecure(ConnectionSecure { challenge: b(b"\x01challenge") }),
        M::ConnectionSecureOk(ConnectionSecureOk { response: b(b"\x02response") }),
        M::ConnectionTune(ConnectionTune { channel_max: 2047, frame_max: 131_072, heartbeat: 60 }),
        M::ConnectionTuneOk(ConnectionTuneOk { channel_max: u16::MAX, frame_max: u32::MAX, heartbeat: 1 }),
        M::ConnectionOpen(ConnectionOpen { virtual_host: s("/vhost-é"), reserved_1: s("capabilities"), reserved_2: true }),
        M::ConnectionOpenOk(ConnectionOpenOk { reserved_1: s("known-hosts") }),
        M::ConnectionClose(ConnectionClose { reply_code: 320, reply_text: s("CONNECTION_FORCED - bye"), class_id: 60, method_id: 40 }),
        M::ConnectionCloseOk(ConnectionCloseOk {}),
        M::ConnectionBlocked(ConnectionBlocked { reason: s("low on memory") }),
        M::ConnectionUnblocked(ConnectionUnblocked {}),
        M::ConnectionUpdateSecret(ConnectionUpdateSecret { new_secret: b(b"jwt.token.\xff"), reason: s("refresh") }),
        M::ConnectionUpdateSecretOk(ConnectionUpdateSecretOk {}),
        M::ChannelOpen(ChannelOpen { reserved_1: s("out-of-band") }),
        M::ChannelOpenOk(ChannelOpenOk { reserved_1: b(b"channel-id") }),
        M::ChannelFlow(ChannelFlow { active: true }),
        M::ChannelFlowOk(ChannelFlowOk { active: true }),
        M::ChannelClose(ChannelClose { reply_code: 406, reply_text: s("PRECONDITION_FAILED - x"), class_id: 50, method_id: 10 }),
        M::ChannelCloseOk(ChannelCloseOk {}),
        M::AccessRequest(AccessRequest { realm: s("/data"), exclusive: true, passive: false, active: true, write: false, read: true }),
        M::AccessRequestOk(AccessRequestOk { reserved_1: 0xBEEF }),
        M::ExchangeDeclare(ExchangeDeclare { reserved_1: 7, exchange: s("ex"), kind: s("x-consistent-hash"), passive: true, durable: true, auto_delete: false, internal: true, nowait: false, arguments: args() }),
        M::ExchangeDeclareOk(ExchangeDeclareOk {}),
        M::ExchangeDelete(ExchangeDelete { reserved_1: 8, exchange: s("ex"), if_unused: true, nowait: false }),
        M::ExchangeDeleteOk(ExchangeDeleteOk {}),
        M::ExchangeBind(ExchangeBind { reserved_1: 9, destination: s("dst"), source: s("src"), routing_key: s("a.*.b"), nowait: true, arguments: args() }),
        M::ExchangeBindOk(ExchangeBindOk {}),
        M::ExchangeUnbind(ExchangeUnbind { reserved_1: 10, destination: s("dst"), source: s("src"), routing_key: s("#"), nowait: true, arguments: args() }),
        M::ExchangeUnbindOk(ExchangeUnbindOk {}),
        M::QueueDeclare(QueueDeclare { reserved_1: 11, queue: long.clone(), passive: false, durable: true, exclusive: false, auto_delete: true, nowait: true, arguments: every_type_table() }),
        M::QueueDeclareOk(QueueDeclareOk { queue: s("amq.gen-abc"), message_count: u32::MAX, consumer_count: 3 }),
        M::QueueBind(QueueBind { reserved_1: 12, queue: s("q"), exchange: s("ex"), routing_key: long.clone(), nowait: true, arguments: args() }),
        M::QueueBindOk(QueueBindOk {}),
        M::QueuePurge(QueuePurge { reserved_1: 13, queue: s("q"), nowait: true }),
        M::QueuePurgeOk(QueuePurgeOk { message_count: 7 }),
        M::QueueDelete(QueueDelete { reserved_1: 14, queue: s("q"), if_unused: true, if_empty: false, nowait: true }),
        M::QueueDeleteOk(QueueDeleteOk { message_count: 9 }),
        M::QueueUnbind(QueueUnbind { reserved_1: 15, queue: s("q"), exchange: s("ex"), routing_key: s("k"), arguments: args() }),
        M::QueueUnbindOk(QueueUnbindOk {}),
        M::BasicQos(BasicQos { prefetch_size: 65_536, prefetch_count: 1000, global: true }),
        M::BasicQosOk(BasicQosOk {}),
        M::BasicConsume(BasicConsume { reserved_1: 16, queue: s("q"), consumer_tag: s("ctag"), no_local: true, no_ack: false, exclusive: true, nowait: false, arguments: args() }),
        M::BasicConsumeOk(BasicConsumeOk { consumer_tag: s("amq.ctag-1") }),
        M::BasicCancel(BasicCancel { consumer_tag: s("ctag"), nowait: true }),
        M::BasicCancelOk(BasicCancelOk { consumer_tag: s("ctag") }),
        M::BasicPublish(BasicPublish { reserved_1: 17, exchange: s("amq.direct"), routing_key: s("rk"), mandatory: true, immediate: false }),
        M::BasicReturn(BasicReturn { reply_code: 312, reply_text: s("NO_ROUTE"), exchange: s("ex"), routing_key: s("rk") }),
        M::BasicDeliver(BasicDeliver { consumer_tag: s("ctag"), delivery_tag: u64::MAX, redelivered: true, exchange: s("ex"), routing_key: s("q") }),
        M::BasicGet(BasicGet { reserved_1: 18, queue: s("q"), no_ack: true }),
        M::BasicGetOk(BasicGetOk { delivery_tag: 5, redelivered: true, exchange: s("ex"), routing_key: s("rk"), message_count: 100 }),
        M::BasicGetEmpty(BasicGetEmpty { reserved_1: s("cluster") }),
        M::BasicAck(BasicAck { delivery_tag: 1 << 40, multiple: true }),
        M::BasicReject(BasicReject { delivery_tag: 3, requeue: true }),
        M::BasicRecoverAsync(BasicRecoverAsync { requeue: true }),
        M::BasicRecover(BasicRecover { requeue: true }),
        M::BasicRecoverOk(BasicRecoverOk {}),
        M::BasicNack(BasicNack { delivery_tag: 8, multiple: false, requeue: true }),
        M::ConfirmSelect(ConfirmSelect { nowait: true }),
        M::ConfirmSelectOk(ConfirmSelectOk {}),
        M::TxSelect(TxSelect {}),
        M::TxSelectOk(TxSelectOk {}),
        M::TxCommit(TxCommit {}),
        M::TxCommitOk(TxCommitOk {}),
        M::TxRollback(TxRollback {}),
        M::TxRollbackOk(TxRollbackOk {}),
    ]
}

/// What the AMQP 0-9-1 spec (RabbitMQ's `amqp-rabbitmq-0.9.1.json`) says about a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub class_id: u16,
    pub method_id: u16,
    pub name: &'static str,
    /// Number of `bit` arguments.
    pub bits: usize,
    /// Content (header and body frames) follows.
    pub content: bool,
}

/// The spec entry of a method, by exhaustive match: adding a `Method` variant without adding it
/// here fails to compile.
pub fn spec(m: &Method) -> Spec {
    use Method as M;
    let (class_id, method_id, name, bits, content) = match m {
        M::ConnectionStart(_) => (10, 10, "connection.start", 0, false),
        M::ConnectionStartOk(_) => (10, 11, "connection.start-ok", 0, false),
        M::ConnectionSecure(_) => (10, 20, "connection.secure", 0, false),
        M::ConnectionSecureOk(_) => (10, 21, "connection.secure-ok", 0, false),
        M::ConnectionTune(_) => (10, 30, "connection.tune", 0, false),
        M::ConnectionTuneOk(_) => (10, 31, "connection.tune-ok", 0, false),
        M::ConnectionOpen(_) => (10, 40, "connection.open", 1, false),
        M::ConnectionOpenOk(_) => (10, 41, "connection.open-ok", 0, false),
        M::ConnectionClose(_) => (10, 50, "connection.close", 0, false),
        M::ConnectionCloseOk(_) => (10, 51, "connection.close-ok", 0, false),
        M::ConnectionBlocked(_) => (10, 60, "connection.blocked", 0, false),
        M::ConnectionUnblocked(_) => (10, 61, "connection.unblocked", 0, false),
        M::ConnectionUpdateSecret(_) => (10, 70, "connection.update-secret", 0, false),
        M::ConnectionUpdateSecretOk(_) => (10, 71, "connection.update-secret-ok", 0, false),
        M::ChannelOpen(_) => (20, 10, "channel.open", 0, false),
        M::ChannelOpenOk(_) => (20, 11, "channel.open-ok", 0, false),
        M::ChannelFlow(_) => (20, 20, "channel.flow", 1, false),
        M::ChannelFlowOk(_) => (20, 21, "channel.flow-ok", 1, false),
        M::ChannelClose(_) => (20, 40, "channel.close", 0, false),
        M::ChannelCloseOk(_) => (20, 41, "channel.close-ok", 0, false),
        M::AccessRequest(_) => (30, 10, "access.request", 5, false),
        M::AccessRequestOk(_) => (30, 11, "access.request-ok", 0, false),
        M::ExchangeDeclare(_) => (40, 10, "exchange.declare", 5, false),
        M::ExchangeDeclareOk(_) => (40, 11, "exchange.declare-ok", 0, false),
        M::ExchangeDelete(_) => (40, 20, "exchange.delete", 2, false),
        M::ExchangeDeleteOk(_) => (40, 21, "exchange.delete-ok", 0, false),
        M::ExchangeBind(_) => (40, 30, "exchange.bind", 1, false),
        M::ExchangeBindOk(_) => (40, 31, "exchange.bind-ok", 0, false),
        M::ExchangeUnbind(_) => (40, 40, "exchange.unbind", 1, false),
        M::ExchangeUnbindOk(_) => (40, 51, "exchange.unbind-ok", 0, false),
        M::QueueDeclare(_) => (50, 10, "queue.declare", 5, false),
        M::QueueDeclareOk(_) => (50, 11, "queue.declare-ok", 0, false),
        M::QueueBind(_) => (50, 20, "queue.bind", 1, false),
        M::QueueBindOk(_) => (50, 21, "queue.bind-ok", 0, false),
        M::QueuePurge(_) => (50, 30, "queue.purge", 1, false),
        M::QueuePurgeOk(_) => (50, 31, "queue.purge-ok", 0, false),
        M::QueueDelete(_) => (50, 40, "queue.delete", 3, false),
        M::QueueDeleteOk(_) => (50, 41, "queue.delete-ok", 0, false),
        M::QueueUnbind(_) => (50, 50, "queue.unbind", 0, false),
        M::QueueUnbindOk(_) => (50, 51, "queue.unbind-ok", 0, false),
        M::BasicQos(_) => (60, 10, "basic.qos", 1, false),
        M::BasicQosOk(_) => (60, 11, "basic.qos-ok", 0, false),
        M::BasicConsume(_) => (60, 20, "basic.consume", 4, false),
        M::BasicConsumeOk(_) => (60, 21, "basic.consume-ok", 0, false),
        M::BasicCancel(_) => (60, 30, "basic.cancel", 1, false),
        M::BasicCancelOk(_) => (60, 31, "basic.cancel-ok", 0, false),
        M::BasicPublish(_) => (60, 40, "basic.publish", 2, true),
        M::BasicReturn(_) => (60, 50, "basic.return", 0, true),
        M::BasicDeliver(_) => (60, 60, "basic.deliver", 1, true),
        M::BasicGet(_) => (60, 70, "basic.get", 1, false),
        M::BasicGetOk(_) => (60, 71, "basic.get-ok", 1, true),
        M::BasicGetEmpty(_) => (60, 72, "basic.get-empty", 0, false),
        M::BasicAck(_) => (60, 80, "basic.ack", 1, false),
        M::BasicReject(_) => (60, 90, "basic.reject", 1, false),
        M::BasicRecoverAsync(_) => (60, 100, "basic.recover-async", 1, false),
        M::BasicRecover(_) => (60, 110, "basic.recover", 1, false),
        M::BasicRecoverOk(_) => (60, 111, "basic.recover-ok", 0, false),
        M::BasicNack(_) => (60, 120, "basic.nack", 2, false),
        M::ConfirmSelect(_) => (85, 10, "confirm.select", 1, false),
        M::ConfirmSelectOk(_) => (85, 11, "confirm.select-ok", 0, false),
        M::TxSelect(_) => (90, 10, "tx.select", 0, false),
        M::TxSelectOk(_) => (90, 11, "tx.select-ok", 0, false),
        M::TxCommit(_) => (90, 20, "tx.commit", 0, false),
        M::TxCommitOk(_) => (90, 21, "tx.commit-ok", 0, false),
        M::TxRollback(_) => (90, 30, "tx.rollback", 0, false),
        M::TxRollbackOk(_) => (90, 31, "tx.rollback-ok", 0, false),
    };
    Spec { class_id, method_id, name, bits, content }
}

/// `m` with its `bit` arguments set from `mask` (bit i = i-th bit argument in spec order), and
/// how many bit arguments it has. Methods without bits fall through the wildcard; the count is
/// checked against `spec(m).bits`, so a missed method shows up as a wrong count.
pub fn with_bits(m: &Method, mask: u32) -> (Method, usize) {
    use Method as M;
    let bit = |i: u32| (mask >> i) & 1 == 1;
    let mut m = m.clone();
    let n = match &mut m {
        M::ConnectionOpen(x) => {
            x.reserved_2 = bit(0);
            1
        }
        M::ChannelFlow(x) => {
            x.active = bit(0);
            1
        }
        M::ChannelFlowOk(x) => {
            x.active = bit(0);
            1
        }
        M::AccessRequest(x) => {
            (x.exclusive, x.passive, x.active, x.write, x.read) = (bit(0), bit(1), bit(2), bit(3), bit(4));
            5
        }
        M::ExchangeDeclare(x) => {
            (x.passive, x.durable, x.auto_delete, x.internal, x.nowait) = (bit(0), bit(1), bit(2), bit(3), bit(4));
            5
        }
        M::ExchangeDelete(x) => {
            (x.if_unused, x.nowait) = (bit(0), bit(1));
            2
        }
        M::ExchangeBind(x) => {
            x.nowait = bit(0);
            1
        }
        M::ExchangeUnbind(x) => {
            x.nowait = bit(0);
            1
        }
        M::QueueDeclare(x) => {
            (x.passive, x.durable, x.exclusive, x.auto_delete, x.nowait) = (bit(0), bit(1), bit(2), bit(3), bit(4));
            5
        }
        M::QueueBind(x) => {
            x.nowait = bit(0);
            1
        }
        M::QueuePurge(x) => {
            x.nowait = bit(0);
            1
        }
        M::QueueDelete(x) => {
            (x.if_unused, x.if_empty, x.nowait) = (bit(0), bit(1), bit(2));
            3
        }
        M::BasicQos(x) => {
            x.global = bit(0);
            1
        }
        M::BasicConsume(x) => {
            (x.no_local, x.no_ack, x.exclusive, x.nowait) = (bit(0), bit(1), bit(2), bit(3));
            4
        }
        M::BasicCancel(x) => {
            x.nowait = bit(0);
            1
        }
        M::BasicPublish(x) => {
            (x.mandatory, x.immediate) = (bit(0), bit(1));
            2
        }
        M::BasicDeliver(x) => {
            x.redelivered = bit(0);
            1
        }
        M::BasicGet(x) => {
            x.no_ack = bit(0);
            1
        }
        M::BasicGetOk(x) => {
            x.redelivered = bit(0);
            1
        }
        M::BasicAck(x) => {
            x.multiple = bit(0);
            1
        }
        M::BasicReject(x) => {
            x.requeue = bit(0);
            1
        }
        M::BasicRecoverAsync(x) => {
            x.requeue = bit(0);
            1
        }
        M::BasicRecover(x) => {
            x.requeue = bit(0);
            1
        }
        M::BasicNack(x) => {
            (x.multiple, x.requeue) = (bit(0), bit(1));
            2
        }
        M::ConfirmSelect(x) => {
            x.nowait = bit(0);
            1
        }
        _ => 0,
    };
    (m, n)
}

/// Number of basic properties.
pub const PROPERTY_COUNT: usize = 14;

/// Every basic property set, to non-default values.
pub fn all_properties() -> BasicProperties {
    BasicProperties {
        content_type: Some(s("application/json")),
        content_encoding: Some(s("gzip")),
        headers: Some(every_type_table()),
        delivery_mode: Some(2),
        priority: Some(9),
        correlation_id: Some(s("corr-é")),
        reply_to: Some(s("amq.rabbitmq.reply-to")),
        expiration: Some(s("60000")),
        message_id: Some("m".repeat(255)),
        timestamp: Some(u64::MAX - 1),
        kind: Some(s("order.created")),
        user_id: Some(s("guest")),
        app_id: Some(s("app")),
        cluster_id: Some(s("cluster")),
    }
}

/// The properties of `all` whose spec index (0 = content-type .. 13 = cluster-id) is set in `mask`.
pub fn subset(all: &BasicProperties, mask: u16) -> BasicProperties {
    let all = all.clone();
    let on = |i: u32| (mask >> i) & 1 == 1;
    BasicProperties {
        content_type: all.content_type.filter(|_| on(0)),
        content_encoding: all.content_encoding.filter(|_| on(1)),
        headers: all.headers.filter(|_| on(2)),
        delivery_mode: all.delivery_mode.filter(|_| on(3)),
        priority: all.priority.filter(|_| on(4)),
        correlation_id: all.correlation_id.filter(|_| on(5)),
        reply_to: all.reply_to.filter(|_| on(6)),
        expiration: all.expiration.filter(|_| on(7)),
        message_id: all.message_id.filter(|_| on(8)),
        timestamp: all.timestamp.filter(|_| on(9)),
        kind: all.kind.filter(|_| on(10)),
        user_id: all.user_id.filter(|_| on(11)),
        app_id: all.app_id.filter(|_| on(12)),
        cluster_id: all.cluster_id.filter(|_| on(13)),
    }
}

/// A field table in wire form holding `depth` tables nested inside each other (`letter` = b'F'),
/// or `depth` arrays nested inside each other (`letter` = b'A'). Built front to back in O(depth),
/// so 100,000 levels are cheap.
pub fn nested_wire(letter: u8, depth: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(depth * 7 + 16);
    let put = |out: &mut Vec<u8>, n: usize| out.extend_from_slice(&(n as u32).to_be_bytes());
    if letter == b'F' {
        // Table k levels from the innermost holds 7*k bytes: key "k", 'F', then the next table.
        for k in (1..=depth).rev() {
            put(&mut out, 7 * k);
            out.extend_from_slice(&[1, b'k', b'F']);
        }
        put(&mut out, 0);
    } else {
        // Array value k levels from the innermost (a 'V') takes 1 + 5*k bytes.
        put(&mut out, 2 + 1 + 5 * depth);
        out.extend_from_slice(&[1, b'a']);
        for k in (1..=depth).rev() {
            out.push(b'A');
            put(&mut out, 1 + 5 * (k - 1));
        }
        out.push(b'V');
    }
    out
}

/// Hex of the first 64 bytes, for failure messages.
pub fn hex(bytes: &[u8]) -> String {
    let shown: String = bytes.iter().take(64).map(|b| format!("{b:02x}")).collect();
    if bytes.len() > 64 {
        format!("{shown}… ({} bytes)", bytes.len())
    } else {
        shown
    }
}
