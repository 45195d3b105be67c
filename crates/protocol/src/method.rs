//! Every AMQP 0-9-1 method as RabbitMQ implements it (RabbitMQ's extensions included), each a
//! struct named `ClassMethod` with the spec's field names, and the `Method` enum over them.
//! One table line per method defines its struct, ids, name and codec.

use crate::codec::{Reader, Writer};
use crate::error::FrameError;
use crate::field::FieldTable;
use bytes::{BufMut, Bytes, BytesMut};

macro_rules! field_type {
    (octet) => { u8 };
    (short) => { u16 };
    (long) => { u32 };
    (longlong) => { u64 };
    (bit) => { bool };
    (shortstr) => { String };
    (longstr) => { Bytes };
    (table) => { FieldTable };
    (timestamp) => { u64 };
}

macro_rules! read_field {
    ($r:ident, octet) => { $r.u8()? };
    ($r:ident, short) => { $r.u16()? };
    ($r:ident, long) => { $r.u32()? };
    ($r:ident, longlong) => { $r.u64()? };
    ($r:ident, bit) => { $r.bit()? };
    ($r:ident, shortstr) => { $r.short_str()? };
    ($r:ident, longstr) => { $r.long_str()? };
    ($r:ident, table) => { $r.table()? };
    ($r:ident, timestamp) => { $r.u64()? };
}

macro_rules! write_field {
    ($w:ident, $v:expr, octet) => { $w.u8($v) };
    ($w:ident, $v:expr, short) => { $w.u16($v) };
    ($w:ident, $v:expr, long) => { $w.u32($v) };
    ($w:ident, $v:expr, longlong) => { $w.u64($v) };
    ($w:ident, $v:expr, bit) => { $w.bit($v) };
    ($w:ident, $v:expr, shortstr) => { $w.short_str(&$v) };
    ($w:ident, $v:expr, longstr) => { $w.long_str(&$v) };
    ($w:ident, $v:expr, table) => { $w.table(&$v) };
    ($w:ident, $v:expr, timestamp) => { $w.u64($v) };
}

macro_rules! methods {
    ($( $name:ident ($class:literal, $method:literal, $text:literal, $content:literal) { $($field:ident : $kind:ident),* } )*) => {
        $(
            #[derive(Debug, Clone, PartialEq, Default)]
            pub struct $name { $(pub $field: field_type!($kind)),* }
        )*

        #[derive(Debug, Clone, PartialEq)]
        pub enum Method { $($name($name)),* }

        impl Method {
            pub fn class_id(&self) -> u16 {
                match self { $(Method::$name(_) => $class),* }
            }
            pub fn method_id(&self) -> u16 {
                match self { $(Method::$name(_) => $method),* }
            }
            /// The spec's name, e.g. `basic.publish`.
            pub fn name(&self) -> &'static str {
                match self { $(Method::$name(_) => $text),* }
            }
            /// Whether content (header and body frames) follows this method.
            pub fn has_content(&self) -> bool {
                match self { $(Method::$name(_) => $content),* }
            }

            /// Decodes a method frame's payload: class id, method id, arguments.
            /// Trailing bytes after the arguments are tolerated, as RabbitMQ does.
            pub fn decode(payload: &[u8]) -> Result<Method, FrameError> {
                let mut r = Reader::new(payload);
                let class_id = r.u16()?;
                let method_id = r.u16()?;
                #[allow(unused_mut, unused_variables)]
                let wrap = |e: FrameError, name: &'static str| FrameError::InMethod { name, class_id, method_id, source: Box::new(e) };
                match (class_id, method_id) {
                    $(
                        ($class, $method) => {
                            #[allow(unused_mut, unused_variables)]
                            let mut decode = |r: &mut Reader| -> Result<Method, FrameError> {
                                Ok(Method::$name($name { $($field: read_field!(r, $kind)),* }))
                            };
                            decode(&mut r).map_err(|e| wrap(e, $text))
                        }
                    )*
                    _ => Err(FrameError::UnknownMethod { class_id, method_id }),
                }
            }

            /// Encodes class id, method id and arguments (no frame envelope).
            pub fn encode(&self, out: &mut BytesMut) {
                out.put_u16(self.class_id());
                out.put_u16(self.method_id());
                #[allow(unused_mut, unused_variables)]
                let mut w = Writer::new(out);
                match self {
                    $(
                        #[allow(unused_variables)]
                        Method::$name(m) => { $(write_field!(w, m.$field.clone(), $kind);)* }
                    )*
                }
                w.flush_bits();
            }
        }
    };
}

