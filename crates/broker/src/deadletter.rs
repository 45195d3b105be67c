//! Dead-lettering: the message a DLX receives, with the `x-death` header as RabbitMQ 3.x writes it,
//! RabbitMQ's rule for dead-letter cycles, and the work list that re-publishes dead letters.
//!
//! Re-publishing a dead letter can make more (a queue with TTL 0 expires what it gets at once), so
//! dead letters are never re-published from inside another dead letter's publish: they go to the
//! vhost's [`DeadLetterWork`] and one caller at a time works the list off, in turns of a bounded
//! size (see `VHost::dead_letter`).

use crate::message::{Message, MessageRef};
use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use std::collections::VecDeque;
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::properties::BasicProperties;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeathReason {
    Rejected,
    Expired,
    MaxLen,
    /// A quorum queue's message returned more than `x-delivery-limit` times.
    DeliveryLimit,
}

impl DeathReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Rejected => "rejected",
            DeathReason::Expired => "expired",
            DeathReason::MaxLen => "maxlen",
            DeathReason::DeliveryLimit => "delivery_limit",
        }
    }
}

/// What an at-least-once dead letter's source is told once its re-publish is settled: true when
/// every queue it reached holds it durably (or it was dropped for good on the way: a dead-letter
/// cycle, unreadable properties); false when it must be tried again (no such exchange, no queue
/// reached, a queue refused it or did not confirm).
pub type SettleDeadLetter = Box<dyn FnOnce(bool) + Send>;

/// A message leaving `queue` for its dead-letter exchange.
pub struct DeadLetter {
    pub message: MessageRef,
    pub reason: DeathReason,
    pub queue: String,
    /// The queue's `x-dead-letter-exchange`.
    pub exchange: String,
    /// The queue's `x-dead-letter-routing-key`, if set; otherwise the original routing key is kept.
    pub routing_key: Option<String>,
    /// At-least-once (a quorum queue's `x-dead-letter-strategy`): told when the re-publish is
    /// confirmed (`crate::deadletter_confirms`). None: at-most-once, not confirmed.
    pub settle: Option<SettleDeadLetter>,
}

impl std::fmt::Debug for DeadLetter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetter")
            .field("reason", &self.reason)
            .field("queue", &self.queue)
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .field("at_least_once", &self.settle.is_some())
            .finish()
    }
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

/// RabbitMQ's cycle rule (`rabbit_dead_letter:detect_cycles`): a message dead-lettered
/// automatically (expired, maxlen) is not delivered back to a queue it already died in if every
/// death since then was automatic too: such a loop would go on without anyone acting. A rejection
/// inside the loop (a client's decision, so each lap waits for a client) breaks the cycle; one
/// before it, e.g. where the message entered the loop, does not. Deaths are ordered most recent
/// first; an entry that is not a table was put there by a client, so the loop is not automatic.
pub fn is_cycle(message: &Message, reason: DeathReason, target_queue: &str) -> bool {
    if reason == DeathReason::Rejected {
        return false;
    }
    let Ok(view) = warren_protocol::properties::PropertiesView::new(&message.properties) else {
        return false;
    };
    let Some(Ok(headers)) = view.headers() else { return false };
    let Some(FieldValue::Array(deaths)) = headers.get("x-death") else { return false };
    for d in deaths {
        let FieldValue::Table(t) = d else { return false };
        if t.get("reason").and_then(FieldValue::as_str) == Some("rejected") {
            return false;
        }
        if t.get("queue").and_then(FieldValue::as_str) == Some(target_queue) {
            return true;
        }
    }
    false
}

/// Dead letters waiting to be re-published in one vhost past which the sources that can make many
/// at once hold back: a quorum queue's leader dead-letters no more expired messages until the list
/// is below it (they wait in the queue: see `QuorumMachine::expire_head`). Nothing is dropped for
/// lack of room: a rejection's or a drop-head's dead letters always join the list (their messages
/// are in memory already, and each comes from one client action).
pub const BACKLOG_LIMIT: usize = 65_536;

/// Dead letters waiting to be re-published, and whether a caller is working them off.
#[derive(Default)]
pub struct DeadLetterWork {
    state: Mutex<WorkState>,
}

