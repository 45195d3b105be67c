//! Dead-lettering: the message a DLX receives, with the `x-death` header as RabbitMQ 3.x writes it.

use crate::message::{Message, MessageRef};
use bytes::{Bytes, BytesMut};
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::properties::BasicProperties;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeathReason {
    Rejected,
    Expired,
    MaxLen,
}

impl DeathReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Rejected => "rejected",
            DeathReason::Expired => "expired",
            DeathReason::MaxLen => "maxlen",
        }
    }
}

/// A message leaving `queue` for its dead-letter exchange.
#[derive(Debug)]
pub struct DeadLetter {
    pub message: MessageRef,
    pub reason: DeathReason,
    pub queue: String,
    /// The queue's `x-dead-letter-exchange`.
    pub exchange: String,
    /// The queue's `x-dead-letter-routing-key`, if set; otherwise the original routing key is kept.
    pub routing_key: Option<String>,
}

fn long_string(s: &str) -> FieldValue {
    FieldValue::LongString(Bytes::copy_from_slice(s.as_bytes()))
}

/// Builds the dead-lettered copy: `x-death` updated (an entry per queue and reason, most recent
/// first, `count` incremented on repeat), `x-first-death-*` set once, and the `expiration`
/// property removed (kept as `original-expiration`) so the message does not expire again.
pub fn dead_lettered_message(letter: &DeadLetter, now_secs: u64) -> Option<Message> {
    let original = &letter.message;
    let mut props = match BasicProperties::decode(&original.properties) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(queue = %letter.queue, error = %e, "dropping dead letter with unreadable properties");
            return None;
        }
    };
    let mut headers = props.headers.take().unwrap_or_default();
    let mut deaths: Vec<FieldValue> = match headers.remove("x-death") {
        Some(FieldValue::Array(items)) => items,
        _ => Vec::new(),
    };
    let reason = letter.reason.as_str();
    let same = |t: &FieldTable| {
        t.get("queue").and_then(FieldValue::as_str) == Some(letter.queue.as_str())
            && t.get("reason").and_then(FieldValue::as_str) == Some(reason)
    };
    let existing = deaths.iter().position(|d| matches!(d, FieldValue::Table(t) if same(t)));
    let entry = match existing {
        Some(i) => {
            let mut item = deaths.remove(i);
            if let FieldValue::Table(t) = &mut item {
                let count = t.get("count").and_then(FieldValue::as_i64).unwrap_or(0);
                t.insert("count".to_string(), FieldValue::I64(count + 1));
            }
            item
        }
        None => {
            let mut t = FieldTable::new();
            t.insert("count".to_string(), FieldValue::I64(1));
            t.insert("reason".to_string(), long_string(reason));
            t.insert("queue".to_string(), long_string(&letter.queue));
            t.insert("time".to_string(), FieldValue::Timestamp(now_secs));
            t.insert("exchange".to_string(), long_string(&original.exchange));
            t.insert(
                "routing-keys".to_string(),
                FieldValue::Array(vec![long_string(&original.routing_key)]),
            );
            if let Some(exp) = &props.expiration {
                t.insert("original-expiration".to_string(), long_string(exp));
            }
            FieldValue::Table(t)
        }
    };
    deaths.insert(0, entry);
    headers.insert("x-death".to_string(), FieldValue::Array(deaths));
    for (key, value) in [
        ("x-first-death-reason", reason),
        ("x-first-death-queue", letter.queue.as_str()),
        ("x-first-death-exchange", original.exchange.as_str()),
    ] {
        if headers.get(key).is_none() {
            headers.insert(key.to_string(), long_string(value));
        }
    }
    props.expiration = None;
    props.headers = Some(headers);
    let mut raw = BytesMut::new();
    props.encode(&mut raw);
    Some(Message {
        exchange: letter.exchange.clone(),
        routing_key: letter.routing_key.clone().unwrap_or_else(|| original.routing_key.clone()),
        properties: raw.freeze(),
        body: original.body.clone(),
        persistent: original.persistent,
        expiration_ms: None,
    })
}

/// RabbitMQ's cycle rule: a dead letter is not delivered back to a queue it already died in,
/// unless one of its deaths was a rejection (a client decision, so not an automatic loop).
pub fn is_cycle(message: &Message, target_queue: &str) -> bool {
    let Ok(view) = warren_protocol::properties::PropertiesView::new(&message.properties) else {
        return false;
    };
    let Some(Ok(headers)) = view.headers() else { return false };
    let Some(FieldValue::Array(deaths)) = headers.get("x-death") else { return false };
    let mut seen_target = false;
    for d in deaths {
        if let FieldValue::Table(t) = d {
            if t.get("reason").and_then(FieldValue::as_str) == Some("rejected") {
                return false;
            }
            if t.get("queue").and_then(FieldValue::as_str) == Some(target_queue) {
                seen_target = true;
            }
        }
    }
    seen_target
}
