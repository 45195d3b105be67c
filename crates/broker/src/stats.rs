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

/// One queue's message counters, and the rates last sampled from them: what the management API
/// shows as a queue's `message_stats`. Publishes and deliveries come from different threads, so
/// each side has its own cache line.
pub struct QueueStats {
    published: Line<AtomicU64>,
    /// Delivered (to consumers and basic.get), redelivered, acknowledged.
    consumed: Line<[AtomicU64; 3]>,
    sampled: parking_lot::Mutex<Sampled>,
}

#[derive(Default)]
#[repr(align(128))]
struct Line<T>(T);

struct Sampled {
    at: std::time::Instant,
    totals: QueueCounts,
    rates: QueueRates,
}

/// Counting from zero at the queue's creation: its first sample's rates cover what came before it.
impl Default for QueueStats {
    fn default() -> QueueStats {
        let sampled = Sampled { at: std::time::Instant::now(), totals: QueueCounts::default(), rates: QueueRates::default() };
        QueueStats { published: Default::default(), consumed: Default::default(), sampled: parking_lot::Mutex::new(sampled) }
    }
}

/// A queue's counters since the node started.
#[derive(Default, Debug, Clone, Copy, PartialEq)]
pub struct QueueCounts {
    pub published: u64,
    pub delivered: u64,
    pub redelivered: u64,
    pub acked: u64,
}

/// Per second, between the last two samples.
#[derive(Default, Debug, Clone, Copy, PartialEq)]
pub struct QueueRates {
    pub published: f64,
    pub delivered: f64,
    pub redelivered: f64,
    pub acked: f64,
}

impl QueueStats {
    pub fn published(&self) {
        self.published.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn delivered(&self, redelivered: bool) {
        self.consumed.0[0].fetch_add(1, Ordering::Relaxed);
        if redelivered {
            self.consumed.0[1].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn acked(&self) {
        self.consumed.0[2].fetch_add(1, Ordering::Relaxed);
    }

    pub fn counts(&self) -> QueueCounts {
        let [delivered, redelivered, acked] = &self.consumed.0;
        QueueCounts {
            published: self.published.0.load(Ordering::Relaxed),
            delivered: delivered.load(Ordering::Relaxed),
            redelivered: redelivered.load(Ordering::Relaxed),
            acked: acked.load(Ordering::Relaxed),
        }
    }

    /// Takes a sample at `now`: the rates become the change since the previous sample.
    pub fn sample(&self, now: std::time::Instant) {
        let counts = self.counts();
        let mut s = self.sampled.lock();
        let secs = now.saturating_duration_since(s.at).as_secs_f64();
        if secs > 0.0 {
            let per_sec = |new: u64, old: u64| new.saturating_sub(old) as f64 / secs;
            s.rates = QueueRates {
                published: per_sec(counts.published, s.totals.published),
                delivered: per_sec(counts.delivered, s.totals.delivered),
                redelivered: per_sec(counts.redelivered, s.totals.redelivered),
                acked: per_sec(counts.acked, s.totals.acked),
            };
            s.at = now;
            s.totals = counts;
        }
    }

    /// The rates between the last two samples (zero before the second).
    pub fn rates(&self) -> QueueRates {
        self.sampled.lock().rates
    }
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

    #[test]
    fn a_queue_s_rates_are_the_change_between_samples() {
        let stats = QueueStats::default();
        let t0 = stats.sampled.lock().at;
        (0..10).for_each(|_| stats.published());
        (0..4).for_each(|i| stats.delivered(i == 0));
        (0..2).for_each(|_| stats.acked());
        assert_eq!(stats.rates(), QueueRates::default(), "no rate before the first sample");
        // The first sample counts from the queue's creation.
        stats.sample(t0 + std::time::Duration::from_secs(2));
        assert_eq!(stats.rates(), QueueRates { published: 5.0, delivered: 2.0, redelivered: 0.5, acked: 1.0 });
        assert_eq!(stats.counts(), QueueCounts { published: 10, delivered: 4, redelivered: 1, acked: 2 });
        stats.sample(t0 + std::time::Duration::from_secs(4));
        assert_eq!(stats.rates(), QueueRates::default(), "nothing happened in the last interval");
    }
}
