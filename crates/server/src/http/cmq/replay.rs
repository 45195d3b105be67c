//! Replayed requests: a signed request captured on the way (CMQ's API is plain HTTP unless TLS is
//! in front) and sent again must not run twice, whatever its `Timestamp` still allows (300 s). A
//! request is known by its `Timestamp` and its signature, which covers every parameter, `Nonce`
//! included: the same signature at the same second is the same request. Clients send a new
//! `Nonce` with each request (Tencent's SDK: a random one), so only a copy is refused.
//!
//! Memory is bounded: at most [`CAPACITY`] requests are remembered, in `Timestamp` order. When the
//! oldest must go to make room, requests at or before its second are refused from then on as too
//! old (the window shrinks under load: at 100,000 requests a second it is about ten seconds),
//! so a forgotten request can never be replayed. Requests dated in the future do not shrink it
//! before those dated earlier.

use std::collections::hash_map::RandomState;
use std::collections::BTreeSet;
use std::hash::BuildHasher;

use parking_lot::Mutex;

/// Requests remembered at most (16 bytes each in a B-tree: about 30 MB when full).
pub const CAPACITY: usize = 1 << 20;

/// Why a request was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The same request was taken before.
    Seen,
    /// Dated at or before `floor`, a second this node no longer remembers every request of.
    TooOld { floor: i64 },
}

pub struct SeenRequests {
    inner: Mutex<Inner>,
    /// Keyed per start: which signatures collide in 64 bits cannot be worked out from outside.
    hasher: RandomState,
}

struct Inner {
    /// (Timestamp, signature hash) of the requests taken, oldest first.
    seen: BTreeSet<(i64, u64)>,
    /// Requests dated at or before this second are refused: some of them were forgotten.
    floor: i64,
}

impl Default for SeenRequests {
    fn default() -> Self {
        SeenRequests { inner: Mutex::new(Inner { seen: BTreeSet::new(), floor: i64::MIN }), hasher: RandomState::new() }
    }
}

impl SeenRequests {
    /// Takes the request signed `signature` at `timestamp` unless it was taken before (or may
    /// have been). `oldest` is the earliest timestamp still accepted at all (now minus the allowed
    /// skew): requests before it are forgotten, the timestamp check refuses them anyway.
    pub fn admit(&self, timestamp: i64, signature: &str, oldest: i64) -> Result<(), Refused> {
        let key = (timestamp, self.hasher.hash_one(signature));
        let mut inner = self.inner.lock();
        while inner.seen.first().is_some_and(|(t, _)| *t < oldest) {
            inner.seen.pop_first();
        }
        if timestamp <= inner.floor {
            return Err(Refused::TooOld { floor: inner.floor });
        }
        if !inner.seen.insert(key) {
            return Err(Refused::Seen);
        }
        while inner.seen.len() > CAPACITY {
            if let Some((t, _)) = inner.seen.pop_first() {
                inner.floor = inner.floor.max(t);
            }
        }
        Ok(())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_refused_a_new_nonce_is_not() {
        let seen = SeenRequests::default();
        assert_eq!(seen.admit(1_000, "sig-a", 700), Ok(()));
        assert_eq!(seen.admit(1_000, "sig-a", 700), Err(Refused::Seen));
        assert_eq!(seen.admit(1_000, "sig-b", 700), Ok(()));
        assert_eq!(seen.admit(1_001, "sig-a", 700), Ok(()), "another second: another request");
    }

    #[test]
    fn requests_older_than_the_window_are_forgotten() {
        let seen = SeenRequests::default();
        for t in 0..100 {
            seen.admit(t, "sig", 0).unwrap();
        }
        seen.admit(500, "sig", 400).unwrap();
        assert_eq!(seen.len(), 1);
    }

    #[test]
    fn when_full_the_oldest_second_goes_and_is_refused_from_then_on() {
        let seen = SeenRequests::default();
        for i in 0..CAPACITY {
            seen.admit(10 + (i % 3) as i64, &i.to_string(), 0).unwrap();
        }
        assert_eq!(seen.admit(20, "future", 0), Ok(()));
        assert_eq!(seen.len(), CAPACITY);
        // One request of second 10 was forgotten: all of second 10 is refused now, a copy of
        // one remembered or not; later seconds are still taken.
        assert_eq!(seen.admit(10, "0", 0), Err(Refused::TooOld { floor: 10 }));
        assert_eq!(seen.admit(10, "new", 0), Err(Refused::TooOld { floor: 10 }));
        assert_eq!(seen.admit(11, "1", 0), Err(Refused::Seen));
        assert_eq!(seen.admit(11, "new", 0), Ok(()));
    }
}
