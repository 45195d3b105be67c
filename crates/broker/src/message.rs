//! A published message as the broker holds it, and its on-disk encoding.
//!
//! The content header's properties are kept as the raw bytes the publisher sent: they are
//! delivered unchanged (exact round-trip of all 14 properties, no re-encoding on the hot
//! path) and only parsed where a feature needs them (TTL, headers exchange, dead-lettering).

use bytes::{BufMut, Bytes, BytesMut};
use std::ops::Range;
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

/// Layout of a message in the store, version 2 (written):
/// `version u8 | expires_at_ms u64 (0 = none) | exchange len u32 | exchange | routing key len u32 |
///  routing key | properties len u32 | properties | body`.
/// The header part is built by `encode_header`; the body is handed to the store as a separate
/// part so it is copied once, into the log's write buffer.
///
/// Version 1 (still read) had u8 lengths for the exchange and the routing key and cut longer ones
/// at 255 bytes, possibly inside a UTF-8 character: a dead letter's routing key comes from
/// `x-dead-letter-routing-key`, which nothing bounded, and such a message could not be decoded
/// after paging and was dropped. Version 2 stores any length; version 1 names are decoded lossily
/// (a cut character becomes U+FFFD) rather than dropping the message.
pub const STORED_MESSAGE_VERSION: u8 = 2;
const STORED_MESSAGE_VERSION_1: u8 = 1;

pub fn encode_header(msg: &Message, expires_at_ms: Option<u64>, out: &mut BytesMut) {
    out.reserve(21 + msg.exchange.len() + msg.routing_key.len() + msg.properties.len());
    out.put_u8(STORED_MESSAGE_VERSION);
    out.put_u64(expires_at_ms.unwrap_or(0));
    put_string(out, &msg.exchange);
    put_string(out, &msg.routing_key);
    out.put_u32(msg.properties.len() as u32);
    out.put_slice(&msg.properties);
}

/// A message's whole store encoding (header, then body): what [`decode_stored`] reads back, and
/// what nodes hand each other for a classic queue living on one of them.
pub fn encode_stored(msg: &Message, expires_at_ms: Option<u64>) -> Bytes {
    let mut out = BytesMut::with_capacity(64 + msg.body.len());
    encode_header(msg, expires_at_ms, &mut out);
    out.extend_from_slice(&msg.body);
    out.freeze()
}

fn put_string(out: &mut BytesMut, s: &str) {
    // Names are far below 4 GiB: a message is at most `Batch::max_payload()`, and properties are a frame.
    out.put_u32(s.len() as u32);
    out.put_slice(s.as_bytes());
}

/// A message read back from the store, with its absolute expiry (if any).
pub struct StoredMessage {
    pub message: Message,
    pub expires_at_ms: Option<u64>,
}

/// Where the parts of a stored message are in its encoding (see the layout above); the body is
/// everything after the properties.
struct StoredLayout {
    version: u8,
    expires_at_ms: u64,
    exchange: Range<usize>,
    routing_key: Range<usize>,
    properties: Range<usize>,
}

/// Reads a stored message's layout; `None` if it is malformed or of an unknown version.
fn stored_layout(payload: &[u8]) -> Option<StoredLayout> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<Range<usize>> {
        let r = at..at.checked_add(n).filter(|end| *end <= payload.len())?;
        at = r.end;
        Some(r)
    };
    let version = payload[take(1)?.start];
    let expires_at_ms = u64::from_be_bytes(payload[take(8)?].try_into().ok()?);
    let mut names = [0..0, 0..0]; // exchange, routing key
    for name in &mut names {
        let len = match version {
            STORED_MESSAGE_VERSION => u32::from_be_bytes(payload[take(4)?].try_into().ok()?) as usize,
            STORED_MESSAGE_VERSION_1 => payload[take(1)?.start] as usize,
            _ => return None,
        };
        *name = take(len)?;
    }
    let [exchange, routing_key] = names;
    let plen = u32::from_be_bytes(payload[take(4)?].try_into().ok()?) as usize;
    let properties = take(plen)?;
    Some(StoredLayout { version, expires_at_ms, exchange, routing_key, properties })
}

/// Decodes a stored payload (version 2, or version 1 from older releases). Returns `None` for
/// anything malformed: the store's CRC already guards against torn writes, so this only trips on a
/// format bug, and the caller drops the record (and logs it).
pub fn decode_stored(payload: &Bytes) -> Option<StoredMessage> {
    let layout = stored_layout(payload)?;
    let name = |r: Range<usize>| match layout.version {
        STORED_MESSAGE_VERSION => String::from_utf8(payload[r].to_vec()).ok(),
        // A version 1 name cut at 255 bytes may end inside a character.
        _ => Some(String::from_utf8_lossy(&payload[r]).into_owned()),
    };
    let (exchange, routing_key) = (name(layout.exchange.clone())?, name(layout.routing_key.clone())?);
    let properties = payload.slice(layout.properties.clone());
    let view = warren_protocol::properties::PropertiesView::new(&properties).ok()?;
    let persistent = view.delivery_mode() == Some(2);
    let expiration_ms = view.expiration().and_then(parse_expiration);
    let body = payload.slice(layout.properties.end..);
    Some(StoredMessage {
        message: Message { exchange, routing_key, properties, body, persistent, expiration_ms },
        expires_at_ms: if layout.expires_at_ms == 0 { None } else { Some(layout.expires_at_ms) },
    })
}

