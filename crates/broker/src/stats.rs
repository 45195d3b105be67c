//! The node's message counters since it started, as rabbitmq_prometheus exports them
//! (`rabbitmq_global_messages_*_total`) and the management API's rates are computed from.
//!
//! Sharded by thread: each runtime thread adds to its own cache line, and a read sums the
//! shards. One shared atomic per counter cost 11% of a two-producer publish-only run (two cores
//! bouncing one cache line per message; `BENCHMARKS.md`, "After issue 35"), sharded nothing
//! measurable.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// What is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Published messages that reached at least one queue.
    Routed,
    /// Published messages no queue took, dropped (or returned to a mandatory publisher).
    Unroutable,
    /// Deliveries to consumers that ack.
    DeliveredConsumeManualAck,
    /// Deliveries to no-ack consumers.
    DeliveredConsumeAutoAck,
    /// basic.get answers that wait for an ack.
    DeliveredGetManualAck,
    /// basic.get answers settled on delivery.
    DeliveredGetAutoAck,
    /// Deliveries of messages delivered before.
    Redelivered,
    /// Messages acknowledged by consumers.
    Acknowledged,
}

const COUNTERS: usize = 8;
const SHARDS: usize = 16;

/// One thread's counters, on their own cache lines.
#[repr(align(128))]
struct Shard([AtomicU64; COUNTERS]);

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SHARD: Shard = Shard([ZERO; COUNTERS]);
static SHARD_COUNTERS: [Shard; SHARDS] = [EMPTY_SHARD; SHARDS];
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MY_SHARD: usize = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
}

pub fn add(counter: Counter, n: u64) {
    MY_SHARD.with(|shard| SHARD_COUNTERS[*shard].0[counter as usize].fetch_add(n, Ordering::Relaxed));
}

/// A delivery counted as `counter`, and as a redelivery if it is one.
pub fn delivered(counter: Counter, redelivered: bool) {
    add(counter, 1);
    if redelivered {
        add(Counter::Redelivered, 1);
    }
}

/// The counter's total over every thread.
pub fn get(counter: Counter) -> u64 {
    SHARD_COUNTERS.iter().map(|s| s.0[counter as usize].load(Ordering::Relaxed)).sum()
}

/// Messages published, routed or not.
pub fn received() -> u64 {
    get(Counter::Routed) + get(Counter::Unroutable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads_add_up() {
        let before = get(Counter::Redelivered);
        let threads: Vec<_> = (0..20).map(|_| std::thread::spawn(|| (0..1000).for_each(|_| add(Counter::Redelivered, 1)))).collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(get(Counter::Redelivered) - before, 20_000);
    }
}