/// Called once the list is below [`BACKLOG_LIMIT`] again.
pub type WhenRoom = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct WorkState {
    pending: VecDeque<DeadLetter>,
    /// A caller (or a task) is working the list off: others only add to it.
    draining: bool,
    /// Sources that held back for room (`when_room`).
    waiting: Vec<WhenRoom>,
}

impl DeadLetterWork {
    /// Adds letters. Returns true when the caller must now work the list off (nobody else is).
    pub fn push(&self, letters: Vec<DeadLetter>) -> bool {
        let mut st = self.state.lock();
        st.pending.extend(letters);
        if st.draining || st.pending.is_empty() {
            return false;
        }
        st.draining = true;
        true
    }

    /// Whether the list has room for more (fewer than [`BACKLOG_LIMIT`] wait).
    pub fn has_room(&self) -> bool {
        self.state.lock().pending.len() < BACKLOG_LIMIT
    }

    /// Calls `f` once the list has room: now if it has, or when the work takes it below the limit.
    pub fn when_room(&self, f: WhenRoom) {
        let mut st = self.state.lock();
        if st.pending.len() < BACKLOG_LIMIT {
            drop(st);
            f();
        } else {
            st.waiting.push(f);
        }
    }

    /// The next letter for the caller working the list off; `None` once it is empty, and then that
    /// caller is done.
    pub fn next(&self) -> Option<DeadLetter> {
        let (letter, woken) = {
            let mut st = self.state.lock();
            let letter = st.pending.pop_front();
            if letter.is_none() {
                st.draining = false;
            }
            let woken = if st.pending.len() < BACKLOG_LIMIT && !st.waiting.is_empty() { std::mem::take(&mut st.waiting) } else { Vec::new() };
            (letter, woken)
        };
        for f in woken {
            f();
        }
        letter
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(routing_key: &str) -> MessageRef {
        let mut raw = BytesMut::new();
        BasicProperties::default().encode(&mut raw);
        std::sync::Arc::new(Message {
            exchange: String::new(),
            routing_key: routing_key.into(),
            properties: raw.freeze(),
            body: Bytes::from_static(b"x"),
            persistent: false,
            expiration_ms: None,
        })
    }

    /// The message after dying in each (queue, reason) in turn.
    fn after_deaths(deaths: &[(&str, DeathReason)]) -> MessageRef {
        let mut message = plain("rk");
        for &(queue, reason) in deaths {
            let letter = DeadLetter { message, reason, queue: queue.into(), exchange: String::new(), routing_key: None, settle: None };
            message = std::sync::Arc::new(dead_lettered_message(&letter, 0).expect("readable properties"));
        }
        message
    }

    use DeathReason::{Expired, MaxLen, Rejected};

    #[test]
    fn an_automatic_loop_is_a_cycle() {
        let m = after_deaths(&[("a", Expired), ("b", Expired)]);
        assert!(is_cycle(&m, Expired, "a"));
        assert!(is_cycle(&m, Expired, "b"));
        assert!(!is_cycle(&m, Expired, "c"));
        let m = after_deaths(&[("a", MaxLen)]);
        assert!(is_cycle(&m, MaxLen, "a"), "a queue dead-lettering to itself");
    }

    #[test]
    fn a_rejection_before_the_loop_does_not_break_it() {
        // Rejected in c, then round a -> b -> a: RabbitMQ drops it when it would reach a again.
        let m = after_deaths(&[("c", Rejected), ("a", Expired), ("b", Expired)]);
        assert!(is_cycle(&m, Expired, "a"));
        assert!(!is_cycle(&m, Expired, "c"), "c's death was a rejection");
    }

    #[test]
    fn a_rejection_inside_the_loop_breaks_it() {
        let m = after_deaths(&[("a", Rejected), ("b", Expired)]);
        assert!(!is_cycle(&m, Expired, "a"));
        // Second lap: the entries are moved to the front with their counts, the rule still holds.
        let m = after_deaths(&[("a", Rejected), ("b", Expired), ("a", Rejected), ("b", Expired)]);
        assert!(!is_cycle(&m, Expired, "a"));
        // A rejection now never makes a cycle.
        assert!(!is_cycle(&m, Rejected, "b"));
    }
}