/// Whether a stored message has a per-message TTL (a valid `expiration` property), read without
/// decoding the rest of it.
pub fn stored_has_expiration(payload: &[u8]) -> bool {
    let Some(layout) = stored_layout(payload) else { return false };
    warren_protocol::properties::PropertiesView::new(&payload[layout.properties])
        .is_ok_and(|v| v.expiration().and_then(parse_expiration).is_some())
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
        assert!(stored_has_expiration(&out_bytes(&msg)), "read without decoding, as decoded");
        assert!(stored_has_expiration(&encode_v1(&msg, 0, 255)), "version 1 too");
        let plain = message("ex", "rk");
        assert!(!stored_has_expiration(&out_bytes(&plain)) && !stored_has_expiration(&encode_v1(&plain, 0, 255)));
        // Cut anywhere: no TTL read (and no panic).
        let whole = out_bytes(&msg);
        for n in 0..whole.len() - msg.body.len() {
            assert!(!stored_has_expiration(&whole[..n]), "{n}");
        }
    }

    fn out_bytes(msg: &Message) -> Bytes {
        let mut out = BytesMut::new();
        encode_header(msg, None, &mut out);
        out.extend_from_slice(&msg.body);
        out.freeze()
    }

    fn message(exchange: &str, routing_key: &str) -> Message {
        let mut props = BytesMut::new();
        warren_protocol::properties::BasicProperties { delivery_mode: Some(2), ..Default::default() }.encode(&mut props);
        Message {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            properties: props.freeze(),
            body: Bytes::from_static(b"body"),
            persistent: true,
            expiration_ms: None,
        }
    }

    #[test]
    fn names_of_any_length_and_any_characters_round_trip() {
        // Version 1 cut these at 255 bytes, the second inside a two-byte character.
        for key in ["k".repeat(70_000), "é".repeat(200), String::new()] {
            let msg = message(&"x".repeat(255), &key);
            let mut out = BytesMut::new();
            encode_header(&msg, None, &mut out);
            out.extend_from_slice(&msg.body);
            let back = decode_stored(&out.freeze()).expect("decodes");
            assert_eq!(back.message.routing_key, key);
            assert_eq!(back.message.exchange, msg.exchange);
            assert_eq!(back.message.body, msg.body);
            assert_eq!(back.expires_at_ms, None);
        }
    }

    /// A record as version 1 wrote it.
    fn encode_v1(msg: &Message, expires_at_ms: u64, cut: usize) -> Bytes {
        let mut out = BytesMut::new();
        out.put_u8(1);
        out.put_u64(expires_at_ms);
        for s in [&msg.exchange, &msg.routing_key] {
            let len = s.len().min(cut);
            out.put_u8(len as u8);
            out.put_slice(&s.as_bytes()[..len]);
        }
        out.put_u32(msg.properties.len() as u32);
        out.put_slice(&msg.properties);
        out.put_slice(&msg.body);
        out.freeze()
    }

    #[test]
    fn version_1_records_still_decode_even_when_cut_inside_a_character() {
        let msg = message("ex", "rk");
        let back = decode_stored(&encode_v1(&msg, 77, 255)).expect("decodes");
        assert_eq!((back.message.exchange.as_str(), back.message.routing_key.as_str()), ("ex", "rk"));
        assert_eq!((back.expires_at_ms, back.message.body.as_ref()), (Some(77), &b"body"[..]));
        assert!(back.message.persistent);
        // 200 two-byte characters cut at 255 bytes: 127 of them and half of one.
        let msg = message("ex", &"é".repeat(200));
        let back = decode_stored(&encode_v1(&msg, 0, 255)).expect("a cut name no longer drops the message");
        assert_eq!(back.message.routing_key, format!("{}\u{FFFD}", "é".repeat(127)));
        assert_eq!(back.message.body, msg.body);
    }

    #[test]
    fn unknown_versions_and_short_records_are_refused() {
        let msg = message("ex", "rk");
        let mut out = BytesMut::new();
        encode_header(&msg, None, &mut out);
        let good = out.freeze();
        let mut bad = good.to_vec();
        bad[0] = 3;
        assert!(decode_stored(&Bytes::from(bad)).is_none());
        // Cut before the end of the properties: never decodes (and never panics).
        for n in 0..good.len() - msg.properties.len() {
            assert!(decode_stored(&good.slice(..n)).is_none(), "{n}");
        }
    }
}
