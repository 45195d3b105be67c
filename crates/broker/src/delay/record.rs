//! A delayed message as the delay store holds it, and the `x-delay` header.
//!
//! Record layout (the payload of a store record in a slot queue, version 1):
//! `version u8 | due_ms u64 | run u64 | vhost len u16 | vhost | queue count u16 | queue ids u64 … |
//!  message` where `message` is the message's store encoding (`crate::message::encode_stored`).
//! `run` is the publishing process's `crate::run_id`: a transient queue's id is only meaningful
//! within its run (transient ids start again at every start), so a record names one only then.

use crate::message::{decode_stored, Message};
use bytes::{BufMut, Bytes, BytesMut};
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::properties::{BasicProperties, PropertiesView};

const RECORD_VERSION: u8 = 1;

/// The longest delay held: a year. The rabbitmq-delayed-message-exchange plugin stops at 2^32 - 1
/// ms (49.7 days); a longer `x-delay` is refused rather than cut.
pub const MAX_DELAY_MS: u64 = 366 * 24 * 3600 * 1000;

/// The header a publisher sets on a message to a delayed exchange.
pub const DELAY_HEADER: &str = "x-delay";

/// A record's fields, borrowed from its payload but for the message.
#[derive(Debug)]
pub struct DelayedRecord {
    pub due_ms: u64,
    pub run: u64,
    pub vhost: String,
    pub queues: Vec<u64>,
    /// The message's store encoding.
    pub message: Bytes,
}

pub fn encode(due_ms: u64, vhost: &str, queues: &[u64], message: &Message) -> Bytes {
    encode_stored(due_ms, crate::run_id(), vhost, queues, &crate::message::encode_stored(message, None))
}

/// A record of a message already in its store encoding (`stored`), published in run `run`.
pub fn encode_stored(due_ms: u64, run: u64, vhost: &str, queues: &[u64], stored: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(21 + vhost.len() + queues.len() * 8 + stored.len());
    out.put_u8(RECORD_VERSION);
    out.put_u64(due_ms);
    out.put_u64(run);
    // A vhost name is a short string of the protocol (≤ 255 bytes); queue counts are bounded by the
    // caller (`Delays::hold`).
    out.put_u16(vhost.len() as u16);
    out.put_slice(vhost.as_bytes());
    out.put_u16(queues.len() as u16);
    for id in queues {
        out.put_u64(*id);
    }
    out.put_slice(stored);
    out.freeze()
}

/// Decodes a record; `None` if it is malformed or of an unknown version (the store's checksums
/// guard against torn writes: only a format bug gets here).
pub fn decode(payload: &Bytes) -> Option<DelayedRecord> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<std::ops::Range<usize>> {
        let r = at..at.checked_add(n).filter(|end| *end <= payload.len())?;
        at = r.end;
        Some(r)
    };
    if payload.get(take(1)?.start) != Some(&RECORD_VERSION) {
        return None;
    }
    let due_ms = u64::from_be_bytes(payload[take(8)?].try_into().ok()?);
    let run = u64::from_be_bytes(payload[take(8)?].try_into().ok()?);
    let vlen = u16::from_be_bytes(payload[take(2)?].try_into().ok()?) as usize;
    let vhost = String::from_utf8(payload[take(vlen)?].to_vec()).ok()?;
    let count = u16::from_be_bytes(payload[take(2)?].try_into().ok()?) as usize;
    let mut queues = Vec::with_capacity(count);
    for _ in 0..count {
        queues.push(u64::from_be_bytes(payload[take(8)?].try_into().ok()?));
    }
    let message = payload.slice(take(0)?.start..);
    Some(DelayedRecord { due_ms, run, vhost, queues, message })
}

/// The delay a message asks for with `x-delay`, in milliseconds, as the plugin reads it: any
/// integer type, or a string holding one; absent, zero, negative or anything else: no delay
/// (routed at once). A message the delayed exchange already delayed carries the negated value, so
/// re-publishing it (a dead letter, a shovel) does not delay it again.
pub fn requested_delay(message: &Message) -> Option<i64> {
    let view = PropertiesView::new(&message.properties).ok()?;
    let headers = view.headers()?.ok()?;
    let delay = match headers.get(DELAY_HEADER)? {
        FieldValue::LongString(s) => std::str::from_utf8(s).ok()?.trim().parse::<i64>().ok()?,
        other => other.as_i64()?,
    };
    (delay > 0).then_some(delay)
}