methods! {
    ConnectionStart(10, 10, "connection.start", false) { version_major: octet, version_minor: octet, server_properties: table, mechanisms: longstr, locales: longstr }
    ConnectionStartOk(10, 11, "connection.start-ok", false) { client_properties: table, mechanism: shortstr, response: longstr, locale: shortstr }
    ConnectionSecure(10, 20, "connection.secure", false) { challenge: longstr }
    ConnectionSecureOk(10, 21, "connection.secure-ok", false) { response: longstr }
    ConnectionTune(10, 30, "connection.tune", false) { channel_max: short, frame_max: long, heartbeat: short }
    ConnectionTuneOk(10, 31, "connection.tune-ok", false) { channel_max: short, frame_max: long, heartbeat: short }
    ConnectionOpen(10, 40, "connection.open", false) { virtual_host: shortstr, reserved_1: shortstr, reserved_2: bit }
    ConnectionOpenOk(10, 41, "connection.open-ok", false) { reserved_1: shortstr }
    ConnectionClose(10, 50, "connection.close", false) { reply_code: short, reply_text: shortstr, class_id: short, method_id: short }
    ConnectionCloseOk(10, 51, "connection.close-ok", false) {}
    ConnectionBlocked(10, 60, "connection.blocked", false) { reason: shortstr }
    ConnectionUnblocked(10, 61, "connection.unblocked", false) {}
    ConnectionUpdateSecret(10, 70, "connection.update-secret", false) { new_secret: longstr, reason: shortstr }
    ConnectionUpdateSecretOk(10, 71, "connection.update-secret-ok", false) {}

    ChannelOpen(20, 10, "channel.open", false) { reserved_1: shortstr }
    ChannelOpenOk(20, 11, "channel.open-ok", false) { reserved_1: longstr }
    ChannelFlow(20, 20, "channel.flow", false) { active: bit }
    ChannelFlowOk(20, 21, "channel.flow-ok", false) { active: bit }
    ChannelClose(20, 40, "channel.close", false) { reply_code: short, reply_text: shortstr, class_id: short, method_id: short }
    ChannelCloseOk(20, 41, "channel.close-ok", false) {}

    AccessRequest(30, 10, "access.request", false) { realm: shortstr, exclusive: bit, passive: bit, active: bit, write: bit, read: bit }
    AccessRequestOk(30, 11, "access.request-ok", false) { reserved_1: short }

    ExchangeDeclare(40, 10, "exchange.declare", false) { reserved_1: short, exchange: shortstr, kind: shortstr, passive: bit, durable: bit, auto_delete: bit, internal: bit, nowait: bit, arguments: table }
    ExchangeDeclareOk(40, 11, "exchange.declare-ok", false) {}
    ExchangeDelete(40, 20, "exchange.delete", false) { reserved_1: short, exchange: shortstr, if_unused: bit, nowait: bit }
    ExchangeDeleteOk(40, 21, "exchange.delete-ok", false) {}
    ExchangeBind(40, 30, "exchange.bind", false) { reserved_1: short, destination: shortstr, source: shortstr, routing_key: shortstr, nowait: bit, arguments: table }
    ExchangeBindOk(40, 31, "exchange.bind-ok", false) {}
    ExchangeUnbind(40, 40, "exchange.unbind", false) { reserved_1: short, destination: shortstr, source: shortstr, routing_key: shortstr, nowait: bit, arguments: table }
    ExchangeUnbindOk(40, 51, "exchange.unbind-ok", false) {}

    QueueDeclare(50, 10, "queue.declare", false) { reserved_1: short, queue: shortstr, passive: bit, durable: bit, exclusive: bit, auto_delete: bit, nowait: bit, arguments: table }
    QueueDeclareOk(50, 11, "queue.declare-ok", false) { queue: shortstr, message_count: long, consumer_count: long }
    QueueBind(50, 20, "queue.bind", false) { reserved_1: short, queue: shortstr, exchange: shortstr, routing_key: shortstr, nowait: bit, arguments: table }
    QueueBindOk(50, 21, "queue.bind-ok", false) {}
    QueuePurge(50, 30, "queue.purge", false) { reserved_1: short, queue: shortstr, nowait: bit }
    QueuePurgeOk(50, 31, "queue.purge-ok", false) { message_count: long }
    QueueDelete(50, 40, "queue.delete", false) { reserved_1: short, queue: shortstr, if_unused: bit, if_empty: bit, nowait: bit }
    QueueDeleteOk(50, 41, "queue.delete-ok", false) { message_count: long }
    QueueUnbind(50, 50, "queue.unbind", false) { reserved_1: short, queue: shortstr, exchange: shortstr, routing_key: shortstr, arguments: table }
    QueueUnbindOk(50, 51, "queue.unbind-ok", false) {}

    BasicQos(60, 10, "basic.qos", false) { prefetch_size: long, prefetch_count: short, global: bit }
    BasicQosOk(60, 11, "basic.qos-ok", false) {}
    BasicConsume(60, 20, "basic.consume", false) { reserved_1: short, queue: shortstr, consumer_tag: shortstr, no_local: bit, no_ack: bit, exclusive: bit, nowait: bit, arguments: table }
    BasicConsumeOk(60, 21, "basic.consume-ok", false) { consumer_tag: shortstr }
    BasicCancel(60, 30, "basic.cancel", false) { consumer_tag: shortstr, nowait: bit }
    BasicCancelOk(60, 31, "basic.cancel-ok", false) { consumer_tag: shortstr }
    BasicPublish(60, 40, "basic.publish", true) { reserved_1: short, exchange: shortstr, routing_key: shortstr, mandatory: bit, immediate: bit }
    BasicReturn(60, 50, "basic.return", true) { reply_code: short, reply_text: shortstr, exchange: shortstr, routing_key: shortstr }
    BasicDeliver(60, 60, "basic.deliver", true) { consumer_tag: shortstr, delivery_tag: longlong, redelivered: bit, exchange: shortstr, routing_key: shortstr }
    BasicGet(60, 70, "basic.get", false) { reserved_1: short, queue: shortstr, no_ack: bit }
    BasicGetOk(60, 71, "basic.get-ok", true) { delivery_tag: longlong, redelivered: bit, exchange: shortstr, routing_key: shortstr, message_count: long }
    BasicGetEmpty(60, 72, "basic.get-empty", false) { reserved_1: shortstr }
    BasicAck(60, 80, "basic.ack", false) { delivery_tag: longlong, multiple: bit }
    BasicReject(60, 90, "basic.reject", false) { delivery_tag: longlong, requeue: bit }
    BasicRecoverAsync(60, 100, "basic.recover-async", false) { requeue: bit }
    BasicRecover(60, 110, "basic.recover", false) { requeue: bit }
    BasicRecoverOk(60, 111, "basic.recover-ok", false) {}
    BasicNack(60, 120, "basic.nack", false) { delivery_tag: longlong, multiple: bit, requeue: bit }

    ConfirmSelect(85, 10, "confirm.select", false) { nowait: bit }
    ConfirmSelectOk(85, 11, "confirm.select-ok", false) {}

    TxSelect(90, 10, "tx.select", false) {}
    TxSelectOk(90, 11, "tx.select-ok", false) {}
    TxCommit(90, 20, "tx.commit", false) {}
    TxCommitOk(90, 21, "tx.commit-ok", false) {}
    TxRollback(90, 30, "tx.rollback", false) {}
    TxRollbackOk(90, 31, "tx.rollback-ok", false) {}
}
