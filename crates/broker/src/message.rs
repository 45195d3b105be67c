//! A published message as the broker holds it, and its on-disk encoding.
//!
//! The content header's properties are kept as the raw bytes the publisher sent: they are
//! delivered unchanged (exact round-trip of all 14 properties, no re-encoding on the hot
//! path) and only parsed where a feature needs them (TTL, headers exchange, dead-lettering).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::sync::Arc;

/// An immutable message, shared (`Arc`) by every queue it was routed to.
#[derive(Debug)]
pub struct Message {
    pub exchange: String,
    pub routing_key: String,
    /// Raw basic properties (flag words + property list), as received.
    pub properties: Bytes,
    pub body: Bytes,
    /// delivery-mode 2.
    pub persistent: bool,
    /// Per-message TTL from the `expiration` property, in milliseconds.
    pub expiration_ms: Option<u64>,
}

pub type MessageRef = Arc<Message>;

impl Message {
    /// Bytes counted against `x-max-length-bytes`: the body, as RabbitMQ counts.
    pub fn body_len(&self) -> usize {
        self.body.len()
    }

    /// About how much memory the message holds (body, properties, names and bookkeeping): what the
    /// broker's in-memory bounds count, so that large properties with a small body count too.
    pub fn memory_bytes(&self) -> usize {
        self.body.len() + self.properties.len() + self.exchange.len() + self.routing_key.len() + 128
    }
}

/// Layout of a message in the store (version 1):
/// `version u8 | expires_at_ms u64 (0 = none) | exchange len u8 | exchange | routing key len u8 |
///  routing key | properties len u32 | properties | body`.
/// The header part is built by `encode_header`; the body is handed to the store as a separate
/// part so it is copied once, into the log's write buffer.
pub const STORED_MESSAGE_VERSION: u8 = 1;

pub fn encode_header(msg: &Message, expires_at_ms: Option<u64>, out: &mut BytesMut) {
    out.reserve(16 + msg.exchange.len() + msg.routing_key.len() + msg.properties.len());
    out.put_u8(STORED_MESSAGE_VERSION);
    out.put_u64(expires_at_ms.unwrap_or(0));
    put_short(out, &msg.exchange);
    put_short(out, &msg.routing_key);
    out.put_u32(msg.properties.len() as u32);
    out.put_slice(&msg.properties);
}

fn put_short(out: &mut BytesMut, s: &str) {
    // Exchange names and routing keys are AMQP short strings: at most 255 bytes by construction.
    let len = s.len().min(255);
    out.put_u8(len as u8);
    out.put_slice(&s.as_bytes()[..len]);
}

/// A message read back from the store, with its absolute expiry (if any).
pub struct StoredMessage {
    pub message: Message,
    pub expires_at_ms: Option<u64>,
}

/// Decodes a stored payload. Returns `None` for anything malformed: the store's CRC already
/// guards against torn writes, so this only trips on a format bug, and the caller drops the record.
pub fn decode_stored(payload: &Bytes) -> Option<StoredMessage> {
    let mut buf = payload.clone();
    if buf.remaining() < 1 + 8 || buf.get_u8() != STORED_MESSAGE_VERSION {
        return None;
    }
    let expires = buf.get_u64();
    let exchange = get_short(&mut buf)?;
    let routing_key = get_short(&mut buf)?;
    if buf.remaining() < 4 {
        return None;
    }
    let plen = buf.get_u32() as usize;
    if buf.remaining() < plen {
        return None;
    }
    let properties = buf.split_to(plen);
    let view = warren_protocol::properties::PropertiesView::new(&properties).ok()?;
    let persistent = view.delivery_mode() == Some(2);
    let expiration_ms = view.expiration().and_then(parse_expiration);
    Some(StoredMessage {
        message: Message { exchange, routing_key, properties, body: buf, persistent, expiration_ms },
        expires_at_ms: if expires == 0 { None } else { Some(expires) },
    })
}

fn get_short(buf: &mut Bytes) -> Option<String> {
    if buf.remaining() < 1 {
        return None;
    }
    let len = buf.get_u8() as usize;
    if buf.remaining() < len {
        return None;
    }
    String::from_utf8(buf.split_to(len).to_vec()).ok()
}

/// The `expiration` property is a string holding a non-negative integer of milliseconds.
pub fn parse_expiration(s: &str) -> Option<u64> {
    s.parse::<u64>().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_roundtrip() {
        let mut props = BytesMut::new();
        warren_protocol::properties::BasicProperties {
            delivery_mode: Some(2),
            expiration: Some("500".into()),
            ..Default::default()
        }
        .encode(&mut props);
        let msg = Message {
            exchange: "ex".into(),
            routing_key: "rk".into(),
            properties: props.freeze(),
            body: Bytes::from_static(b"hello"),
            persistent: true,
            expiration_ms: Some(500),
        };
        let mut out = BytesMut::new();
        encode_header(&msg, Some(1234), &mut out);
        out.extend_from_slice(&msg.body);
        let back = decode_stored(&out.freeze()).expect("decodes");
        assert_eq!(back.expires_at_ms, Some(1234));
        assert_eq!(back.message.exchange, "ex");
        assert_eq!(back.message.routing_key, "rk");
        assert_eq!(back.message.body, msg.body);
        assert_eq!(back.message.properties, msg.properties);
        assert!(back.message.persistent);
        assert_eq!(back.message.expiration_ms, Some(500));
    }
}
