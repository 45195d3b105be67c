//! The node's message counters since it started, as rabbitmq_prometheus exports them
//! (`rabbitmq_global_messages_*_total`) and the management API's rates are computed from.
//!
//! Process-wide relaxed atomics: one add per message on paths that already take a lock per
//! message, so they cost nothing measurable (`BENCHMARKS.md`, "After issue 35").

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub struct MessageCounters {
    /// Messages published (basic.publish, the HTTP APIs), routed or not.
    pub received: AtomicU64,
    /// Published messages that reached at least one queue.
    pub routed: AtomicU64,
    /// Published messages no queue took, dropped (or returned to a mandatory publisher).
    pub unroutable: AtomicU64,
    /// Deliveries to consumers that ack.
    pub delivered_consume_manual_ack: AtomicU64,
    /// Deliveries to no-ack consumers.
    pub delivered_consume_auto_ack: AtomicU64,
    /// basic.get answers that wait for an ack.
    pub delivered_get_manual_ack: AtomicU64,
    /// basic.get answers settled on delivery.
    pub delivered_get_auto_ack: AtomicU64,
    /// Deliveries of messages delivered before.
    pub redelivered: AtomicU64,
    /// Messages acknowledged by consumers.
    pub acknowledged: AtomicU64,
}

pub static COUNTERS: MessageCounters = MessageCounters {
    received: AtomicU64::new(0),
    routed: AtomicU64::new(0),
    unroutable: AtomicU64::new(0),
    delivered_consume_manual_ack: AtomicU64::new(0),
    delivered_consume_auto_ack: AtomicU64::new(0),
    delivered_get_manual_ack: AtomicU64::new(0),
    delivered_get_auto_ack: AtomicU64::new(0),
    redelivered: AtomicU64::new(0),
    acknowledged: AtomicU64::new(0),
};

pub fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

pub fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}