/// The message as its queues get it once due: `x-delay` negated, as the plugin delivers it
/// (consumers tell a delayed message by a negative `x-delay`). `None` if it does not decode.
pub fn due_message(stored: &Bytes) -> Option<Message> {
    let mut message = decode_stored(stored)?.message;
    negate_delay(&mut message);
    Some(message)
}

/// Negates a positive `x-delay` header (how the message reads once due: `due_message`).
pub fn negate_delay(message: &mut Message) {
    let Ok(mut props) = BasicProperties::decode(&message.properties) else { return };
    let mut headers: FieldTable = props.headers.take().unwrap_or_default();
    if let Some(delay) = requested_delay(message) {
        let negated = i32::try_from(-delay).map(FieldValue::I32).unwrap_or(FieldValue::I64(-delay));
        headers.insert(DELAY_HEADER.to_string(), negated);
        props.headers = Some(headers);
        let mut raw = BytesMut::new();
        props.encode(&mut raw);
        message.properties = raw.freeze();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(delay: Option<FieldValue>) -> Message {
        let mut props = BasicProperties::default();
        if let Some(d) = delay {
            let mut h = FieldTable::new();
            h.insert(DELAY_HEADER.to_string(), d);
            props.headers = Some(h);
        }
        let mut raw = BytesMut::new();
        props.encode(&mut raw);
        Message { exchange: "d".into(), routing_key: "k".into(), properties: raw.freeze(), body: Bytes::from_static(b"hello"), persistent: true, expiration_ms: None }
    }

    #[test]
    fn x_delay_is_read_as_the_plugin_reads_it() {
        assert_eq!(requested_delay(&message(Some(FieldValue::I32(1500)))), Some(1500));
        assert_eq!(requested_delay(&message(Some(FieldValue::U64(7)))), Some(7));
        assert_eq!(requested_delay(&message(Some(FieldValue::LongString(Bytes::from_static(b"2500"))))), Some(2500));
        assert_eq!(requested_delay(&message(Some(FieldValue::I32(0)))), None);
        assert_eq!(requested_delay(&message(Some(FieldValue::I64(-5)))), None);
        assert_eq!(requested_delay(&message(Some(FieldValue::LongString(Bytes::from_static(b"soon"))))), None);
        assert_eq!(requested_delay(&message(Some(FieldValue::F64(10.0)))), None);
        assert_eq!(requested_delay(&message(None)), None);
    }

    #[test]
    fn a_record_round_trips_and_the_due_message_carries_the_negated_delay() {
        let m = message(Some(FieldValue::I32(1500)));
        let payload = encode(123_456, "/v", &[7, 1 << 63], &m);
        let rec = decode(&payload).expect("decodes");
        assert_eq!((rec.due_ms, rec.run, rec.vhost.as_str(), rec.queues.as_slice()), (123_456, crate::run_id(), "/v", &[7, 1 << 63][..]));
        let due = due_message(&rec.message).expect("message decodes");
        assert_eq!(due.body, m.body);
        assert_eq!(requested_delay(&due), None, "not delayed again");
        let again = encode_stored(99, 5, &rec.vhost, &[7], &rec.message);
        assert_eq!(decode(&again).map(|r| (r.due_ms, r.run, r.queues, r.message)), Some((99, 5, vec![7], rec.message.clone())));
        let headers = PropertiesView::new(&due.properties).unwrap().headers().unwrap().unwrap();
        assert_eq!(headers.get(DELAY_HEADER).and_then(FieldValue::as_i64), Some(-1500));
        for cut in 0..payload.len() {
            let _ = decode(&payload.slice(..cut)); // never panics
        }
        assert!(decode(&payload.slice(..20)).is_none());
    }
}
