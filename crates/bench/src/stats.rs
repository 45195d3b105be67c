//! Counters and latency histograms shared by producers, consumers and the progress line. Producers
//! and consumers add to the counters and record latencies once per socket read or write (a batch of
//! messages), not once per message.

use std::sync::atomic::{AtomicU64, Ordering};

use hdrhistogram::Histogram;
use parking_lot::Mutex;

/// The clock of the timestamps in message bodies: CLOCK_MONOTONIC in nanoseconds. It is the same
/// for every process on the machine, so a consume-only run measures how long a backlog published by
/// an earlier run waited (messages stamped on another machine are not measured: see docs/bench.md).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the struct we pass it.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall-clock nanoseconds (CLOCK_REALTIME): the send time in a delayed message's body, because a
/// broker counts delays on the wall clock. `now_ns`'s monotonic clock runs apart from it while the
/// system clock is being adjusted (measured here: a millisecond within minutes), which would show
/// as deliveries before or after their due time that are not.
pub fn wall_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

#[derive(Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub confirmed: AtomicU64,
    pub nacked: AtomicU64,
    pub returned: AtomicU64,
    pub consumed: AtomicU64,
    /// Body bytes consumed (consume-only runs do not know the size the producer used).
    pub consumed_bytes: AtomicU64,
    pub redelivered: AtomicU64,
    /// Delivered before the send time plus `--delay-ms`.
    pub early: AtomicU64,
}

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counts {
    pub sent: u64,
    pub confirmed: u64,
    pub nacked: u64,
    pub returned: u64,
    pub consumed: u64,
    pub consumed_bytes: u64,
    pub redelivered: u64,
    pub early: u64,
}

impl Counters {
    pub fn get(&self) -> Counts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
            sent: l(&self.sent),
            confirmed: l(&self.confirmed),
            nacked: l(&self.nacked),
            returned: l(&self.returned),
            consumed: l(&self.consumed),
            consumed_bytes: l(&self.consumed_bytes),
            redelivered: l(&self.redelivered),
            early: l(&self.early),
        }
    }

    pub fn add(a: &AtomicU64, n: u64) {
        if n > 0 {
            a.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// Highest latency recorded: one hour, in microseconds (larger values are clamped to it).
const MAX_US: u64 = 3_600_000_000;

/// Latencies in microseconds: the whole run, and the current progress interval.
pub struct Latencies {
    pub total: Histogram<u64>,
    pub interval: Histogram<u64>,
}

impl Latencies {
    pub fn new() -> Mutex<Latencies> {
        let h = || Histogram::new_with_bounds(1, MAX_US, 3).expect("1..1h at 3 significant digits is a valid histogram");
        Mutex::new(Latencies { total: h(), interval: h() })
    }

    /// Records a batch of latencies given in nanoseconds.
    pub fn record_ns(&mut self, ns: &[u64]) {
        for &v in ns {
            let us = (v / 1000).clamp(1, MAX_US);
            let _ = self.total.record(us);
            let _ = self.interval.record(us);
        }
    }

    /// p50 and p99 of the interval, which is then reset.
    pub fn take_interval(&mut self) -> Option<(u64, u64)> {
        if self.interval.is_empty() {
            return None;
        }
        let r = (self.interval.value_at_quantile(0.5), self.interval.value_at_quantile(0.99));
        self.interval.reset();
        Some(r)
    }
}

pub struct Stats {
    pub counters: Counters,
    pub confirm: Mutex<Latencies>,
    pub e2e: Mutex<Latencies>,
    /// When (`now_ns`) the last message was consumed or a producer last finished: the end of a run
    /// that completed, more precise than when the coordinator noticed.
    pub last_ns: AtomicU64,
}

impl Stats {
    pub fn new() -> Stats {
        Stats { counters: Counters::default(), confirm: Latencies::new(), e2e: Latencies::new(), last_ns: AtomicU64::new(0) }
    }

    pub fn mark(&self, ns: u64) {
        self.last_ns.fetch_max(ns, Ordering::Relaxed);
    }
}

/// This process's CPU time (user + system), in seconds, from getrusage(RUSAGE_SELF).
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct we pass it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return 0.0;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_clamp_and_interval_resets() {
        let l = Latencies::new();
        let mut l = l.lock();
        l.record_ns(&[0, 1_500, 2_000_000, u64::MAX]);
        assert_eq!(l.total.len(), 4);
        assert_eq!(l.total.min(), 1);
        assert!(l.total.max() >= MAX_US);
        assert!(l.take_interval().is_some());
        assert!(l.take_interval().is_none());
        assert_eq!(l.total.len(), 4);
    }

    #[test]
    fn cpu_time_is_measured() {
        let t0 = cpu_seconds();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(cpu_seconds() >= t0);
    }
}
