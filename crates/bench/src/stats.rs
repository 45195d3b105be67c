//! Counters and latency histograms shared by producers, consumers and the progress line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use hdrhistogram::Histogram;
use parking_lot::Mutex;

/// Process-wide start: body timestamps are nanoseconds since it (producers and consumers share it).
pub fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

#[derive(Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub confirmed: AtomicU64,
    pub nacked: AtomicU64,
    pub returned: AtomicU64,
    pub consumed: AtomicU64,
}

impl Counters {
    pub fn get(&self) -> [u64; 5] {
        [&self.sent, &self.confirmed, &self.nacked, &self.returned, &self.consumed].map(|a| a.load(Ordering::Relaxed))
    }
}

/// Latencies in microseconds: the whole run, and the current progress interval.
pub struct Latencies {
    pub total: Histogram<u64>,
    pub interval: Histogram<u64>,
}

impl Latencies {
    pub fn new() -> Mutex<Latencies> {
        let h = || Histogram::new_with_bounds(1, 600_000_000, 3).unwrap_or_else(|_| Histogram::new(3).expect("3 significant digits is valid"));
        Mutex::new(Latencies { total: h(), interval: h() })
    }

    pub fn record(&mut self, micros: u64) {
        let v = micros.clamp(1, 600_000_000);
        let _ = self.total.record(v);
        let _ = self.interval.record(v);
    }
}

pub struct Stats {
    pub counters: Counters,
    pub confirm: Mutex<Latencies>,
    pub e2e: Mutex<Latencies>,
}

impl Stats {
    pub fn new() -> Stats {
        Stats { counters: Counters::default(), confirm: Latencies::new(), e2e: Latencies::new() }
    }
}

/// This process's CPU time (user + system), in seconds.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass; no other memory is touched.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return 0.0;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}
