//! Two defences against clients that try logins or hold connections instead of using them.
//!
//! [`LoginGuard`]: failed logins counted per source address and user name, shared by AMQP, the
//! management API and CMQ's signatures. Past `login-failures-before-delay` failures (a pair is
//! forgotten a minute after its last failure), each further attempt of that pair, right or wrong,
//! waits for its turn: one attempt per delay, the delay doubling from `FIRST_DELAY` up to
//! `login-delay-max-ms`. Attempts of one pair on many connections take turns too, so guessing a
//! password from one address goes no faster than one try per delay; other addresses and other
//! users are not slowed. A success clears the pair. The table is bounded: when it is full of recent
//! failures, pairs not in it are not counted (a full table must not lock real users out).
//!
//! [`HandshakeSlots`] (`warren_cluster::handshake_slots`, shared with the cluster port): AMQP
//! connections between accept and connection.open-ok, at most `max-handshakes` at once and
//! `max-handshakes-per-source` from one address (IPv6: one /64); past its source's share a
//! connection waits unread, up to the handshake timeout.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;
pub use warren_cluster::handshake_slots::{source_key, HandshakeSlot, HandshakeSlots, NoSlot};

/// The delay after the first failure past the threshold.
const FIRST_DELAY: Duration = Duration::from_millis(250);
/// A pair with no failure for this long is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(60);
/// Most pairs counted at once.
const MAX_PAIRS: usize = 65_536;

struct Failures {
    count: u32,
    last: Instant,
    /// When the pair's next attempt may be checked.
    next_turn: Instant,
}

pub struct LoginGuard {
    pairs: Mutex<HashMap<(IpAddr, String), Failures>>,
    /// Failures a pair may have before its attempts wait (0: never wait).
    free_failures: u32,
    max_delay: Duration,
}

impl LoginGuard {
    pub fn new(free_failures: u32, max_delay_ms: u64) -> LoginGuard {
        LoginGuard { pairs: Mutex::new(HashMap::new()), free_failures, max_delay: Duration::from_millis(max_delay_ms) }
    }

    fn delay_after(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(self.free_failures).min(20);
        FIRST_DELAY.saturating_mul(1 << doublings).min(self.max_delay)
    }

    /// Waits until this pair may try: at once unless it failed too often lately. Call before
    /// checking the credentials, then [`LoginGuard::failed`] or [`LoginGuard::succeeded`].
    pub async fn wait_turn(&self, source: IpAddr, user: &str) {
        if self.free_failures == 0 {
            return;
        }
        let turn = {
            let mut pairs = self.pairs.lock();
            if pairs.is_empty() {
                return;
            }
            let now = Instant::now();
            match pairs.get_mut(&(source_key(source), user.to_owned())) {
                Some(f) if f.count >= self.free_failures && now.duration_since(f.last) < FORGET_AFTER => {
                    let turn = f.next_turn.max(now);
                    f.next_turn = turn + self.delay_after(f.count);
                    Some(turn)
                }
                _ => None,
            }
        };
        if let Some(turn) = turn {
            tracing::debug!(%source, user, wait_ms = turn.saturating_duration_since(Instant::now()).as_millis() as u64, "login attempt waits: too many failures from this address");
            tokio::time::sleep_until(turn).await;
        }
    }

    pub fn failed(&self, source: IpAddr, user: &str) {
        if self.free_failures == 0 {
            return;
        }
        let mut pairs = self.pairs.lock();
        let now = Instant::now();
        let key = (source_key(source), user.to_owned());
        if !pairs.contains_key(&key) && pairs.len() >= MAX_PAIRS {
            pairs.retain(|_, f| now.duration_since(f.last) < FORGET_AFTER);
            if pairs.len() >= MAX_PAIRS {
                return;
            }
        }
        let f = pairs.entry(key).or_insert(Failures { count: 0, last: now, next_turn: now });
        if now.duration_since(f.last) >= FORGET_AFTER {
            *f = Failures { count: 0, last: now, next_turn: now };
        }
        f.count = f.count.saturating_add(1);
        f.last = now;
    }

    pub fn succeeded(&self, source: IpAddr, user: &str) {
        if self.free_failures == 0 {
            return;
        }
        let mut pairs = self.pairs.lock();
        if !pairs.is_empty() {
            pairs.remove(&(source_key(source), user.to_owned()));
        }
    }
}

/// Logs refused handshakes at most once every `REFUSED_LOG_EVERY`, with how many there were.
#[derive(Default)]
pub struct RefusedHandshakes {
    last: Option<Instant>,
    since: u64,
}

const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

impl RefusedHandshakes {
    pub fn note(&mut self, peer: std::net::SocketAddr, why: NoSlot) {
        self.since += 1;
        if self.last.is_some_and(|t| t.elapsed() < REFUSED_LOG_EVERY) {
            return;
        }
        let why = match why {
            NoSlot::All(n) => format!("{n} connections are in their handshake (max-handshakes)"),
            NoSlot::Source(n) => format!("{n} connections from this address are in their handshake (max-handshakes-per-source) past the handshake timeout"),
            NoSlot::Waiting(n) => format!("{n} connections wait for a handshake slot of their address (max-handshakes)"),
        };
        tracing::warn!(%peer, refused = self.since, "connection closed at once: {why}");
        self.last = Some(Instant::now());
        self.since = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_pair_past_its_free_failures_takes_turns_and_a_success_clears_it() {
        let guard = LoginGuard::new(2, 1000);
        let (me, other) = (ip("10.0.0.1"), ip("10.0.0.2"));
        let timed = |user: &'static str, source: IpAddr| {
            let guard = &guard;
            async move {
                let started = tokio::time::Instant::now();
                guard.wait_turn(source, user).await;
                started.elapsed()
            }
        };
        for _ in 0..2 {
            assert_eq!(timed("u", me).await, Duration::ZERO);
            guard.failed(me, "u");
        }
        // Past the free failures: the first attempt goes, the next waits one delay (250 ms), the
        // delay doubling with each failure, up to the maximum.
        assert_eq!(timed("u", me).await, Duration::ZERO);
        for wait_ms in [250, 500, 1000, 1000] {
            guard.failed(me, "u");
            assert_eq!(timed("u", me).await, Duration::from_millis(wait_ms));
        }
        // Other users and other sources go at once.
        assert_eq!(timed("v", me).await, Duration::ZERO);
        assert_eq!(timed("u", other).await, Duration::ZERO);
        guard.succeeded(me, "u");
        assert_eq!(timed("u", me).await, Duration::ZERO, "a success clears the pair");
        // Forgotten a minute after the last failure.
        for _ in 0..4 {
            guard.failed(me, "w");
        }
        tokio::time::advance(FORGET_AFTER).await;
        assert_eq!(timed("w", me).await, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_attempts_of_one_pair_take_turns() {
        let guard = LoginGuard::new(1, 10_000);
        let me = ip("10.0.0.1");
        guard.failed(me, "u");
        let started = tokio::time::Instant::now();
        let attempt = || async {
            guard.wait_turn(me, "u").await;
            started.elapsed().as_millis()
        };
        let (a, b, c, d) = tokio::join!(attempt(), attempt(), attempt(), attempt());
        let mut ms = vec![a, b, c, d];
        ms.sort_unstable();
        // One failure past none free: turns 250 ms apart (no failure in between to double it).
        assert_eq!(ms, vec![0, 250, 500, 750]);
    }
}
